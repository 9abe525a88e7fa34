-- Clocks, lock waits, Run admission tokens and default privileges.
--
-- Every function here replaces an earlier one with the same arguments and
-- result, so no client changes, except run_admit, which gains an optional
-- p_admission_token (DEFAULT NULL: a call without it works as before).
--
-- 1. Lease instants are stamped once the row is won. now() is the start of
--    the transaction: a claim that waited on another transaction's lock (a
--    concurrent insert of the same key that later rolled back, a reclaim
--    behind a slow commit) used to start its lease before the wait, so the
--    winner could answer a lease that was already over, and a second worker
--    could reclaim at once. Claims now stamp claimed_at, lease_expires_at and
--    retain_until from clock_timestamp() and re-stamp them when winning the
--    row took longer than 10 ms; lease_live uses the same clock.
-- 2. lock_timeout = 5 s on every function that takes a row lock: a call
--    behind a stuck lock fails with 55P03 (lock_not_available; PostgREST
--    answers HTTP 500, nothing written) instead of holding a server
--    connection for as long as the lock is held.
-- 3. agent.run_admit(..., p_admission_token): a repeat carrying the token
--    that inserted the Run answers admitted = true again, so a caller whose
--    answer was lost can tell its own admission from someone else's.
-- 4. Functions created later in schema agent are executable by nobody but
--    their owner until granted, and service_role keeps only the table
--    privileges the functions use.

-- 1. Clocks -----------------------------------------------------------------

create or replace function agent.idempotency_claim_of(k agent.idempotency_keys)
returns agent.idempotency_claim
language sql volatile security invoker set search_path = ''
as $$
  select k.id, k.organization_id, k.scope, k.key, k.request_hash, k.status,
         k.lease_token, k.resource_type, k.resource_id, k.response, k.claimed_at,
         k.lease_expires_at, k.retain_until,
         (k.status = 'processing' and k.lease_expires_at > pg_catalog.clock_timestamp());
$$;

-- Stamps a row this transaction has just won with the current time: the
-- lease starts now, not when the transaction began or when the winning
-- statement started to wait. The retention only grows.
create function agent.idempotency_restamp(p_id uuid, p_lease interval, p_retain interval)
returns agent.idempotency_keys
language sql volatile security invoker set search_path = ''
as $$
  update agent.idempotency_keys as k
     set claimed_at = c.at,
         lease_expires_at = c.at + p_lease,
         retain_until = greatest(k.retain_until, c.at + p_retain)
    from (select pg_catalog.clock_timestamp() as at) c
   where k.id = p_id
  returning k.*;
$$;

create or replace function agent.idempotency_try_claim(
  p_organization_id uuid,
  p_scope text,
  p_key text,
  p_request_hash text,
  p_lease_token uuid,
  p_lease_ms bigint,
  p_retain_ms bigint
) returns setof agent.idempotency_claim
language plpgsql volatile security invoker
set search_path = '' set lock_timeout = '5s'
as $$
declare
  d record;
  r agent.idempotency_keys;
  v_at timestamptz;
begin
  if p_lease_token is null then
    raise exception 'p_lease_token is required' using errcode = '22023';
  end if;
  d := agent.idempotency_durations(p_lease_ms, p_retain_ms);

  v_at := pg_catalog.clock_timestamp();
  insert into agent.idempotency_keys as k
    (organization_id, scope, key, request_hash, status, lease_token,
     claimed_at, lease_expires_at, retain_until)
  values
    (p_organization_id, p_scope, p_key, p_request_hash, 'processing', p_lease_token,
     v_at, v_at + d.lease, v_at + d.retain)
  on conflict (organization_id, scope, key) do nothing
  returning k.* into r;

  if found then
    -- The insert waited for a concurrent insert of the same key that then
    -- rolled back: the lease starts now, not before the wait.
    if pg_catalog.clock_timestamp() - v_at > interval '10 milliseconds' then
      r := agent.idempotency_restamp(r.id, d.lease, d.retain);
    end if;
  else
    -- Our own earlier attempt, whose answer was lost on the way back. Only
    -- while its lease is live: past it, the caller must reclaim like anyone.
    select k.* into r
      from agent.idempotency_keys k
     where k.organization_id = p_organization_id
       and k.scope = p_scope
       and k.key = p_key
       and k.lease_token = p_lease_token
       and k.request_hash = p_request_hash
       and k.status = 'processing'
       and k.lease_expires_at > pg_catalog.clock_timestamp();
  end if;
  if found then
    return next agent.idempotency_claim_of(r);
  end if;
