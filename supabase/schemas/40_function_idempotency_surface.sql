-- agent.idempotency_surface
--
-- The plane's functions from the catalog, with whether the caller may execute
-- each (public); for idem doctor. The one function that runs as its caller,
-- because it reports the caller's privileges.

CREATE FUNCTION agent.idempotency_surface() RETURNS TABLE(name text, arguments text, executable boolean)
    LANGUAGE sql STABLE
    SET search_path TO ''
    AS $$
  select p.proname::text,
         pg_catalog.pg_get_function_identity_arguments(p.oid),
         pg_catalog.has_function_privilege(p.oid, 'execute')
    from pg_catalog.pg_proc p
   where p.pronamespace = 'agent'::regnamespace
   order by 1, 2;
$$;

ALTER FUNCTION agent.idempotency_surface() OWNER TO postgres;
