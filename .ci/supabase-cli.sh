# Sourced: installs the pinned Supabase CLI into .ci/supabase (npm; reused
# when that version is already there) and sets $supabase to it. Expects
# $root (the repository) and the functions say and fail.
SUPABASE_CLI_VERSION=3.1.0
cli_dir="$root/.ci/supabase"
supabase="$cli_dir/node_modules/.bin/supabase"

# No telemetry, no update check.
export SUPABASE_TELEMETRY_DISABLED=1 DO_NOT_TRACK=1 SUPABASE_NO_UPDATE_NOTIFIER=1

for tool in node npm; do
  command -v "$tool" >/dev/null 2>&1 || fail "'$tool' is not on PATH (the Supabase CLI installs from npm; needs Node.js 20+)"
done
if [ -x "$supabase" ] && [ "$("$supabase" --version 2>/dev/null)" = "$SUPABASE_CLI_VERSION" ]; then
  say "Supabase CLI $SUPABASE_CLI_VERSION already installed"
else
  # npm install, not npm ci: the lock holds the platform package of the machine
  # that wrote it only (the CLI ships one optional package per platform), and
  # npm ci refuses a lock without the others.
  say "installing Supabase CLI $SUPABASE_CLI_VERSION (npm in .ci/supabase)"
  # --no-save: the committed package.json and lock stay as they are.
  (cd "$cli_dir" && npm i -E --no-save --no-audit --no-fund --loglevel=error "supabase@$SUPABASE_CLI_VERSION")
  installed="$("$supabase" --version)"
  [ "$installed" = "$SUPABASE_CLI_VERSION" ] || fail "installed Supabase CLI $installed, expected $SUPABASE_CLI_VERSION"
fi
