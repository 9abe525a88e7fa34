#!/usr/bin/env bash
# Supabase's own checks of the migrations, with the real Supabase CLI (pinned:
# `npm i -E supabase@3.1.0` in .ci/supabase) against a scratch database on the
# local PostgreSQL:
#
#   supabase db push --remote=<url> --yes     every migration in supabase/migrations applies
#   supabase db advisors --remote=<url> ...   Supabase's security and performance linter: no warning
#   supabase db lint --remote=<url> ...       plpgsql_check over every function: no error
#
# Installs the CLI (reused when the pinned version is already there) and
# Debian's plpgsql_check for the server's major version when it is missing.
# The scratch database is dropped on every exit. Exits non-zero when any check
# fails. Run by .ci/run; by hand: bash .ci/supabase-checks.sh
set -euo pipefail

SUPABASE_CLI_VERSION=3.1.0
PG_HOST=127.0.0.1
PG_PORT=5432
PG_USER=postgres

root="$(cd "$(dirname "$0")/.." && pwd)"
cli_dir="$root/.ci/supabase"
supabase="$cli_dir/node_modules/.bin/supabase"

# No telemetry, no update check: CI has no business with either.
export SUPABASE_TELEMETRY_DISABLED=1 DO_NOT_TRACK=1 SUPABASE_NO_UPDATE_NOTIFIER=1

say() { echo "supabase-checks: $*"; }
fail() {
  echo "supabase-checks: $*" >&2
  exit 1
}

for tool in node npm psql createdb dropdb; do
  command -v "$tool" >/dev/null 2>&1 || fail "'$tool' is not on PATH (needs Node.js 20+, npm and the PostgreSQL client tools)"
done
pg_isready -h "$PG_HOST" -p "$PG_PORT" -q || fail "PostgreSQL is not answering on $PG_HOST:$PG_PORT"
psql_admin() { psql -h "$PG_HOST" -p "$PG_PORT" -U "$PG_USER" -X -v ON_ERROR_STOP=1 -qAt "$@"; }

# The CLI, pinned.
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

# plpgsql_check, which `supabase db lint` loads (it creates the extension in
# its own transaction and rolls it back), for the server's major version.
pg_major="$(psql_admin -d postgres -c 'show server_version_num')"
pg_major=$((pg_major / 10000))
package="postgresql-$pg_major-plpgsql-check"
if [ "$(dpkg-query -W -f='${Status}' "$package" 2>/dev/null)" != "install ok installed" ]; then
  say "installing $package"
  sudo=()
  # Without stdin a password prompt would hang or fail obscurely: -n fails at once.
  [ "$(id -u)" -eq 0 ] || sudo=(sudo -n)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update -q
  "${sudo[@]}" apt-get install -y -q --no-install-recommends "$package"
fi
[ "$(psql_admin -d postgres -c "select count(*) from pg_available_extensions where name = 'plpgsql_check'")" = 1 ] ||
  fail "the server does not offer the plpgsql_check extension after installing $package"

# The scratch database, dropped on every exit.
db="idem_supabase_ci_$$_$RANDOM$RANDOM"
url="postgresql://$PG_USER@$PG_HOST:$PG_PORT/$db"
drop_scratch() {
  dropdb -h "$PG_HOST" -p "$PG_PORT" -U "$PG_USER" --if-exists --force "$db" ||
    echo "supabase-checks: could not drop the scratch database $db" >&2
}
trap drop_scratch EXIT
createdb -h "$PG_HOST" -p "$PG_PORT" -U "$PG_USER" "$db"
say "scratch database $db"

cd "$root"
supabase_run() { "$supabase" --workdir "$root" "$@" </dev/null; }

say "db push: applying supabase/migrations"
supabase_run db push --remote="$url" --yes

# Findings at level info are shown, not failed on: `rls_enabled_no_policy` on
# every table of schema agent is deliberate (RLS on and no policy: only
# service_role, which bypasses RLS, reaches the rows; anon and authenticated
# hold no privilege at all), and `unused_index` is what any fresh database
# reports.
say "db advisors: security and performance, failing on any warning"
supabase_run db advisors --remote="$url" --type all --level info --fail-on warn

say "db lint: plpgsql_check, failing on any error"
supabase_run db lint --remote="$url" --level warning --fail-on error

say "all passed"
