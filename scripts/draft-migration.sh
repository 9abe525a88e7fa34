#!/usr/bin/env bash
# Drafts the next migration from the declared schema, checks that none is
# needed, or (before v0.1 is released) writes the release's migrations again.
#
#   scripts/draft-migration.sh NAME        writes supabase/migrations/<UTC timestamp>_NAME.sql
#   scripts/draft-migration.sh --check     fails, printing the difference, unless the
#                                          migrations already build the declared schema
#   scripts/draft-migration.sh --baseline  writes v0.1's two migrations from supabase/schemas/,
#                                          the same bytes for the same files: the roles
#                                          (00_roles.sql) and the baseline (every other
#                                          file, in file-name order); refuses when
#                                          supabase/migrations/ holds any other file; then
#                                          checks as --check does
#   --root DIR                             the repository to read (default: this one)
#
# Builds one scratch database from supabase/migrations/ and one from
# supabase/schemas/ on the local PostgreSQL (PG_HOST, PG_PORT, PG_USER;
# default 127.0.0.1, 5432, postgres), drops both on exit, and compares them
# with Supabase's own diff (`supabase db diff --from URL --to URL`, which
# needs no Docker) plus the rows of agent.idempotency_scopes, which no
# schema diff sees. The draft is a start, not a finished migration: read it
# against the rules in docs/migrations.md, then list it in src/migrations.rs.
set -euo pipefail

PG_HOST="${PG_HOST:-127.0.0.1}"
PG_PORT="${PG_PORT:-5432}"
PG_USER="${PG_USER:-postgres}"

say() { echo "draft-migration: $*" >&2; }
fail() {
  echo "draft-migration: $*" >&2
  exit 1
}
usage() { fail "usage: scripts/draft-migration.sh [--root DIR] (NAME | --check | --baseline)"; }

root="$(cd "$(dirname "$0")/.." && pwd)"
repo="$root"
name="" check=false baseline=false
while [ $# -gt 0 ]; do
  case "$1" in
    --root) [ $# -ge 2 ] || usage; repo="$(cd "$2" && pwd)"; shift 2 ;;
    --check) check=true; shift ;;
    --baseline) baseline=true; shift ;;
    -*) usage ;;
    *) [ -z "$name" ] || usage; name="$1"; shift ;;
  esac
done
if $check || $baseline; then
  [ -z "$name" ] && ! { $check && $baseline; } || usage
  check=true
else
  [[ "$name" =~ ^[a-z0-9_]+$ ]] || fail "NAME must be lower-case letters, digits and '_' (it names the file), got '$name'"
fi
for dir in "$repo/supabase/migrations" "$repo/supabase/schemas"; do
  [ -d "$dir" ] || fail "$dir is not a directory"
done

# v0.1's migrations: the roles, which belong to the cluster and so are a
# migration of their own (the local stack applies that file again on every
# copy of its template database, by this name: src/local/template.rs), then
# the rest of the declared schema. The baseline's version is not after the
# day it was first written, so a draft written since still comes after it.
roles_migration=20261130000001_roles.sql
baseline_migration=20261205000000_v0_1_baseline.sql
# The .sql files of a directory, by name in byte order (whatever the
# locale): the order the Supabase CLI reads both directories in.
sql_files() { find "$1" -maxdepth 1 -type f -name '*.sql' -printf '%f\n' | LC_ALL=C sort; }
if $baseline; then
  others="$(find "$repo/supabase/migrations" -maxdepth 1 -type f \
    ! -name "$roles_migration" ! -name "$baseline_migration" -printf '%f\n' | sort)"
  [ -z "$others" ] || fail "supabase/migrations/ holds other files than v0.1's two; the baseline holds the whole declared schema, so remove them (and their lines in src/migrations.rs) first: $(echo "$others" | tr '\n' ' ')"
  [ -f "$repo/supabase/schemas/00_roles.sql" ] || fail "supabase/schemas/00_roles.sql is missing"
  {
    echo "-- The roles the idempotency plane needs: the first of v0.1's two migrations,"
    echo "-- before $baseline_migration. Roles belong to the cluster,"
    echo "-- not to a database, so they are a migration of their own (the local stack"
    echo "-- applies this file again on every copy of its template database)."
    echo "--"
    echo "-- Written by scripts/draft-migration.sh --baseline from"
    echo "-- supabase/schemas/00_roles.sql, which stays the source: edit that file,"
    echo "-- not this one, and run the command again. Once v0.1 is released, a change"
    echo "-- to a role is a new migration, written by hand (docs/migrations.md)."
    echo
    cat "$repo/supabase/schemas/00_roles.sql"
  } >"$repo/supabase/migrations/$roles_migration"
  {
    echo "-- The idempotency plane v0.1: its schema agent whole, in one migration, after"
    echo "-- the roles ($roles_migration)."
    echo "--"
    echo "-- Written by scripts/draft-migration.sh --baseline from supabase/schemas/,"
    echo "-- which stays the source: every file there but 00_roles.sql, in file-name"
    echo "-- order (the order the declared schema is applied in), each after a line"
    echo "-- naming it. Edit those files, not this one, and run the command again."
    echo "-- Once v0.1 is released this file is deployed history and never changes: a"
    echo "-- change is a new migration, drafted with scripts/draft-migration.sh NAME."
    sql_files "$repo/supabase/schemas" | while IFS= read -r file; do
      [ "$file" != 00_roles.sql ] || continue
      echo
      echo "-- supabase/schemas/$file"
      echo
      cat "$repo/supabase/schemas/$file"
    done
  } >"$repo/supabase/migrations/$baseline_migration"
  say "wrote supabase/migrations/$roles_migration and supabase/migrations/$baseline_migration; checking them"
fi

