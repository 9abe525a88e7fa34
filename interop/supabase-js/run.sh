#!/usr/bin/env bash
# Interop: @supabase/supabase-js under Deno, the way a Supabase Edge Function
# uses it (`createClient(SUPABASE_URL, key).schema('agent').rpc(...)`), against
# the embedded server (`idem up`), which answers beneath /rest/v1 as Supabase
# does. Builds nothing: pass an `idem` built with `--features local`.
#
#   cargo build --features local --bin idem
#   bash interop/supabase-js/run.sh target/debug/idem
#
# Installs the pinned Deno from npm (.ci/js-tools.sh: into target/js-tools,
# which also holds Deno's cache of npm packages); starts
# `idem up --env-file` in the background (a fresh database on the PostgreSQL
# at DATABASE_URL, default 127.0.0.1:5432), waits for it, runs check.ts with
# the env file's SUPABASE_URL, SUPABASE_SERVICE_ROLE_KEY and SUPABASE_ANON_KEY
# (supabase-js pinned by deno.json, its packages by deno.lock, frozen), and
# always stops the server (SIGTERM: it stops serving and drops its
# database). Needs Node.js and npm for the install, and no stdin. Exits with
# the check's status; non-zero also when the server cannot start or fails
# to stop cleanly.
set -euo pipefail

READY_TIMEOUT_S=60
STOP_TIMEOUT_S=15
CHECK_TIMEOUT_S=300

if [ "$#" -ne 1 ]; then
  echo "usage: $0 PATH/TO/idem   (built with: cargo build --features local --bin idem)" >&2
  exit 2
fi
if [ ! -x "$1" ] || [ -d "$1" ]; then
  echo "supabase-js interop: '$1' is not an executable; build it with: cargo build --features local --bin idem" >&2
  exit 2
fi
idem="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
here="$(cd "$(dirname "$0")" && pwd)"
# The pinned Deno (from npm), shared with the TypeScript client's tests.
# shellcheck source=/dev/null
. "$here/../../.ci/js-tools.sh"
deno="$DENO"
export DENO_NO_UPDATE_CHECK=1
echo "supabase-js interop: $("$deno" --version | head -n 1), $(grep -o 'npm:@supabase/supabase-js@[0-9.]*' "$here/deno.json")"

work="$(mktemp -d "${TMPDIR:-/tmp}/idem-supabase-js.XXXXXX")"
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
      echo "supabase-js interop: idem up (pid $pid) did not stop within ${STOP_TIMEOUT_S} s; killing it" \
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

"$idem" up --env-file "$env_file" </dev/null >"$log" 2>&1 &
server_pid=$!

deadline=$((SECONDS + READY_TIMEOUT_S))
until [ -s "$env_file" ]; do
  if ! kill -0 "$server_pid" 2>/dev/null; then
    echo "supabase-js interop: idem up exited before it was ready" >&2
    show_log
    exit 1
  fi
  if [ "$SECONDS" -ge "$deadline" ]; then
    echo "supabase-js interop: idem up was not ready within ${READY_TIMEOUT_S} s" >&2
    show_log
    exit 1
  fi
  sleep 0.2
done

set -a
# shellcheck disable=SC1090
. "$env_file"
set +a
echo "supabase-js interop: idem up serving at $SUPABASE_URL (supabase-js calls $SUPABASE_URL/rest/v1)"

status=0
(
  cd "$here"
  timeout "$CHECK_TIMEOUT_S" "$deno" run --config deno.json --frozen --check --no-prompt \
    --allow-net --allow-env check.ts </dev/null
) || status=$?

stop_status=0
stop_server || stop_status=$?
if [ "$stop_status" -ne 0 ]; then
  echo "supabase-js interop: idem up exited with status $stop_status when stopped" >&2
  show_log
  [ "$status" -ne 0 ] || status=1
elif [ "$status" -ne 0 ]; then
  show_log
else
  echo "supabase-js interop: $(grep -m1 '^stopped;' "$log" || echo 'idem up stopped')"
fi
exit "$status"
