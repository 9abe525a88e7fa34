#!/usr/bin/env bash
# The Rust programs the docs print, built and run exactly as printed: the
# README's Rust quick start (the ```toml dependencies and the ```rust program
# under "## Quick start: Rust workers") and the tool guard program of
# docs/callers.md (the ```rust block under "## Tool guard", on the same
# dependencies). Each is cut out of the file itself, never a copy, into a
# fresh crate in a temp dir (`cargo new`'s edition, its own workspace, the
# repository's Cargo.lock so the versions are the ones CI tests, warnings
# denied), built offline, and run against a fresh `idem up` through
# .ci/with-local-plane.sh, which exports the env file's variables as the
# README's `set -a; . ./plane.env; set +a` does. Fails unless the quick start
# prints `ran: …` then `replayed: …` with the same answer, and the tool guard
# `held: …`, then `executed: X`, then `replayed: X`.
#
#   bash .ci/readme-programs.sh PATH/TO/idem     (built with --features local)
#
# One line of what is printed is changed: the README's dependency on a
# checkout (`idempotency-plane = { path = "../idempotency-plane", … }`) has
# its path replaced by this repository's, and nothing else. The programs
# build in target/readme-programs (kept between runs, so only the first
# builds the dependencies).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

if [ "$#" -ne 1 ]; then
  echo "usage: $0 PATH/TO/idem" >&2
  exit 2
fi
idem=$1

fail() {
  echo "readme-programs: $*" >&2
  exit 1
}

# block FILE HEADING FENCE: the lines of the first code block whose opening
# fence line starts with FENCE (```rust matches ```rust no_run) in the
# section HEADING of FILE (from that heading line to the next "## "),
# without its fences. Fails when there is none.
block() {
  awk -v heading="$2" -v fence="$3" '
    $0 == heading { inside = 1; next }
    inside && !open && /^## / { exit }
    inside && !open && index($0, fence) == 1 { open = 1; next }
    open && /^```$/ { found = 1; exit }
    open { print }
    END { exit found ? 0 : 1 }
  ' "$1" || fail "$1 has no $3 block under \"$2\""
}

work=$(mktemp -d "${TMPDIR:-/tmp}/readme-programs.XXXXXX")
trap 'rm -rf "$work"' EXIT

dependencies=$(block README.md "## Quick start: Rust workers" '```toml')
program=$(block README.md "## Quick start: Rust workers" '```rust')
guard_program=$(block docs/callers.md "## Tool guard" '```rust')

# The one substitution: the checkout's path, on the one line that depends on it.
dependency_line='^idempotency-plane = \{ path = "[^"]*"'
[ "$(grep -cE "$dependency_line" <<<"$dependencies")" = 1 ] ||
  fail "the README's dependencies must hold one line 'idempotency-plane = { path = \"…\", … }'; they are:
$dependencies"
repo_in_sed=$(sed 's/[\\|&]/\\&/g' <<<"$repo")
dependencies=$(sed -E "s|^(idempotency-plane = \\{ path = )\"[^\"]*\"|\\1\"$repo_in_sed\"|" <<<"$dependencies")

# crate NAME PROGRAM: a fresh crate in $work/NAME with the README's
# dependencies and PROGRAM as src/main.rs.
crate() {
  mkdir -p "$work/$1/src"
  cat >"$work/$1/Cargo.toml" <<EOF
[package]
name = "$1"
version = "0.1.0"
edition = "2024"
publish = false

[workspace]

[lints.rust]
warnings = "deny"

$dependencies
EOF
  printf '%s\n' "$2" >"$work/$1/src/main.rs"
  cp Cargo.lock "$work/$1/Cargo.lock"
}
crate readme-quick-start "$program"
crate tool-guard-program "$guard_program"

export CARGO_TARGET_DIR="$repo/target/readme-programs"
for name in readme-quick-start tool-guard-program; do
  echo "readme-programs: building $name ($work/$name)"
  cargo build --offline --manifest-path "$work/$name/Cargo.toml"
done

# Both run on one fresh plane, the quick start first; each prints to its file too.
bash .ci/with-local-plane.sh "$idem" readme-programs -- bash -c '
  set -euo pipefail
  echo "---- the README quick start ----"
  "$1" | tee "$2"
  echo "---- the tool guard program (docs/callers.md) ----"
  "$3" | tee "$4"
' bash "$CARGO_TARGET_DIR/debug/readme-quick-start" "$work/quick-start.out" \
  "$CARGO_TARGET_DIR/debug/tool-guard-program" "$work/tool-guard.out"

# The quick start: the effect ran once, and the second claim replayed its answer.
mapfile -t lines <"$work/quick-start.out"
[ "${#lines[@]}" = 2 ] &&
  [[ ${lines[0]} =~ ^ran:\ (.+)\ \(Recorded\)$ ]] &&
  [ "${lines[1]}" = "replayed: ${BASH_REMATCH[1]}" ] ||
  fail "the README quick start should print 'ran: ANSWER (Recorded)' then 'replayed: ANSWER'"

# The tool guard: held without a key, then executed, then replayed.
mapfile -t lines <"$work/tool-guard.out"
[ "${#lines[@]}" = 3 ] &&
  [[ ${lines[0]} =~ ^held: ]] &&
  [[ ${lines[1]} =~ ^executed:\ (.+)$ ]] &&
  [ "${lines[2]}" = "replayed: ${BASH_REMATCH[1]}" ] ||
  fail "the tool guard program should print 'held: …', 'executed: ANSWER', then 'replayed: ANSWER'"

echo "readme-programs: both programs ran as printed"
