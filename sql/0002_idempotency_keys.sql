-- The idempotency plane: one table, and the functions that make every atomic
-- decision about it. Callers reach these through PostgREST as
-- POST /rpc/<name> with Content-Profile: agent. Names, argument names and
-- result shapes are a public contract (README, "The SQL surface").
--
-- One clock: callers pass durations (p_lease_ms, p_retain_ms) and the
-- database computes every instant from its own now(). No caller's clock ever
-- decides whether a lease is live.

create schema if not exists agent;

create table agent.idempotency_keys (
  id               uuid        primary key default gen_random_uuid(),
  organization_id  uuid        not null,
  scope            text        not null,
  key              text        not null,
  request_hash     text        not null,
  status           text        not null default 'processing',
  lease_token      uuid        not null,
  resource_type    text,
  resource_id      text,
  response         jsonb,
  claimed_at       timestamptz not null default now(),
  lease_expires_at timestamptz not null,
  retain_until     timestamptz not null,
  constraint idempotency_keys_org_scope_key_key unique (organization_id, scope, key),
  constraint idempotency_keys_status_check check (status in ('processing', 'completed')),
  constraint idempotency_keys_retention_covers_lease check (retain_until >= lease_expires_at),
  constraint idempotency_keys_completed_has_answer
    check (status <> 'completed' or nullif(response, 'null'::jsonb) is not null or resource_id is not null),
  constraint idempotency_keys_resource_is_typed
    check (resource_id is null or resource_type is not null),
  constraint idempotency_keys_scope_length check (char_length(scope) between 1 and 128),
  constraint idempotency_keys_key_length check (char_length(key) between 1 and 512),
  constraint idempotency_keys_request_hash_sha256 check (request_hash ~ '^[0-9a-f]{64}$'),
  constraint idempotency_keys_resource_type_length check (char_length(resource_type) between 1 and 128),
  constraint idempotency_keys_resource_id_length check (char_length(resource_id) between 1 and 512)
);

comment on table agent.idempotency_keys is
  'Idempotency claims and the replay journal. Written only through the agent.idempotency_* functions.';

-- The sweeper reads the oldest expired rows first.
create index idempotency_keys_retain_until_idx on agent.idempotency_keys (retain_until, id);

alter table agent.idempotency_keys enable row level security;

-- What every claim function answers: the record, plus whether its lease is
-- live by the database clock. A completed row holds no lease.
create type agent.idempotency_claim as (
  id               uuid,
  organization_id  uuid,
  scope            text,
  key              text,
  request_hash     text,
  status           text,
  lease_token      uuid,
  resource_type    text,
  resource_id      text,
  response         jsonb,
  claimed_at       timestamptz,
  lease_expires_at timestamptz,
  retain_until     timestamptz,
  lease_live       boolean
);

-- A row as the claim functions answer it: every column, and lease_live by
-- the database clock (false for a completed row, which holds no lease).
create function agent.idempotency_claim_of(k agent.idempotency_keys)
returns agent.idempotency_claim
language sql stable security invoker set search_path = ''
as $$
  select k.id, k.organization_id, k.scope, k.key, k.request_hash, k.status,
         k.lease_token, k.resource_type, k.resource_id, k.response, k.claimed_at,
         k.lease_expires_at, k.retain_until,
         (k.status = 'processing' and k.lease_expires_at > now());
$$;

-- Validates the durations every claim takes and answers them as intervals.
-- Bad input raises 22023 (invalid_parameter_value), which PostgREST answers
-- with 400 and the message below. The retention is raised to the lease,
-- because a row must be remembered at least as long as it is held.
create function agent.idempotency_durations(p_lease_ms bigint, p_retain_ms bigint,
                                            out lease interval, out retain interval)
language plpgsql immutable security invoker set search_path = ''
as $$
begin
  -- A lease is measured from the start of the claiming transaction, so one
  -- shorter than a second could pass while that transaction still waits on
  -- a lock, and two workers would both hold the key.
  if p_lease_ms is null or p_lease_ms < 1000 or p_lease_ms > 86400000 then
    raise exception 'p_lease_ms must be between 1000 (one second) and 86400000 (one day), got %', p_lease_ms
      using errcode = '22023';
  end if;
  if p_retain_ms is null or p_retain_ms <= 0 or p_retain_ms > 31622400000 then
    raise exception 'p_retain_ms must be between 1 and 31622400000 (366 days), got %', p_retain_ms
      using errcode = '22023';
  end if;
  lease := p_lease_ms * interval '1 millisecond';
  retain := greatest(p_retain_ms, p_lease_ms) * interval '1 millisecond';
end
$$;

-- Claims a key that nobody holds. Answers the new row, or no row when the key
-- is already claimed (the caller then reads it with idempotency_get).
--
-- Safe to retry after a lost response: a repeat with the same lease token
-- answers the row that token still holds (live lease) instead of reporting a
-- conflict. The token must therefore be a fresh random UUID for every claim
-- attempt, never derived from the key: only the caller that minted it may
-- present it.
create function agent.idempotency_try_claim(
  p_organization_id uuid,
  p_scope text,
  p_key text,
  p_request_hash text,
  p_lease_token uuid,
  p_lease_ms bigint,
  p_retain_ms bigint
) returns setof agent.idempotency_claim
language plpgsql volatile security invoker set search_path = ''
as $$
declare
  d record;
  r agent.idempotency_keys;
