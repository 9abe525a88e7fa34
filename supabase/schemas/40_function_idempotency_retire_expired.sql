-- agent.idempotency_retire_expired
--
-- Retires the given claims (public) that are still past retention, for the
-- sweeper: deletes them, except unfinished work (processing, carrying its
-- request) that nobody re-drove, which is journaled as a dead letter
-- (swept_unredriven) and kept for its scope's retention from now. Rows
-- another transaction holds are left for the next pass. Answers one row:
-- deleted, dead_lettered. Every pass, even one given no ids, also trims the
-- replay counts older than 7 days (agent.idempotency_trim_replays).

CREATE FUNCTION agent.idempotency_retire_expired(p_ids uuid[]) RETURNS SETOF agent.idempotency_retired
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
declare
  v_deleted integer;
  v_dead integer;
begin
  if p_ids is null then
    raise exception 'p_ids is required' using errcode = '22023';
  end if;
  if pg_catalog.cardinality(p_ids) > agent.idempotency_row_cap() then
    raise exception 'p_ids holds % ids; at most the plane''s row cap % per call',
                    pg_catalog.cardinality(p_ids), agent.idempotency_row_cap()
      using errcode = '22023';
  end if;
  if pg_catalog.array_position(p_ids, null) is not null then
    raise exception 'p_ids holds a NULL at position %', pg_catalog.array_position(p_ids, null) using errcode = '22023';
  end if;
  -- A row another transaction holds is left for the next pass: the sweep
  -- never waits on a claim, so it never takes part in a cycle of waits.
  -- Unfinished work (still processing, carrying its request: acknowledged,
  -- and nobody re-drove it) is never deleted: it is journaled as a dead
  -- letter, kept for its scope's retention from now, and listed among the
  -- failures, which an operator can send back after a fix.
  with expired as (
    select x.id, x.organization_id, x.scope, x.status = 'processing' and x.request is not null as unfinished
      from agent.idempotency_keys x
     where x.id = any (p_ids)
       and x.retain_until < pg_catalog.now()
       for update of x skip locked
  ), dead as (
    update agent.idempotency_keys as k
       set status = 'completed',
           response = pg_catalog.jsonb_build_object('ok', false, 'error', 'swept_unredriven',
                                                    'output', pg_catalog.jsonb_build_object('attempts', k.reclaims + 1)),
           lease_expires_at = least(k.lease_expires_at, pg_catalog.now()),
           retain_until = pg_catalog.now() + coalesce((select p.retain from agent.idempotency_policy(k.scope) p),
                                                      interval '1 day'),
           redrive_at = null
      from expired e
     where e.unfinished and k.id = e.id and k.organization_id = e.organization_id
    returning k.id
  ), deleted as (
    delete from agent.idempotency_keys k
     using expired e
     where not e.unfinished and k.id = e.id and k.organization_id = e.organization_id
    returning k.id
  )
  select (select pg_catalog.count(*) from deleted), (select pg_catalog.count(*) from dead) into v_deleted, v_dead;
  if v_dead > 0 then
    raise warning 'idempotency sweep: % unfinished claims carrying work passed their retention unredriven; journaled as dead letters (swept_unredriven)', v_dead
      using hint = 'schedule a re-drive for their scopes (idem redrive), then send them back: idem redrive --failed';
  end if;
  perform agent.idempotency_trim_replays();
  return next (v_deleted, v_dead)::agent.idempotency_retired;
end
$$;

ALTER FUNCTION agent.idempotency_retire_expired(p_ids uuid[]) OWNER TO idempotency_owner;
