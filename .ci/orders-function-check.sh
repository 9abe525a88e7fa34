#!/usr/bin/env bash
# The orders Edge Function (supabase/functions/orders, the Idempotency-Key
# middleware in TypeScript) through the same black-box checks as the Rust
# orders_api example (.ci/orders-api-check.sh), served by Deno against a
# local plane. Pass an `idem` built with `--features local`:
#
#   cargo build --features local --bin idem
#   bash .ci/orders-function-check.sh target/debug/idem
#
# Installs Deno from npm, pinned (.ci/js-tools.sh: in target/js-tools,
# reused when that version is already there), starts `idem up --env-file` (a
# fresh database on the PostgreSQL at DATABASE_URL, default 127.0.0.1:5432),
# runs the function with the plane's IDEM_POSTGREST_URL and IDEM_SERVICE_KEY
# in its environment, as `IdempotencyPlane.fromEnv` reads them, and always
# stops the server (SIGTERM: it drops its database). Exits with the checks'
# status; non-zero also when the server cannot start or fails to stop cleanly.
set -euo pipefail

READY_TIMEOUT_S=60
STOP_TIMEOUT_S=15

if [ "$#" -ne 1 ]; then
  echo "usage: $0 PATH/TO/idem   (built with: cargo build --features local --bin idem)" >&2
  exit 2
fi
if [ ! -x "$1" ] || [ -d "$1" ]; then
  echo "orders-function: '$1' is not an executable; build it with: cargo build --features local --bin idem" >&2
  exit 2
fi
idem="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
root="$(cd "$(dirname "$0")/.." && pwd)"
say() { echo "orders-function: $*"; }

# Deno, pinned, from npm (.ci/js-tools.sh, shared with every TypeScript check).
# shellcheck source=/dev/null
. "$root/.ci/js-tools.sh"
deno="$DENO"

work="$(mktemp -d "${TMPDIR:-/tmp}/idem-orders-function.XXXXXX")"
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
      echo "orders-function: idem up (pid $pid) did not stop within ${STOP_TIMEOUT_S} s; killing it" \
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

"$idem" up --env-file "$env_file" >"$log" 2>&1 </dev/null &
server_pid=$!

deadline=$((SECONDS + READY_TIMEOUT_S))
# The file appears whole (idem writes it beside and renames it).
until [ -s "$env_file" ]; do
  if ! kill -0 "$server_pid" 2>/dev/null; then
    echo "orders-function: idem up exited before it was ready" >&2
    show_log
    exit 1
  fi
  if [ "$SECONDS" -ge "$deadline" ]; then
    echo "orders-function: idem up was not ready within ${READY_TIMEOUT_S} s" >&2
    show_log
    exit 1
  fi
  sleep 0.2
done

set -a
# shellcheck disable=SC1090
. "$env_file"
set +a
say "idem up serving at $IDEM_POSTGREST_URL"

status=0
cd "$root/supabase/functions"
ORDERS_CHECK_NAME="orders function (deno)" bash "$root/.ci/orders-api-check.sh" -- \
  "$deno" run --no-prompt --allow-net --allow-env orders/index.ts || status=$?

stop_status=0
stop_server || stop_status=$?
if [ "$stop_status" -ne 0 ]; then
  echo "orders-function: idem up exited with status $stop_status when stopped" >&2
  show_log
  [ "$status" -ne 0 ] || status=1
elif [ "$status" -ne 0 ]; then
  show_log
fi
exit "$status"
