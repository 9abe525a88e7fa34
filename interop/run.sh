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

# Starts `idem up`, runs the check against it, always stops it.
IDEM_BIN="$idem" exec bash "$root/.ci/with-local-plane.sh" "$idem" interop -- node check.mjs