end
$$;

create or replace function agent.idempotency_reclaim(
  p_organization_id uuid,
  p_scope text,
  p_key text,
  p_request_hash text,
  p_lease_token uuid,
  p_lease_ms bigint,
  p_retain_ms bigint
) returns setof agent.idempotency_claim
language plpgsql volatile security invoker
set search_path = '' set lock_timeout = '5s'
as $$
declare
  d record;
  r agent.idempotency_keys;
  v_at timestamptz;
begin
  if p_lease_token is null then
    raise exception 'p_lease_token is required' using errcode = '22023';
  end if;
  d := agent.idempotency_durations(p_lease_ms, p_retain_ms);

  v_at := pg_catalog.clock_timestamp();
  update agent.idempotency_keys as k
     set lease_token = p_lease_token,
         claimed_at = v_at,
         lease_expires_at = v_at + d.lease,
         retain_until = greatest(k.retain_until, v_at + d.retain)
   where k.organization_id = p_organization_id
     and k.scope = p_scope
     and k.key = p_key
     and k.request_hash = p_request_hash
     and k.status = 'processing'
     and k.lease_expires_at <= pg_catalog.clock_timestamp()
  returning k.* into r;

  if found then
    -- The update waited on another transaction's lock of the row.
    if pg_catalog.clock_timestamp() - v_at > interval '10 milliseconds' then
      r := agent.idempotency_restamp(r.id, d.lease, d.retain);
    end if;
  else
    -- Our own earlier reclaim, whose answer was lost on the way back (its
    -- lease is live, or the update above would have matched).
    select k.* into r
      from agent.idempotency_keys k
     where k.organization_id = p_organization_id
       and k.scope = p_scope
       and k.key = p_key
       and k.lease_token = p_lease_token
       and k.request_hash = p_request_hash
       and k.status = 'processing'
       and k.lease_expires_at > pg_catalog.clock_timestamp();
  end if;
  if found then
    return next agent.idempotency_claim_of(r);
  end if;
end
$$;

create or replace function agent.idempotency_complete(
  p_claim_id uuid,
  p_lease_token uuid,
  p_resource_type text default null,
  p_resource_id text default null,
  p_response jsonb default null
) returns setof agent.idempotency_claim
language plpgsql volatile security invoker
set search_path = '' set lock_timeout = '5s'
as $$
declare
  v_resource_type text := nullif(p_resource_type, '');
  v_resource_id   text := nullif(p_resource_id, '');
  v_response      jsonb := nullif(p_response, 'null'::jsonb);
  r agent.idempotency_keys;
begin
  if p_claim_id is null or p_lease_token is null then
    raise exception 'p_claim_id and p_lease_token are required' using errcode = '22023';
  end if;
  if v_response is null and v_resource_id is null then
    raise exception 'a completion carries a response or a resource; this one carries neither'
      using errcode = '22023';
  end if;
  if v_resource_id is not null and v_resource_type is null then
    raise exception 'p_resource_id needs p_resource_type, so a reader can tell what it names'
      using errcode = '22023';
  end if;

  update agent.idempotency_keys as k
     set status = 'completed',
         resource_type = v_resource_type,
         resource_id = v_resource_id,
         response = v_response,
         retain_until = greatest(k.retain_until, pg_catalog.clock_timestamp() + (k.retain_until - k.claimed_at))
   where k.id = p_claim_id
     and k.lease_token = p_lease_token
     and k.status = 'processing'
  returning k.* into r;

  if not found then
    -- Completed already by this very token: an earlier attempt of this call.
    select k.* into r
      from agent.idempotency_keys k
     where k.id = p_claim_id
       and k.lease_token = p_lease_token
       and k.status = 'completed'
       and k.resource_type is not distinct from v_resource_type
       and k.resource_id is not distinct from v_resource_id
       and k.response is not distinct from v_response;
  end if;
  if found then
    return next agent.idempotency_claim_of(r);
  end if;
