#!/usr/bin/env bash
# Supabase's own checks of the migrations, with the real Supabase CLI (pinned:
# `npm i -E supabase@3.1.0` in .ci/supabase) against a scratch database on the
# local PostgreSQL:
#
#   supabase db push --remote=<url> --yes     every migration in supabase/migrations applies
#   supabase db advisors --remote=<url> ...   Supabase's security and performance linter: no warning
#   supabase db lint --remote=<url> ...       plpgsql_check over every function: no error
#   scripts/draft-migration.sh --check        Supabase's diff finds nothing between a database
#                                             built from supabase/migrations and one built from
#                                             the declared schema (supabase/schemas)
#   scripts/draft-migration.sh NAME           on a copy whose declared schema changed (a function's
#                                             setting, scopes added, changed and removed): the
#                                             draft it writes holds exactly those changes and
#                                             takes the migrations there (--check)
#
# Installs the CLI (reused when the pinned version is already there) and
# Debian's plpgsql_check for the server's major version when it is missing.
# The scratch database is dropped on every exit. Exits non-zero when any check
# fails. Run by .ci/run; by hand: bash .ci/supabase-checks.sh
set -euo pipefail

PG_HOST=127.0.0.1
PG_PORT=5432
PG_USER=postgres

root="$(cd "$(dirname "$0")/.." && pwd)"

say() { echo "supabase-checks: $*"; }
fail() {
  echo "supabase-checks: $*" >&2
  exit 1
}

for tool in psql createdb dropdb; do
  command -v "$tool" >/dev/null 2>&1 || fail "'$tool' is not on PATH (needs the PostgreSQL client tools)"
done
pg_isready -h "$PG_HOST" -p "$PG_PORT" -q || fail "PostgreSQL is not answering on $PG_HOST:$PG_PORT"
psql_admin() { psql -h "$PG_HOST" -p "$PG_PORT" -U "$PG_USER" -X -v ON_ERROR_STOP=1 -qAt "$@"; }

# The CLI, pinned.
. "$root/.ci/supabase-cli.sh"

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

# The queue functions call pgmq, as Supabase Queues installs it: with pgmq
# in the database, plpgsql_check checks those calls too. Only schema agent
# is linted (pgmq's own functions are pgmq's).
say "installing pgmq's SQL, for the queue functions' calls"
bash "$root/.ci/install-pgmq.sh" "$url"
say "db lint: plpgsql_check over schema agent, failing on any error"
supabase_run db lint --remote="$url" --schema agent --level warning --fail-on error

say "declared schema: the migrations build exactly supabase/schemas (Supabase's diff, and the shipped scopes)"
bash "$root/scripts/draft-migration.sh" --check

say "draft-migration: a draft takes the migrations to a changed declared schema"
copy="$(mktemp -d)"
trap 'drop_scratch; rm -rf "$copy"' EXIT
mkdir "$copy/supabase"
cp -r "$root/supabase/migrations" "$root/supabase/schemas" "$root/supabase/config.toml" "$copy/supabase/"
sed -i "s/SET lock_timeout TO '5s'/SET lock_timeout TO '6s'/" "$copy/supabase/schemas/40_function_idempotency_claim.sql"
sed -i "s/('queue.\*', '7 days'/('queue.*', '8 days'/; /'surface.saved_search.start'/d" \
  "$copy/supabase/schemas/20_table_idempotency_scopes.sql"
echo "INSERT INTO agent.idempotency_scopes (scope, retain, max_response_bytes) VALUES ('worker.invoice.send', '7 days', 65536);" \
  >>"$copy/supabase/schemas/20_table_idempotency_scopes.sql"
if bash "$root/scripts/draft-migration.sh" --root "$copy" --check 2>"$copy/check.err"; then
  fail "draft-migration --check found nothing to migrate in a changed declared schema"
fi
grep -q "the migrations do not build the declared schema" "$copy/check.err" ||
  fail "draft-migration --check failed for another reason: $(cat "$copy/check.err")"
bash "$root/scripts/draft-migration.sh" --root "$copy" changed_for_the_check
draft="$(ls "$copy"/supabase/migrations/*_changed_for_the_check.sql)"
for expected in "SET lock_timeout TO '6s'" "'worker.invoice.send', '7 days'" "'queue.*', '8 days'" \
  "delete from agent.idempotency_scopes where scope = 'surface.saved_search.start';"; do
  grep -qF "$expected" "$draft" || fail "the draft lacks: $expected"
done
# Only what changed: the scopes before and after the changed ones, the
# first and the last, are not restated.
for unchanged in "'http.*'" "'tool.*'" "'webhook.*'"; do
  if grep -qF "$unchanged" "$draft"; then fail "the draft restates the unchanged scope $unchanged"; fi
done
bash "$root/scripts/draft-migration.sh" --root "$copy" --check

say "all passed"
