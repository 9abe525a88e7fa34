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

# Deno, pinned, from npm (.ci/js-tools.sh, shared with every TypeScript check).
# shellcheck source=/dev/null
. "$root/.ci/js-tools.sh"
deno="$DENO"

cd "$root/supabase/functions"
ORDERS_CHECK_NAME="orders function (deno)" exec bash "$root/.ci/with-local-plane.sh" "$idem" orders-function -- \
  bash "$root/.ci/orders-api-check.sh" -- "$deno" run --no-prompt --allow-net --allow-env orders/index.ts
