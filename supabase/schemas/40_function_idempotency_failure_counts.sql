-- agent.idempotency_failure_counts
--
-- Per scope, the journaled failures (public), for an operator's console: how
-- many, how many can be sent back after a fix (they carry their work), how
-- many went to a dead-letter queue, and the oldest. Scopes with the most
-- failures first, at most p_limit (1 to the row cap). Never writes.

CREATE FUNCTION agent.idempotency_failure_counts(p_limit integer DEFAULT 100) RETURNS SETOF agent.idempotency_failure_count
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
begin
  if p_limit is null or p_limit not between 1 and agent.idempotency_row_cap() then
    raise exception 'p_limit must be between 1 and the row cap % scopes, got %', agent.idempotency_row_cap(), p_limit
      using errcode = '22023';
  end if;
  return query
    select k.scope,
           pg_catalog.count(*),
           pg_catalog.count(*) filter (where k.request is not null),
           pg_catalog.count(*) filter (where k.dead_lettered_at is not null),
           pg_catalog.min(k.claimed_at)
      from agent.idempotency_keys k
     where k.status = 'completed'
       and k.response -> 'ok' = 'false'::jsonb
     group by k.scope
     order by pg_catalog.count(*) desc, k.scope
     limit p_limit;
end
$$;

ALTER FUNCTION agent.idempotency_failure_counts(p_limit integer) OWNER TO idempotency_owner;
