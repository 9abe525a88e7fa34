#!/usr/bin/env bash
# Runs a command against a fresh local plane: starts `idem up --env-file` (a
# fresh database on the PostgreSQL at DATABASE_URL, default 127.0.0.1:5432),
# waits for it, runs COMMAND with the env file's variables exported
# (IDEM_POSTGREST_URL, IDEM_SERVICE_KEY, IDEM_MAX_ROWS, SUPABASE_URL,
# SUPABASE_SERVICE_ROLE_KEY, SUPABASE_ANON_KEY, SUPABASE_SECRET_KEYS,
# SUPABASE_PUBLISHABLE_KEYS),
# IDEM_BIN (the idem binary itself) and IDEM_TEST_DATABASE_URL (a superuser
# URL of the database served), and
# always stops the server (SIGTERM: it stops serving and drops its database).
#
#   bash .ci/with-local-plane.sh PATH/TO/idem LABEL -- COMMAND [ARG...]
#
# IDEM_UP_ARGS, when set, is passed on to `idem up` (split on spaces), e.g.
# "--with-pgmq --queue orders --queue orders_dlq".
#
# Exits with the command's status; non-zero also when the server cannot
# start or fails to stop cleanly. The server's output is shown on failure.
# Every interop and TypeScript check runs through this one script.
set -euo pipefail

READY_TIMEOUT_S=60
STOP_TIMEOUT_S=15

if [ "$#" -lt 4 ] || [ "$3" != "--" ]; then
  echo "usage: $0 PATH/TO/idem LABEL -- COMMAND [ARG...]" >&2
  exit 2
fi
if [ ! -x "$1" ] || [ -d "$1" ]; then
  echo "$2: '$1' is not an executable; build it with: cargo build --features local --bin idem" >&2
  exit 2
fi
idem="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
label=$2
shift 3

work="$(mktemp -d "${TMPDIR:-/tmp}/idem-plane.XXXXXX")"
env_file="$work/plane.env"
log="$work/up.log"
server_pid=""

# Stops `idem up` if it is running and answers its exit status.
stop_server() {
  local pid="$server_pid" status=0 waited=0
  [ -n "$pid" ] || return 0
  server_pid=""
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt $((STOP_TIMEOUT_S * 10)) ]; do
      sleep 0.1
      waited=$((waited + 1))
    done
    if kill -0 "$pid" 2>/dev/null; then
      echo "$label: idem up (pid $pid) did not stop within ${STOP_TIMEOUT_S} s; killing it" \
        "(its database is left for a later start to drop)" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  wait "$pid" 2>/dev/null || status=$?
  return "$status"
}

show_log() {
  echo "---- idem up output ----" >&2
  cat "$log" >&2 || true
  echo "------------------------" >&2
}

cleanup() {
  local status=$?
  trap - EXIT
  stop_server || true
  rm -rf "$work"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# shellcheck disable=SC2086
"$idem" up --env-file "$env_file" ${IDEM_UP_ARGS:-} </dev/null >"$log" 2>&1 &
server_pid=$!

deadline=$((SECONDS + READY_TIMEOUT_S))
# The file appears whole (idem writes it beside and renames it).
until [ -s "$env_file" ]; do
  if ! kill -0 "$server_pid" 2>/dev/null; then
    echo "$label: idem up exited before it was ready" >&2
    show_log
    exit 1
  fi
  if [ "$SECONDS" -ge "$deadline" ]; then
    echo "$label: idem up was not ready within ${READY_TIMEOUT_S} s" >&2
    show_log
    exit 1
  fi
  sleep 0.2
done

set -a
# shellcheck disable=SC1090
. "$env_file"
set +a
# The binary serving this plane, for a command that calls the CLI too.
export IDEM_BIN="$idem"
# A superuser URL of the database served, for a test that checks what the
# API cannot show (pgmq's archive): DATABASE_URL's (or the default cluster's)
# with the served database's name.
served_db="$(sed -n 's/^  database  *\([a-z0-9_]*\) .*/\1/p' "$log" | head -n 1)"
cluster_url="${DATABASE_URL:-postgresql://postgres@127.0.0.1:5432/postgres}"
cluster_query=""
case "$cluster_url" in *\?*) cluster_query="?${cluster_url#*\?}"; cluster_url="${cluster_url%%\?*}" ;; esac
export IDEM_TEST_DATABASE_URL="${cluster_url%/*}/${served_db}${cluster_query}"
server_version="$(psql -X "$IDEM_TEST_DATABASE_URL" -tAc 'show server_version_num' 2>/dev/null || echo unknown)"
echo "$label: idem up serving at $IDEM_POSTGREST_URL (also beneath /rest/v1; max rows $IDEM_MAX_ROWS), on PostgreSQL $server_version"
# A run meant for one major version (IDEM_EXPECT_PG_MAJOR, set by
# .ci/with-postgres-17.sh) fails on another.
if [ -n "${IDEM_EXPECT_PG_MAJOR:-}" ] && { ! [[ "$server_version" =~ ^[0-9]+$ ]] || [ "$((server_version / 10000))" != "$IDEM_EXPECT_PG_MAJOR" ]; }; then
  echo "$label: expected PostgreSQL $IDEM_EXPECT_PG_MAJOR, the plane runs on $server_version" >&2
  stop_server || true
  exit 1
fi

status=0
"$@" </dev/null || status=$?

stop_status=0
stop_server || stop_status=$?
if [ "$stop_status" -ne 0 ]; then
  echo "$label: idem up exited with status $stop_status when stopped" >&2
  show_log
  [ "$status" -ne 0 ] || status=1
elif [ "$status" -ne 0 ]; then
  show_log
else
  echo "$label: $(grep -m1 '^stopped;' "$log" || echo 'idem up stopped')"
fi
exit "$status"
