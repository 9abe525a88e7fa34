#!/usr/bin/env bash
# Installs pgmq's own SQL into the database at URL, as the `pgmq` crate
# embeds it (its pgmq.sql at the control file's version, then every upgrade
# script from that version up, in version order): what `idem up
# --with-pgmq` installs, for a database the scripts did not make. No
# extension files are needed on the server.
#
#   bash .ci/install-pgmq.sh postgresql://postgres@127.0.0.1:5432/db
set -euo pipefail

[ "$#" -eq 1 ] || { echo "usage: $0 DATABASE_URL" >&2; exit 2; }
url="$1"
root="$(cd "$(dirname "$0")/.." && pwd)"

manifest="$(cd "$root" && cargo metadata --format-version 1 --locked --features local --filter-platform "$(rustc -vV | sed -n "s/^host: //p")" |
  python3 -c 'import json, sys; print(next(p["manifest_path"] for p in json.load(sys.stdin)["packages"] if p["name"] == "pgmq"))')"
dir="$(dirname "$manifest")/src/install/embedded"
version="$(sed -n "s/^default_version *= *'\([0-9.]*\)'.*/\1/p" "$dir/pgmq.control")"
[ -n "$version" ] || { echo "install-pgmq: no default_version in $dir/pgmq.control" >&2; exit 1; }

run() { psql "$url" -X -q -v ON_ERROR_STOP=1 -f "$1" >/dev/null; }
run "$dir/sql/pgmq.sql"
# Upgrade scripts are named pgmq--FROM--TO.sql; those from the installed
# version up, lowest first.
for script in $(cd "$dir/sql" && ls pgmq--*--*.sql | sort -t- -k3,3V); do
  from="${script#pgmq--}"
  from="${from%%--*}"
  if [ "$(printf '%s\n%s\n' "$version" "$from" | sort -V | head -n 1)" = "$version" ]; then
    run "$dir/sql/$script"
  fi
done
echo "install-pgmq: pgmq $version and its upgrades installed"
