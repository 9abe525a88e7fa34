-- agent.idempotency_surface also answers each function's owner and whether
-- PUBLIC, anon or authenticated may execute it, so idem doctor can name a
-- function in schema agent that the event trigger did not make private, or
-- that someone granted to those roles since. On Supabase, supautils runs
-- no user event trigger for superusers: a function a superuser
-- (supabase_admin is one) creates there stays executable by PUBLIC until
-- someone revokes it.
--
-- A new result shape is a new function: dropped and made again, with its
-- grant. It still runs as its caller (it reports the caller's privileges).
-- Drafted by scripts/draft-migration.sh from supabase/schemas/, then edited
-- by hand to the same result.

SET local check_function_bodies = off;

DROP FUNCTION "agent"."idempotency_surface"();

CREATE OR REPLACE FUNCTION agent.idempotency_surface()
  RETURNS TABLE (
    name              text,
    arguments         text,
    executable        boolean,
    owner             text,
    public_executable boolean,
    anon_executable   boolean,
    authenticated_executable boolean
  )
  LANGUAGE sql
  STABLE
  SET search_path TO ''
  AS $function$
  select p.proname::text,
         pg_catalog.pg_get_function_identity_arguments(p.oid),
         pg_catalog.has_function_privilege(p.oid, 'execute'),
         pg_catalog.pg_get_userbyid(p.proowner)::text,
         pg_catalog.has_function_privilege('public', p.oid, 'execute'),
         pg_catalog.has_function_privilege('anon', p.oid, 'execute'),
         pg_catalog.has_function_privilege('authenticated', p.oid, 'execute')
    from pg_catalog.pg_proc p
   where p.pronamespace = 'agent'::regnamespace
   order by 1, 2;
$function$;

REVOKE ALL ON FUNCTION "agent"."idempotency_surface"() FROM PUBLIC;

GRANT EXECUTE ON FUNCTION "agent"."idempotency_surface"() TO "service_role";
