-- agent.idempotency_sweep
--
-- One sweep pass inside the database (public), for Supabase Cron: reads with
-- agent.idempotency_expired and retires with
-- agent.idempotency_retire_expired (deleted, or journaled as a dead letter
-- when it is unfinished work nobody re-drove), bounded by the row cap.

CREATE FUNCTION agent.idempotency_sweep(p_bound integer, p_row_cap integer DEFAULT NULL::integer) RETURNS SETOF agent.idempotency_sweep_report
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
declare
  v_ids uuid[];
  v_read integer;
  v_retired agent.idempotency_retired;
  v_cap integer;
begin
  if p_bound is null then
    raise exception 'p_bound is required: the most expired claims one sweep reads' using errcode = '22023';
  end if;
  v_cap := agent.idempotency_row_cap(p_row_cap);
  if p_bound < 1 then
    raise exception 'p_bound must be at least 1, got %', p_bound using errcode = '22023';
  end if;
  if p_bound > v_cap then
    raise exception 'p_bound % is above the row cap %: a sweep reads at most the row cap',
                    p_bound, v_cap
      using errcode = '22023',
            hint = 'lower p_bound to the row cap or below; a larger backlog is swept by sweeping more often';
  end if;

  select coalesce(pg_catalog.array_agg(e.id), '{}') into v_ids
    from agent.idempotency_expired(p_bound) e;
  v_read := pg_catalog.cardinality(v_ids);
  select * into v_retired from agent.idempotency_retire_expired(v_ids);

  if v_read >= p_bound then
    raise warning 'idempotency sweep read % expired claims, its whole bound: the backlog may be larger', v_read
      using hint = 'sweep more often or raise the bound (up to the row cap)';
  end if;
  return next (v_read, v_retired.deleted, p_bound, v_read >= p_bound, v_retired.dead_lettered)
    ::agent.idempotency_sweep_report;
end
$$;

ALTER FUNCTION agent.idempotency_sweep(p_bound integer, p_row_cap integer) OWNER TO idempotency_owner;
