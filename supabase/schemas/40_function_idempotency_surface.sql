-- agent.idempotency_surface
--
-- Every function of schema agent, from the catalog (public), for idem doctor:
-- its identity arguments, whether the caller may execute it, its owner, and
-- whether PUBLIC, anon or authenticated may execute it. Every function, not
-- only the plane's: a function someone else created there is what the doctor
-- looks for. The one function that runs as its caller, because it reports the
-- caller's privileges. A function those roles may execute is one the event
-- trigger did not make private (on Supabase, a superuser's: supautils runs no
-- user event trigger for superusers), or one granted to them since.

CREATE FUNCTION agent.idempotency_surface() RETURNS TABLE(name text, arguments text, executable boolean, owner text, public_executable boolean, anon_executable boolean, authenticated_executable boolean)
    LANGUAGE sql STABLE
    SET search_path TO ''
    AS $$
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
$$;