begin
  if p_lease_token is null then
    raise exception 'p_lease_token is required' using errcode = '22023';
  end if;
  d := agent.idempotency_durations(p_lease_ms, p_retain_ms);

  insert into agent.idempotency_keys as k
    (organization_id, scope, key, request_hash, status, lease_token,
     claimed_at, lease_expires_at, retain_until)
  values
    (p_organization_id, p_scope, p_key, p_request_hash, 'processing', p_lease_token,
     now(), now() + d.lease, now() + d.retain)
  on conflict (organization_id, scope, key) do nothing
  returning k.* into r;

  if not found then
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
       and k.lease_expires_at > now();
  end if;
  if found then
    return next agent.idempotency_claim_of(r);
  end if;
end
$$;

-- Takes over a claim whose worker is gone: answers the row with the caller's
-- new token and lease when the row is processing, its lease has passed and
-- its hash matches; otherwise no row. One UPDATE decides, so of any number of
-- concurrent reclaimers exactly one wins: the others wait for the winner's
-- row lock, re-check the row it wrote, find a live lease, and match nothing.
--
-- The retention only grows: retain_until = greatest(old, now() + retain).
-- Safe to retry after a lost response, like idempotency_try_claim.
create function agent.idempotency_reclaim(
  p_organization_id uuid,
  p_scope text,
  p_key text,
  p_request_hash text,
  p_lease_token uuid,
  p_lease_ms bigint,
  p_retain_ms bigint
) returns setof agent.idempotency_claim
language plpgsql volatile security invoker set search_path = ''
as $$
declare
  d record;
  r agent.idempotency_keys;
begin
  if p_lease_token is null then
    raise exception 'p_lease_token is required' using errcode = '22023';
  end if;
  d := agent.idempotency_durations(p_lease_ms, p_retain_ms);

  update agent.idempotency_keys as k
     set lease_token = p_lease_token,
         claimed_at = now(),
         lease_expires_at = now() + d.lease,
         retain_until = greatest(k.retain_until, now() + d.retain)
   where k.organization_id = p_organization_id
     and k.scope = p_scope
     and k.key = p_key
     and k.request_hash = p_request_hash
     and k.status = 'processing'
     and k.lease_expires_at <= now()
  returning k.* into r;

  if not found then
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
       and k.lease_expires_at > now();
  end if;
  if found then
    return next agent.idempotency_claim_of(r);
  end if;
end
$$;

-- Reads one claim. Never writes.
create function agent.idempotency_get(
  p_organization_id uuid,
  p_scope text,
  p_key text
) returns setof agent.idempotency_claim
language sql stable security invoker set search_path = ''
as $$
  select c.*
    from agent.idempotency_keys k
   cross join lateral agent.idempotency_claim_of(k) c
   where k.organization_id = p_organization_id
     and k.scope = p_scope
     and k.key = p_key;
$$;

-- Completes a claim the caller still holds. No row when the fence moved on
-- (another worker reclaimed the key, or the claim was released): the caller
-- must then do nothing. A completion must carry a response or a typed
-- resource; '' and JSON null count as absent, so the refusal holds whichever
-- way a PostgREST server binds a null argument.
--
-- The answer is remembered for the scope's retention from the completion,
-- not from the claim: retain_until moves to now() plus the window the claim
-- was given, and never earlier.
--
-- Safe to retry after a lost response: a repeat by the token that completed
-- the row, with the same answer, answers the completed row. A different
-- answer under the same token answers no row: the ending already happened.
create function agent.idempotency_complete(
  p_claim_id uuid,
  p_lease_token uuid,
  p_resource_type text default null,
  p_resource_id text default null,
  p_response jsonb default null
) returns setof agent.idempotency_claim
language plpgsql volatile security invoker set search_path = ''
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
         retain_until = greatest(k.retain_until, now() + (k.retain_until - k.claimed_at))
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

-- Deletes an unfinished claim the caller still holds. False when the fence
-- moved on, and the caller must then do nothing. A completed claim is the
-- journal and is never released.
create function agent.idempotency_release(
  p_claim_id uuid,
  p_lease_token uuid
) returns boolean
language sql volatile security invoker set search_path = ''
as $$
  with released as (
    delete from agent.idempotency_keys k
     where k.id = p_claim_id
       and k.lease_token = p_lease_token
       and k.status = 'processing'
    returning 1
  )
  select exists (select 1 from released);
$$;

-- The sweeper's bounded read: up to p_limit rows past retention, oldest
-- first. Returns the table's own row type, so db-max-rows truncates it the
-- same way on PostgREST and on postrust-server, and Content-Range reports it.
create function agent.idempotency_expired(p_limit integer)
returns setof agent.idempotency_keys
language plpgsql stable security invoker set search_path = ''
as $$
begin
  if p_limit is null or p_limit < 1 or p_limit > 100000 then
    raise exception 'p_limit must be between 1 and 100000, got %', p_limit using errcode = '22023';
  end if;
  return query
    select k.*
      from agent.idempotency_keys k
     where k.retain_until < now()
     order by k.retain_until, k.id
     limit p_limit;
end
$$;

-- Deletes the given rows that are still past retention, and answers how many
-- it deleted. A row whose retention was extended after it was read survives.
create function agent.idempotency_delete_expired(p_ids uuid[])
returns integer
language plpgsql volatile security invoker set search_path = ''
as $$
declare
  v_deleted integer;
begin
  if p_ids is null then
    raise exception 'p_ids is required' using errcode = '22023';
  end if;
  if cardinality(p_ids) > 100000 then
    raise exception 'p_ids holds % ids; at most 100000 per call', cardinality(p_ids)
      using errcode = '22023';
  end if;
  delete from agent.idempotency_keys k
   where k.id = any (p_ids)
     and k.retain_until < now();
  get diagnostics v_deleted = row_count;
  return v_deleted;
end
$$;
