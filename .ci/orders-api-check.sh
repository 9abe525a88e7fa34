#!/usr/bin/env bash
# The orders_api example, driven with curl as the README shows: a first
# request creates an order, a repeat replays it, a changed body under the
# same key is 422, a repeat while the first is in flight is 409, a request
# without a key is 400. Usage: .ci/orders-api-check.sh path/to/orders_api
set -euo pipefail
binary=$1
out=$(mktemp) err=$(mktemp)
PORT=0 "$binary" >"$out" 2>"$err" &
pid=$!
trap 'kill -INT $pid 2>/dev/null; wait $pid 2>/dev/null; rm -f "$out" "$err"' EXIT
for _ in $(seq 1 300); do
  grep -q '^listening on ' "$out" && break
  kill -0 $pid 2>/dev/null || { cat "$err" >&2; echo "orders_api exited before listening" >&2; exit 1; }
  sleep 0.2
done
url=$(sed -n '1s/^listening on //p' "$out")
[ -n "$url" ] || { echo "orders_api printed no 'listening on' line first" >&2; exit 1; }

post() { curl -s -o /dev/null -w '%{http_code}' "$url/orders$1" -H 'content-type: application/json' "${@:3}" -d "$2"; }
expect() { [ "$2" = "$3" ] || { echo "orders_api: $1: expected $3, got $2" >&2; exit 1; }; }

first=$(curl -s "$url/orders" -H 'idempotency-key: ci-1' -H 'content-type: application/json' -d '{"sku":"A","qty":1}')
again=$(curl -s -D - "$url/orders" -H 'idempotency-key: ci-1' -H 'content-type: application/json' -d '{"qty":1,"sku":"A"}')
grep -qi '^idempotent-replayed: true' <<<"$again" || { echo "orders_api: the repeat was not a replay" >&2; exit 1; }
grep -qF "$first" <<<"$again" || { echo "orders_api: the replay is not the first answer" >&2; exit 1; }
expect "changed body" "$(post '' '{"sku":"B"}' -H 'idempotency-key: ci-1')" 422
slow_status=$(mktemp)
post '?delay_ms=5000' '{}' -H 'idempotency-key: ci-2' >"$slow_status" &
slow=$!
# The same request while the first runs: 409. The first gets a second's head
# start (its claim takes milliseconds) and holds the key for five.
sleep 1
expect "in flight" "$(post '?delay_ms=5000' '{}' -H 'idempotency-key: ci-2')" 409
wait $slow
expect "the slow first request" "$(cat "$slow_status")" 201
rm -f "$slow_status"
expect "no key" "$(post '' '{}')" 400
echo "orders_api: created, replayed, 422, 409, 400 as described"
