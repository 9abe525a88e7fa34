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

cd "$here"
exec bash "$here/../../.ci/with-local-plane.sh" "$idem" "supabase-js interop" -- \
  timeout "$CHECK_TIMEOUT_S" "$deno" run --config deno.json --frozen --check --no-prompt \
  --allow-net --allow-env check.ts
