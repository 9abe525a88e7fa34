-- Operator probes for `idem doctor`. Both read nothing of the plane's data
-- and write nothing.

-- The row-cap probe: answers p_rows synthetic rows of the table's own type
-- (nothing is read or written), so `idem doctor` can see the server's real
-- row cap from Content-Range: PostgREST and postrust-server both truncate a
-- set of table rows at db-max-rows.

create function agent.idempotency_cap_probe(p_rows integer)
returns setof agent.idempotency_keys
language plpgsql volatile security invoker set search_path = ''
as $$
begin
  if p_rows is null or p_rows < 1 or p_rows > 100001 then
    raise exception 'p_rows must be between 1 and 100001, got %', p_rows using errcode = '22023';
  end if;
  return query
    select gen_random_uuid(), '00000000-0000-0000-0000-000000000000'::uuid, 'probe', 'probe-' || i,
           repeat('0', 64), 'processing', gen_random_uuid(), null::text, null::text, null::jsonb,
           now(), now(), now()
      from generate_series(1, p_rows) as i;
end
$$;

revoke all on function agent.idempotency_cap_probe(integer) from public, anon, authenticated;
grant execute on function agent.idempotency_cap_probe(integer) to service_role;

-- The plane's functions as the database holds them: name, identity
-- arguments (names and types), and whether the calling role may execute
-- each. Lets `idem doctor` check the SQL surface without calling anything
-- that writes.
create function agent.idempotency_surface()
returns table (name text, arguments text, executable boolean)
language sql stable security invoker set search_path = ''
as $$
  select p.proname::text,
         pg_catalog.pg_get_function_identity_arguments(p.oid),
         pg_catalog.has_function_privilege(p.oid, 'execute')
    from pg_catalog.pg_proc p
   where p.pronamespace = 'agent'::regnamespace
   order by 1, 2;
$$;

revoke all on function agent.idempotency_surface() from public, anon, authenticated;
grant execute on function agent.idempotency_surface() to service_role;
