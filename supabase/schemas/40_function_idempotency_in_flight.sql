-- agent.idempotency_in_flight
--
-- Per scope, what is in flight (public), for an operator's console: claims
-- still processing, how many under a live lease, how many are orphans
-- waiting for a re-drive, the oldest claim and the oldest lease end. Scopes
-- with the most claims processing first, at most p_limit of them (1 to the
-- plane's row cap). Reads every processing claim; never writes.

CREATE FUNCTION agent.idempotency_in_flight(p_limit integer DEFAULT 100) RETURNS SETOF agent.idempotency_in_flight_scope
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
declare
  v_at timestamptz := pg_catalog.clock_timestamp();
begin
  if p_limit is null or p_limit not between 1 and agent.idempotency_row_cap() then
    raise exception 'p_limit must be between 1 and the row cap % scopes, got %', agent.idempotency_row_cap(), p_limit
      using errcode = '22023';
  end if;
  return query
    select k.scope,
           pg_catalog.count(*),
           pg_catalog.count(*) filter (where k.lease_expires_at > v_at),
           pg_catalog.count(*) filter (where k.redrive_at <= v_at),
           pg_catalog.min(k.claimed_at),
           pg_catalog.min(k.lease_expires_at)
      from agent.idempotency_keys k
     where k.status = 'processing'
     group by k.scope
     order by pg_catalog.count(*) desc, k.scope
     limit p_limit;
end
$$;

ALTER FUNCTION agent.idempotency_in_flight(p_limit integer) OWNER TO idempotency_owner;
