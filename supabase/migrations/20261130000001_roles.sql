-- Roles PostgREST and Supabase expect. On Supabase they already exist and this
-- file changes nothing; on plain PostgreSQL it creates them. Each role is
-- created on its own, and a concurrent creator's win is not an error, so two
-- migrations racing on one cluster both succeed.

do $roles$
declare
  r record;
begin
  for r in
    select * from (values
      ('anon',          'create role anon nologin noinherit'),
      ('authenticated', 'create role authenticated nologin noinherit'),
      ('service_role',  'create role service_role nologin noinherit bypassrls'),
      ('authenticator', 'create role authenticator login noinherit')
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

-- The authenticator logs in and switches to the role a request's JWT names.
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