end
$$;

-- 2. Lock waits -------------------------------------------------------------

alter function agent.idempotency_release(uuid, uuid) set lock_timeout = '5s';
alter function agent.idempotency_delete_expired(uuid[]) set lock_timeout = '5s';
alter function agent.provider_job_register(uuid, text, text) set lock_timeout = '5s';

-- 3. Run admission tokens ---------------------------------------------------

-- The token of the call that inserted the Run: the caller's secret, never
-- answered. NULL for Runs admitted without one.
alter table agent.runs add column admission_token uuid;

-- A new argument is a new signature: the old function goes, or PostgREST
-- would find two candidates for a call that names only the first three.
drop function agent.run_admit(uuid, text, jsonb);

-- Admits a Run once per (organization, start key). Answers one row: the Run,
-- with admitted = true for the call that inserted it, and for a repeat of
-- that call (the same p_admission_token) whose answer was lost. Any other
-- caller gets admitted = false and the input the Run was admitted with.
-- The token must be a fresh random UUID per admission attempt.
create function agent.run_admit(
  p_organization_id uuid,
  p_start_key text,
  p_input jsonb,
  p_admission_token uuid default null
) returns setof agent.run_admission
language plpgsql volatile security invoker
set search_path = '' set lock_timeout = '5s'
as $$
begin
  if p_organization_id is null or nullif(p_start_key, '') is null
     or p_input is null or p_input = 'null'::jsonb then
    raise exception 'p_organization_id, p_start_key and p_input are required'
      using errcode = '22023';
  end if;

  return query
    insert into agent.runs as r (organization_id, start_key, input, admission_token)
    values (p_organization_id, p_start_key, p_input, p_admission_token)
    on conflict (organization_id, start_key) do nothing
    returning r.id, r.organization_id, r.start_key, r.input, r.status,
              r.admitted_at, r.retain_until, true;
  if found then
    return;
  end if;

  -- The conflicting insert has committed (ON CONFLICT waited for it), and
  -- this statement's fresh snapshot sees it.
  return query
    select r.id, r.organization_id, r.start_key, r.input, r.status,
           r.admitted_at, r.retain_until,
           coalesce(r.admission_token = p_admission_token, false)
      from agent.runs r
     where r.organization_id = p_organization_id
       and r.start_key = p_start_key;
end
$$;

-- 4. Privileges -------------------------------------------------------------

-- PostgreSQL makes every new function executable by PUBLIC. That default can
-- only be revoked for all schemas at once (a per-schema REVOKE cannot undo a
-- global default), so this applies to every function the role running the
-- migrations creates from now on: each must be granted explicitly, as every
-- function of this plane is.
alter default privileges revoke execute on functions from public;
alter default privileges in schema agent revoke execute on functions from anon, authenticated, service_role;

revoke all on function
  agent.idempotency_restamp(uuid, interval, interval),
  agent.run_admit(uuid, text, jsonb, uuid)
from public, anon, authenticated;
grant execute on function
  agent.idempotency_restamp(uuid, interval, interval),
  agent.run_admit(uuid, text, jsonb, uuid)
to service_role;

-- run_admit inserts and reads; nothing updates or deletes a Run through
-- the plane.
revoke update, delete on agent.runs from service_role;
