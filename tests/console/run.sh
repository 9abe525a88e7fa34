#!/usr/bin/env bash
# `idem console` in a real headless Chromium: Debian's chromium package
# (/usr/bin/chromium, or CHROMIUM_BIN), driven by playwright-core (npm,
# pinned by package-lock.json, installed with `npm ci` into
# target/console-test), against a fresh local plane. Builds nothing: pass an
# `idem` built with `--features local` (the plane; the console is in every
# `idem`).
#
#   cargo build --features local --bin idem
#   bash tests/console/run.sh target/debug/idem
#
# Starts `idem up --env-file` (a fresh database, dropped on stop) through
# .ci/with-local-plane.sh, runs console_test.mjs with Node's test runner
# (it journals a failure, starts `idem console --route …` and a re-drive
# route of its own, and drives the page), and always stops the plane.
# Fails, never skips, when Chromium, Node.js or the console is missing.
set -euo pipefail

TEST_TIMEOUT_S=300

if [ "$#" -ne 1 ] || [ ! -x "$1" ] || [ -d "$1" ]; then
  echo "usage: $0 PATH/TO/idem   (built with: cargo build --features local --bin idem)" >&2
  exit 2
fi
idem="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"

export CHROMIUM_BIN="${CHROMIUM_BIN:-/usr/bin/chromium}"
if [ ! -x "$CHROMIUM_BIN" ]; then
  echo "console-test: $CHROMIUM_BIN is missing: apt-get install -y chromium (.ci/run installs it)" >&2
  exit 1
fi
for tool in node npm; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "console-test: '$tool' is not on PATH; the browser test needs Node.js (20 or later) and npm" >&2
    exit 1
  fi
done
if ! "$idem" console --help 2>/dev/null | grep -q -- '--allow-non-loopback'; then
  echo "console-test: $idem has no console command" >&2
  exit 1
fi

# playwright-core, pinned, beside the build (git-ignored), never a browser
# download: the test launches Debian's Chromium.
export CONSOLE_TEST_DEPS="$root/target/console-test"
mkdir -p "$CONSOLE_TEST_DEPS"
cp "$here/package.json" "$here/package-lock.json" "$CONSOLE_TEST_DEPS/"
(cd "$CONSOLE_TEST_DEPS" && npm ci --no-audit --no-fund --loglevel=error)
echo "console-test: node $(node --version), playwright-core $(node -p "require('$CONSOLE_TEST_DEPS/node_modules/playwright-core/package.json').version"), $("$CHROMIUM_BIN" --version 2>/dev/null | head -n 1)"

cd "$here"
exec bash "$root/.ci/with-local-plane.sh" "$idem" console-test -- \
  timeout "$TEST_TIMEOUT_S" node --test console_test.mjs
