-- agent.idempotency_sweep_backlog
--
-- Claims past their retention that no sweep has retired yet (public), by
-- the day (UTC) their retention ended, oldest day first, at most p_limit
-- days (1 to the row cap). A backlog that grows is a sweep that does not
-- keep up. Never writes.

CREATE FUNCTION agent.idempotency_sweep_backlog(p_limit integer DEFAULT 100) RETURNS SETOF agent.idempotency_sweep_backlog_day
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
begin
  if p_limit is null or p_limit not between 1 and agent.idempotency_row_cap() then
    raise exception 'p_limit must be between 1 and the row cap % days, got %', agent.idempotency_row_cap(), p_limit
      using errcode = '22023';
  end if;
  return query
    select (k.retain_until at time zone 'UTC')::date, pg_catalog.count(*)
      from agent.idempotency_keys k
     where k.retain_until < pg_catalog.clock_timestamp()
     group by 1
     order by 1
     limit p_limit;
end
$$;

ALTER FUNCTION agent.idempotency_sweep_backlog(p_limit integer) OWNER TO idempotency_owner;
