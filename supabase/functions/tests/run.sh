#!/usr/bin/env bash
# The TypeScript client's tests, on the real runtimes, against the embedded
# local plane: Deno (pinned, from npm) runs supabase/functions/tests/*_test.ts,
# and Node.js runs the same module once (node_check.ts, through tsx), then
# once more as the npm package a user installs (.ci/ts-package.sh). Builds
# nothing: pass an `idem` built with `--features local`, with the example
# Rust gate and echo API built beside it.
#
#   cargo build --features local --bin idem --example webhook_gate --example echo_api --example queue_consumer
#   bash supabase/functions/tests/run.sh target/debug/idem
#
# Starts `idem up --env-file` (a fresh database, dropped on stop), waits for
# it, runs the tests, and always stops it. Exits non-zero when a test fails.
set -euo pipefail


if [ "$#" -ne 1 ] || [ ! -x "$1" ] || [ -d "$1" ]; then
  echo "usage: $0 PATH/TO/idem   (built with: cargo build --features local --bin idem --example webhook_gate --example echo_api --example queue_consumer)" >&2
  exit 2
fi
idem="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
# The Rust processes, beside idem: the gate (examples/webhook_gate.rs), which
# the kill test drives as it drives the Edge Function, the echo API
# behind the Idempotency-Key layer (examples/echo_api.rs), whose answers the
# cross-client test replays through the TypeScript client, and back, and the
# queue consumer (examples/queue_consumer.rs), which the queue kill test
# runs and kills beside the Edge Function's.
WEBHOOK_GATE_BIN="$(dirname "$idem")/examples/webhook_gate"
ECHO_API_BIN="$(dirname "$idem")/examples/echo_api"
QUEUE_CONSUMER_BIN="$(dirname "$idem")/examples/queue_consumer"
for example in "$WEBHOOK_GATE_BIN" "$ECHO_API_BIN" "$QUEUE_CONSUMER_BIN"; do
  if [ ! -x "$example" ]; then
    echo "ts-tests: $example is missing; build it with: cargo build --features local --example $(basename "$example")" >&2
    exit 2
  fi
done
export WEBHOOK_GATE_BIN ECHO_API_BIN QUEUE_CONSUMER_BIN
functions="$(cd "$(dirname "$0")/.." && pwd)"
root="$(cd "$functions/../.." && pwd)"
# shellcheck source=/dev/null
. "$root/.ci/js-tools.sh"

# Supabase Queues for the queue consumer's tests: pgmq, its pgmq_public
# wrappers, and a queue and dead-letter queue per test file.
export IDEM_UP_ARGS="--with-pgmq --queue consumer_test --queue consumer_test_dlq --queue kill_test --queue kill_test_dlq --queue partition_test --queue partition_test_dlq --queue telemetry_test --queue telemetry_test_dlq"

# The packages (JSR, npm) are built and tried inside the plane's run, so
# the installed npm package's Node check makes its round trip too.
export IDEM_REPO_ROOT="$root"
cd "$functions"
echo "ts-tests: $("$DENO" --version | head -n 1), node $(node --version), tsx $("$TSX" --version | sed -n 's/^tsx v//p')"
exec bash "$root/.ci/with-local-plane.sh" "$idem" ts-tests -- bash -c '
  set -euo pipefail
  "$DENO" fmt --check
  "$DENO" lint
  "$DENO" check --frozen _shared/idempotency/mod.ts create-order/index.ts orders/index.ts webhooks/index.ts queue-consumer/index.ts tests/
  "$DENO" test --frozen --allow-net --allow-env --allow-read --allow-run tests/
  "$TSX" tests/node_check.ts
  bash "$IDEM_REPO_ROOT/.ci/ts-package.sh"
'