for tool in psql createdb dropdb pg_isready; do
  command -v "$tool" >/dev/null 2>&1 || fail "'$tool' is not on PATH (needs the PostgreSQL client tools)"
done
pg_isready -h "$PG_HOST" -p "$PG_PORT" -q || fail "PostgreSQL is not answering on $PG_HOST:$PG_PORT"
. "$root/.ci/supabase-cli.sh" >&2

suffix="$$_$RANDOM$RANDOM"
migrated="idem_draft_migrated_$suffix"
declared="idem_draft_declared_$suffix"
work="$(mktemp -d)"
cleanup() {
  for db in "$migrated" "$declared"; do
    dropdb -h "$PG_HOST" -p "$PG_PORT" -U "$PG_USER" --if-exists --force "$db" ||
      echo "draft-migration: could not drop the scratch database $db" >&2
  done
  rm -rf "$work"
}
trap cleanup EXIT
url() { echo "postgresql://$PG_USER@$PG_HOST:$PG_PORT/$1"; }
psql_on() {
  local db="$1"
  shift
  psql -h "$PG_HOST" -p "$PG_PORT" -U "$PG_USER" -d "$db" -X -v ON_ERROR_STOP=1 -qAt "$@"
}

# Both databases, each file in name order: the order `supabase db push`
# applies migrations in, and the order schema_paths' glob reads the
# declared files in.
build() {
  local db="$1" dir="$2" file
  createdb -h "$PG_HOST" -p "$PG_PORT" -U "$PG_USER" "$db"
  while IFS= read -r file; do
    psql_on "$db" -f "$dir/$file" >/dev/null 2>"$work/psql.err" ||
      fail "$(basename "$dir")/$file does not apply: $(cat "$work/psql.err")"
  done < <(sql_files "$dir")
}
say "building a database from supabase/migrations/ and one from supabase/schemas/"
build "$migrated" "$repo/supabase/migrations"
build "$declared" "$repo/supabase/schemas"

# Supabase's diff of schema agent: functions, tables, views, types,
# indexes, constraints, policies, owners and grants. --strict-coverage: an
# object its engine (pg-delta) cannot manage fails the diff instead of being
# left out of it. The CLI calls this output review SQL, not an apply
# script: the draft is read before it is committed.
"$supabase" --workdir "$repo" db diff --from "$(url "$migrated")" --to "$(url "$declared")" \
  --schema agent --strict-coverage -o "$work/schema.sql" </dev/null >&2 ||
  fail "supabase db diff failed"

# The shipped scopes: one upsert per row the declared schema adds or
# changes, one delete per scope it no longer has.
scopes='select format(
          $f$insert into agent.idempotency_scopes (scope, retain, max_response_bytes, max_request_bytes, max_attempts)
values (%L, %L, %s, %s, %s)
on conflict (scope) do update set retain = excluded.retain, max_response_bytes = excluded.max_response_bytes,
  max_request_bytes = excluded.max_request_bytes, max_attempts = excluded.max_attempts;$f$,
          scope, retain, max_response_bytes, max_request_bytes, max_attempts)
          from agent.idempotency_scopes order by scope'
names='select scope from agent.idempotency_scopes order by scope'
# One statement per line: psql separates records with \x1e but ends the
# last with a newline, so each record is given its separator here, and the
# statements' own newlines become \x1f until they are written out.
statements() {
  local out
  out="$(psql_on "$1" -R $'\x1e' -c "$scopes")"
  [ -z "$out" ] || printf '%s\036' "$out" | tr '\n\036' '\037\n' | sort
}
statements "$migrated" >"$work/migrated.rows"
statements "$declared" >"$work/declared.rows"
psql_on "$migrated" -c "$names" | sort >"$work/migrated.names"
psql_on "$declared" -c "$names" | sort >"$work/declared.names"
{
  comm -13 "$work/migrated.rows" "$work/declared.rows" | tr '\037' '\n'
  comm -23 "$work/migrated.names" "$work/declared.names" |
    while IFS= read -r scope; do
      psql_on "$declared" -v scope="$scope" <<<"select format('delete from agent.idempotency_scopes where scope = %L;', :'scope')"
    done
} >"$work/scopes.sql"

if [ ! -s "$work/schema.sql" ] && [ ! -s "$work/scopes.sql" ]; then
  say "the migrations build exactly the declared schema: nothing to migrate"
  exit 0
fi
if $check; then
  {
    echo "draft-migration: the migrations do not build the declared schema; what would take them there:"
    cat "$work/schema.sql" "$work/scopes.sql"
  } >&2
  exit 1
fi

version="$(date -u +%Y%m%d%H%M%S)"
# Migrations apply in version order: a draft must come after every one.
latest="$(find "$repo/supabase/migrations" -maxdepth 1 -name '[0-9]*_*.sql' -printf '%f\n' | cut -d_ -f1 | sort | tail -n 1)"
if [ -n "$latest" ] && [[ ! "$version" > "$latest" ]]; then
  fail "this clock's version $version is not after the latest migration's $latest: the draft would apply before it"
fi
file="$repo/supabase/migrations/${version}_$name.sql"
[ ! -e "$file" ] || fail "$file exists"
{
  echo "-- $name"
  echo "--"
  echo "-- Drafted by scripts/draft-migration.sh from supabase/schemas/. Say here why"
  echo "-- the plane changes, and check the statements against docs/migrations.md."
  if [ -s "$work/schema.sql" ]; then
    echo
    cat "$work/schema.sql"
  fi
  if [ -s "$work/scopes.sql" ]; then
    echo
    echo "-- The scopes the plane ships with."
    cat "$work/scopes.sql"
  fi
} >"$file"
say "wrote ${file#"$repo"/}; list it in src/migrations.rs, then run: cargo test --features local --test plane declared_schema"
