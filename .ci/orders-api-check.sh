#!/usr/bin/env bash
# The orders API, driven with curl as the README shows, against either server
# with the same checks: a first request creates an order (201, Location), a
# repeat replays it byte for byte with Idempotent-Replayed: true, a changed
# body under the same key is 422, a repeat while the first is in flight is
# 409 with Retry-After, a request without a key, with an over-long key or an
# empty one is 400 — every refusal application/problem+json of its type.
#
#   .ci/orders-api-check.sh target/debug/examples/orders_api       the Rust example
#   .ci/orders-api-check.sh -- COMMAND [ARG...]                     any server, e.g. the Edge Function:
#   (cd supabase/functions && ../../.ci/orders-api-check.sh -- deno run --allow-net --allow-env orders/index.ts)
#
# The server is started with PORT=0 and no stdin, must print
# `listening on http://HOST:PORT` as its first line on stdout, and is stopped
# (SIGINT to its process group, then SIGKILL after 10 s) on every exit. Whatever it needs besides
# (the Deno function: the plane's IDEM_POSTGREST_URL and IDEM_SERVICE_KEY) is
# the caller's environment; .ci/orders-function-check.sh sets it up.
set -euo pipefail
usage() {
  echo "usage: $0 PATH/TO/SERVER | $0 -- COMMAND [ARG...]" >&2
  exit 2
}
if [ "${1:-}" = "--" ]; then
  shift
  [ "$#" -ge 1 ] || usage
  command=("$@")
else
  [ "$#" -eq 1 ] || usage
  command=("$1")
fi
name=${ORDERS_CHECK_NAME:-$(basename "${command[0]}")}

work=$(mktemp -d "${TMPDIR:-/tmp}/orders-check.XXXXXX")
out=$work/out err=$work/err
# A process group of its own (job control), so that stopping it stops what it started.
set -m
PORT=0 "${command[@]}" >"$out" 2>"$err" </dev/null &
pid=$!
set +m
slow=""
stop() {
  [ -n "$slow" ] && kill "$slow" 2>/dev/null
  if kill -0 "$pid" 2>/dev/null; then
    kill -INT -- "-$pid" 2>/dev/null
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL -- "-$pid" 2>/dev/null
  fi
  wait "$pid" 2>/dev/null
  rm -rf "$work"
}
trap 'stop || true' EXIT
fail() {
  echo "$name: $*" >&2
  echo "---- $name stderr ----" >&2
  cat "$err" >&2 || true
  exit 1
}
for _ in $(seq 1 300); do
  grep -q '^listening on ' "$out" && break
  kill -0 $pid 2>/dev/null || fail "exited before listening"
  sleep 0.2
done
url=$(sed -n '1s/^listening on //p' "$out")
[ -n "$url" ] || fail "printed no 'listening on' line first"

# send NAME QUERY BODY [CURL ARG...]: answers the status; the headers and body land in $work/NAME.head and .body.
send() {
  curl -s -o "$work/$1.body" -D "$work/$1.head" -w '%{http_code}' "$url/orders$2" \
    -H 'content-type: application/json' "${@:4}" --data-binary "$3"
}
# header NAME FIELD: the field's value in that answer ('' when absent).
header() { grep -i "^$2:" "$work/$1.head" | head -n 1 | cut -d: -f2- | tr -d '\r' | sed 's/^ *//'; }
expect() { [ "$2" = "$3" ] || fail "$1: expected $3, got $2"; }
# problem WHAT NAME GOT EXPECTED SLUG: that answer is an RFC 9457 problem of the type.
problem() {
  expect "$1" "$3" "$4"
  expect "$1: content type" "$(header "$2" content-type)" application/problem+json
  grep -qF "\"type\":\"https://github.com/idempotency-plane/idempotency-plane#idempotency-key-problems-$5\"" \
    "$work/$2.body" || fail "$1: not a $5 problem: $(cat "$work/$2.body")"
}

expect "the first request" "$(send first '' '{"sku":"A","qty":1}' -H 'idempotency-key: ci-1')" 201
location=$(header first location)
[[ "$location" == /orders/* ]] || fail "the first answer's Location is '$location'"
[ -z "$(header first idempotent-replayed)" ] || fail "the first answer is marked replayed"
expect "the repeat" "$(send again '' '{"qty":1,"sku":"A"}' -H 'idempotency-key: ci-1')" 201
expect "the repeat's Idempotent-Replayed" "$(header again idempotent-replayed)" true
expect "the repeat's Location" "$(header again location)" "$location"
cmp -s "$work/first.body" "$work/again.body" || fail "the replay is not the first answer"

problem "changed body" changed "$(send changed '' '{"sku":"B"}' -H 'idempotency-key: ci-1')" 422 key-reused

send slow '?delay_ms=5000' '{}' -H 'idempotency-key: ci-2' >"$work/slow.status" &
slow=$!
# The same request while the first runs: 409. The first gets a second's head
# start (its claim takes milliseconds) and holds the key for five.
sleep 1
problem "in flight" busy "$(send busy '?delay_ms=5000' '{}' -H 'idempotency-key: ci-2')" 409 in-flight
[ -n "$(header busy retry-after)" ] || fail "in flight: no Retry-After"
wait $slow
slow=""
expect "the slow first request" "$(cat "$work/slow.status")" 201

problem "no key" nokey "$(send nokey '' '{}')" 400 missing-key
long=$(printf 'k%.0s' $(seq 1 256))
problem "a 256-character key" long "$(send long '' '{}' -H "idempotency-key: $long")" 400 malformed-key
problem "an empty key" empty "$(send empty '' '{}' -H 'idempotency-key;')" 400 malformed-key
echo "$name: created, replayed, 422, 409 with Retry-After, 400 (no key, long key, empty key) as described"
