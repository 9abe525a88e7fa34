-- The sweep never deletes unfinished work.
--
-- A claim still processing that carries its request is work a worker
-- acknowledged and never finished. When no re-drive took it over before its
-- retention passed, the sweep deleted it: no dead letter, no count, nothing
-- among the failures. Now agent.idempotency_retire_expired (public)
-- retires the sweeper's expired claims: it deletes the finished ones and
-- journals each unfinished one as a dead letter instead
-- ({"ok": false, "error": "swept_unredriven", ...}, kept for its scope's
-- retention from now, with its work, so `idem failures` lists it and
-- `idem redrive --failed` can send it back after a fix). It answers how
-- many of each. agent.idempotency_delete_expired answers through it (the
-- deleted count, as before), and agent.idempotency_sweep reports both:
-- its report type gains dead_lettered.

CREATE TYPE agent.idempotency_retired AS (
	deleted integer,
	dead_lettered integer
);

ALTER TYPE agent.idempotency_retired OWNER TO idempotency_owner;

ALTER TYPE agent.idempotency_sweep_report ADD ATTRIBUTE dead_lettered integer;

SET local check_function_bodies = off;

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
  return next (v_deleted, v_dead)::agent.idempotency_retired;
end
$$;

ALTER FUNCTION agent.idempotency_retire_expired(p_ids uuid[]) OWNER TO idempotency_owner;
REVOKE ALL ON FUNCTION agent.idempotency_retire_expired(p_ids uuid[]) FROM PUBLIC;

CREATE OR REPLACE FUNCTION agent.idempotency_delete_expired(p_ids uuid[]) RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
begin
  return (select r.deleted from agent.idempotency_retire_expired(p_ids) r);
end
$$;

CREATE OR REPLACE FUNCTION agent.idempotency_sweep(p_bound integer, p_row_cap integer DEFAULT NULL::integer) RETURNS SETOF agent.idempotency_sweep_report
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

GRANT ALL ON FUNCTION agent.idempotency_retire_expired(p_ids uuid[]) TO service_role;
