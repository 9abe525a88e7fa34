#!/usr/bin/env bash
# Installs the pinned JavaScript tools the TypeScript checks run on — Deno
# (npm's `deno` package ships its binary), tsx (runs the TypeScript module
# under Node.js) and TypeScript's tsc (compiles the npm package) — into
# target/js-tools (git-ignored, reused across runs), and exports DENO, TSX
# and TSC with their paths. Source it: `. .ci/js-tools.sh`.
set -euo pipefail

DENO_VERSION=2.9.6
TSX_VERSION=4.20.6
TYPESCRIPT_VERSION=5.9.3

js_tools_dir="${IDEM_JS_TOOLS:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/target/js-tools}"
DENO="$js_tools_dir/node_modules/.bin/deno"
TSX="$js_tools_dir/node_modules/.bin/tsx"
TSC="$js_tools_dir/node_modules/.bin/tsc"
if ! { [ -x "$DENO" ] && "$DENO" --version 2>/dev/null | grep -q "^deno $DENO_VERSION " &&
       [ -x "$TSX" ] && [ "$("$TSX" --version 2>/dev/null | sed -n 's/^tsx v//p')" = "$TSX_VERSION" ] &&
       [ -x "$TSC" ] && [ "$("$TSC" --version 2>/dev/null)" = "Version $TYPESCRIPT_VERSION" ]; }; then
  for tool in node npm; do
    command -v "$tool" >/dev/null 2>&1 || { echo "js-tools: '$tool' is not on PATH (Node.js 20+ and npm are needed)" >&2; exit 2; }
  done
  echo "js-tools: installing deno@$DENO_VERSION, tsx@$TSX_VERSION and typescript@$TYPESCRIPT_VERSION into $js_tools_dir"
  mkdir -p "$js_tools_dir"
  [ -f "$js_tools_dir/package.json" ] || echo '{"private": true}' >"$js_tools_dir/package.json"
  npm install --prefix "$js_tools_dir" -E --no-audit --no-fund --loglevel=error \
    "deno@$DENO_VERSION" "tsx@$TSX_VERSION" "typescript@$TYPESCRIPT_VERSION"
fi
export DENO TSX TSC
# Deno's own cache of npm: packages, beside the tools, unless one is chosen.
export DENO_DIR="${DENO_DIR:-$js_tools_dir/deno-cache}"
# No colour codes in CI logs.
export NO_COLOR=1 DENO_NO_UPDATE_CHECK=1
