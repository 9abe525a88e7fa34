-- The roles the idempotency plane needs: the first of v0.1's two migrations,
-- before 20261205000000_v0_1_baseline.sql. Roles belong to the cluster,
-- not to a database, so they are a migration of their own (the local stack
-- applies this file again on every copy of its template database).
--
-- Written by scripts/draft-migration.sh --baseline from
-- supabase/schemas/00_roles.sql, which stays the source: edit that file,
-- not this one, and run the command again. Once v0.1 is released, a change
-- to a role is a new migration, written by hand (docs/migrations.md).

-- The roles the plane needs. Roles belong to the cluster, not to a database,
-- so every statement here runs safely on a cluster that already has them
-- (Supabase creates anon, authenticated, service_role and authenticator
-- itself), and a concurrent creator's win is not an error.
--
-- anon, authenticated, service_role: the API roles PostgREST switches to
--   from a request's JWT. Only service_role may call the plane.
-- authenticator: the role PostgREST logs in as.
-- idempotency_owner: owns the plane's tables and functions; nobody logs in
--   as it. The functions that write run as it (SECURITY DEFINER), so no API
--   role needs, or has, any privilege on the tables.

do $roles$
declare
  r record;
begin
  for r in
    select * from (values
      ('anon',              'create role anon nologin noinherit'),
      ('authenticated',     'create role authenticated nologin noinherit'),
      ('service_role',      'create role service_role nologin noinherit bypassrls'),
      ('authenticator',     'create role authenticator login noinherit'),
      ('idempotency_owner', 'create role idempotency_owner nologin noinherit')
    ) as t(name, ddl)
  loop
    if not exists (select 1 from pg_catalog.pg_roles where rolname = r.name) then
      begin
        execute r.ddl;
      exception when duplicate_object or unique_violation then
        null;
      end;
    end if;
  end loop;
end
$roles$;

-- The authenticator may become each API role.
do $grants$
declare
  member text;
begin
  foreach member in array array['anon', 'authenticated', 'service_role'] loop
    if not pg_catalog.pg_has_role('authenticator', member, 'member') then
      execute format('grant %I to authenticator', member);
    end if;
  end loop;
exception when unique_violation or duplicate_object then
  null;
end
$grants$;

-- Whoever applies the schema must be able to act as the owner: to hand
-- objects to it (PostgreSQL 16 and later ask for SET) and to use its
-- privileges when it replaces or revokes later (INHERIT). A superuser
-- already can. From PostgreSQL 16 a CREATEROLE role (Supabase's postgres)
-- holds a role it created with ADMIN only, so INHERIT and SET are asked for.
do $owner$
begin
  if not pg_catalog.pg_has_role(current_user, 'idempotency_owner', 'usage') then
    if current_setting('server_version_num')::integer >= 160000 then
      execute format('grant idempotency_owner to %I with inherit true, set true', current_user);
    else
      grant idempotency_owner to current_user;
    end if;
  end if;
end
$owner$;
