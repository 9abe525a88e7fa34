#!/usr/bin/env bash
# The TypeScript client's tests, on the real runtimes, against the embedded
# local plane: Deno (pinned, from npm) runs supabase/functions/tests/*_test.ts,
# and Node.js runs the same module once (node_check.ts, through tsx). Builds
# nothing: pass an `idem` built with `--features local`.
#
#   cargo build --features local --bin idem
#   bash supabase/functions/tests/run.sh target/debug/idem
#
# Starts `idem up --env-file` (a fresh database, dropped on stop), waits for
# it, runs the tests, and always stops it. Exits non-zero when a test fails.
set -euo pipefail

READY_TIMEOUT_S=60
STOP_TIMEOUT_S=15

if [ "$#" -ne 1 ] || [ ! -x "$1" ] || [ -d "$1" ]; then
  echo "usage: $0 PATH/TO/idem   (built with: cargo build --features local --bin idem)" >&2
  exit 2
fi
idem="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
functions="$(cd "$(dirname "$0")/.." && pwd)"
root="$(cd "$functions/../.." && pwd)"
# shellcheck source=/dev/null
. "$root/.ci/js-tools.sh"

work="$(mktemp -d "${TMPDIR:-/tmp}/idem-ts.XXXXXX")"
env_file="$work/plane.env"
log="$work/up.log"
server_pid=""

stop_server() {
  local pid="$server_pid" status=0 waited=0
  [ -n "$pid" ] || return 0
  server_pid=""
  kill -TERM "$pid" 2>/dev/null || true
  while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt $((STOP_TIMEOUT_S * 10)) ]; do
    sleep 0.1
    waited=$((waited + 1))
  done
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || status=$?
  return "$status"
}
cleanup() {
  local status=$?
  trap - EXIT
  stop_server || true
  [ "$status" -eq 0 ] || { echo "---- idem up output ----" >&2; cat "$log" >&2 || true; }
  rm -rf "$work"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

"$idem" up --env-file "$env_file" >"$log" 2>&1 </dev/null &
server_pid=$!
deadline=$((SECONDS + READY_TIMEOUT_S))
until [ -s "$env_file" ]; do
  kill -0 "$server_pid" 2>/dev/null || { echo "ts-tests: idem up exited before it was ready" >&2; exit 1; }
  [ "$SECONDS" -lt "$deadline" ] || { echo "ts-tests: idem up was not ready within ${READY_TIMEOUT_S} s" >&2; exit 1; }
  sleep 0.2
done
set -a
# shellcheck source=/dev/null
. "$env_file"
set +a

cd "$functions"
echo "ts-tests: $("$DENO" --version | head -n 1), against $IDEM_POSTGREST_URL"
"$DENO" fmt --check
"$DENO" lint
"$DENO" check --frozen _shared/idempotency/mod.ts orders/index.ts tests/
"$DENO" test --frozen --allow-net --allow-env --allow-read tests/
echo "ts-tests: node $(node --version), tsx $("$TSX" --version | sed -n 's/^tsx v//p')"
"$TSX" tests/node_check.ts
