#!/usr/bin/env bash
# Interop: @supabase/postgrest-js (npm), the client a Supabase Edge Function
# uses, calls the plane's SQL surface through the embedded PostgREST-compatible
# server. Builds nothing: pass an `idem` built with `--features local`.
#
#   cargo build --features local --bin idem
#   bash interop/run.sh target/debug/idem
#
# Installs the pinned package (npm ci, from package-lock.json), starts
# `idem up --env-file` in the background (a fresh database on the PostgreSQL
# at DATABASE_URL, default 127.0.0.1:5432), waits for it, runs
# interop/postgrest-js/check.mjs against it, and always stops the server
# (SIGTERM: it stops serving and drops its database). Exits with the check's
# status; non-zero also when the server cannot start or fails to stop cleanly.
set -euo pipefail

READY_TIMEOUT_S=60
STOP_TIMEOUT_S=15

if [ "$#" -ne 1 ]; then
  echo "usage: $0 PATH/TO/idem   (built with: cargo build --features local --bin idem)" >&2
  exit 2
fi
if [ ! -x "$1" ] || [ -d "$1" ]; then
  echo "interop: '$1' is not an executable; build it with: cargo build --features local --bin idem" >&2
  exit 2
fi
idem="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
root="$(cd "$(dirname "$0")/.." && pwd)"
for tool in node npm; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "interop: '$tool' is not on PATH; the postgrest-js check needs Node.js (20 or later) and npm" >&2
    exit 2
  fi
done

cd "$root/interop/postgrest-js"
echo "interop: node $(node --version), @supabase/postgrest-js $(node -p "require('./package.json').dependencies['@supabase/postgrest-js']")"
npm ci --no-audit --no-fund --loglevel=error

work="$(mktemp -d "${TMPDIR:-/tmp}/idem-interop.XXXXXX")"
env_file="$work/plane.env"
log="$work/up.log"
server_pid=""

# Stops `idem up` if it is running and answers its exit status.
stop_server() {
  local pid="$server_pid" status=0
  [ -n "$pid" ] || return 0
  server_pid=""
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    local waited=0
    while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt $((STOP_TIMEOUT_S * 10)) ]; do
      sleep 0.1
      waited=$((waited + 1))
    done
    if kill -0 "$pid" 2>/dev/null; then
      echo "interop: idem up (pid $pid) did not stop within ${STOP_TIMEOUT_S} s; killing it" \
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

"$idem" up --env-file "$env_file" >"$log" 2>&1 &
server_pid=$!

deadline=$((SECONDS + READY_TIMEOUT_S))
until [ -s "$env_file" ]; do
  if ! kill -0 "$server_pid" 2>/dev/null; then
    echo "interop: idem up exited before it was ready" >&2
    show_log
    exit 1
  fi
  if [ "$SECONDS" -ge "$deadline" ]; then
    echo "interop: idem up was not ready within ${READY_TIMEOUT_S} s" >&2
    show_log
    exit 1
  fi
  sleep 0.2
done

set -a
# shellcheck disable=SC1090
. "$env_file"
set +a
echo "interop: idem up serving at $IDEM_POSTGREST_URL (max rows $IDEM_MAX_ROWS)"

status=0
IDEM_BIN="$idem" node check.mjs || status=$?

stop_status=0
stop_server || stop_status=$?
if [ "$stop_status" -ne 0 ]; then
  echo "interop: idem up exited with status $stop_status when stopped" >&2
  show_log
  [ "$status" -ne 0 ] || status=1
elif [ "$status" -ne 0 ]; then
  show_log
else
  echo "interop: $(grep -m1 '^stopped;' "$log" || echo 'idem up stopped')"
fi
exit "$status"
