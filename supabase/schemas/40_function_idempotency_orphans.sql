-- agent.idempotency_orphans
--
-- Per scope, how many orphans wait and since when (public); for idem doctor.
-- Never writes.

CREATE FUNCTION agent.idempotency_orphans(p_limit integer DEFAULT 100) RETURNS SETOF agent.idempotency_orphaned_scope
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
begin
  if p_limit is null or p_limit not between 1 and least(1000, agent.idempotency_row_cap()) then
    raise exception 'p_limit must be between 1 and % scopes (1000, or the plane''s row cap when lower), got %',
                    least(1000, agent.idempotency_row_cap()), p_limit
      using errcode = '22023';
  end if;
  return query
    select k.scope, count(*), min(k.redrive_at),
           (extract(epoch from pg_catalog.clock_timestamp() - min(k.redrive_at)) * 1000)::bigint
      from agent.idempotency_keys k
     where k.redrive_at <= pg_catalog.clock_timestamp()
       and k.status = 'processing'
     group by k.scope
     order by count(*) desc, k.scope
     limit p_limit;
end
$$;

ALTER FUNCTION agent.idempotency_orphans(p_limit integer) OWNER TO idempotency_owner;
