#!/usr/bin/env bash
# What a worker acknowledged outlives the worker: the orders Edge Function
# (the Idempotency-Key middleware in TypeScript, served by Deno) answers a
# keyed order, is killed with SIGKILL (as a platform stops a worker at its
# limits, with no chance to clean up), and a new worker answers the same
# request as a replay of that order, byte for byte. The middleware writes
# the journal before it answers, so nothing a caller was told is lost with
# the worker. Runs against a local plane:
#
#   cargo build --features local --bin idem
#   bash .ci/orders-worker-kill-check.sh target/debug/idem
set -euo pipefail

if [ "$#" -ne 1 ] || [ ! -x "$1" ] || [ -d "$1" ]; then
  echo "usage: $0 PATH/TO/idem   (built with: cargo build --features local --bin idem)" >&2
  exit 2
fi
idem="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
root="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=/dev/null
. "$root/.ci/js-tools.sh"
export DENO

cd "$root/supabase/functions"
exec bash "$root/.ci/with-local-plane.sh" "$idem" orders-worker-kill -- bash -c '
  set -euo pipefail
  work=$(mktemp -d "${TMPDIR:-/tmp}/orders-kill.XXXXXX")
  pid=""
  trap "[ -n \"\$pid\" ] && kill -KILL \$pid 2>/dev/null; rm -rf \"\$work\"" EXIT
  fail() { echo "orders worker kill: $*" >&2; cat "$work"/err.* >&2 2>/dev/null || true; exit 1; }
  # start N: a worker on a free port; sets pid and url.
  start() {
    PORT=0 "$DENO" run --no-prompt --allow-net --allow-env orders/index.ts >"$work/out.$1" 2>"$work/err.$1" </dev/null &
    pid=$!
    url=""
    for _ in $(seq 1 300); do
      url=$(sed -n "1s/^listening on //p" "$work/out.$1")
      [ -n "$url" ] && return 0
      kill -0 $pid 2>/dev/null || fail "worker $1 exited before listening"
      sleep 0.2
    done
    fail "worker $1 did not listen"
  }
  order() {
    curl -s -o "$work/$1.body" -D "$work/$1.head" -w "%{http_code}" "$url/orders" \
      -H "content-type: application/json" -H "idempotency-key: kill-1" --data-binary "{\"sku\":\"K\",\"qty\":1}"
  }
  start 1
  [ "$(order first)" = 201 ] || fail "the first order: $(cat "$work/first.body")"
  kill -KILL $pid
  wait $pid 2>/dev/null || true
  pid=""
  start 2
  [ "$(order again)" = 201 ] || fail "the repeat after the kill: $(cat "$work/again.body")"
  grep -qi "^idempotent-replayed: true" "$work/again.head" || fail "the repeat after the kill was not a replay"
  cmp -s "$work/first.body" "$work/again.body" || fail "the replay after the kill is not the first answer"
  echo "orders worker kill: an order answered, its worker killed (SIGKILL), the next worker replays it byte for byte"
'
