-- Failures can be recovered after a fix.
--
-- A journaled failure is the event's answer: every later claim of its key
-- replays it, a vendor's redeliveries and a Dashboard "Resend" included,
-- for the scope's whole retention. That is right while the failure would
-- repeat, and wrong once the bug behind it is fixed. With the work stored
-- in the claim (0017), an operator can now see those failures and send
-- chosen ones back through re-drive:
--
-- 1. agent.idempotency_failures(p_scope, p_limit, p_organization_id,
--    p_since, p_row_cap) lists journaled failures of a scope or a family
--    (webhook.*): completed claims whose answer has "ok": false, dead
--    letters included, oldest claim first, claimed at or after p_since when
--    given. Read-only. Each row says whether the claim carries its work
--    (redrivable) and how often it was sent back already (requeues).
-- 2. agent.idempotency_redrive_failed(p_scope, p_limit, p_organization_id,
--    p_since, p_claim_ids, p_row_cap) sends up to p_limit of them back, in
--    one statement: the chosen ids (p_claim_ids), or every failure of the
--    scope claimed since p_since, or both filters at once. Only a failure
--    that carries its work can be sent back (nothing else could run it).
--    Each becomes an orphan again: processing, its lease passed, with a
--    fresh lease token, its attempts counted from one again (the send-back
--    is the first, so the next re-drive hands it out as attempt 2, and it
--    has max_attempts - 1 runs before it is a dead letter again), its
--    retention renewed by the scope's policy. A scope whose max_attempts
--    is 1 allows no run after the first, and one that lost its policy row
--    has no retention to renew: failures of either are not sent back.
--    Concurrent callers split the failures (FOR UPDATE SKIP LOCKED), and a
--    failure sent back is no longer a failure, so each is sent back once
--    per call that finds it journaled. Until a re-drive (or a redelivery,
--    which may take over a passed lease as always) runs it, a claim of its
--    key finds no answer to replay.
--
-- What it replaced is kept for the audit, in the row: the new column
-- replaced is a JSON array, oldest first, of what each send-back replaced
-- (the answer, its resource, its attempts, when it was claimed, when it was
-- sent back), at most 20 entries (the oldest are dropped beyond).
--
-- Both answer rows of the type agent.idempotency_failure, bounded like
-- every read: p_limit between 1 and p_row_cap (default 1000, the row cap
-- the caller is held to), and a taken count in every row, so a client sees
-- an answer a server's row cap cut short. No new index: listing failures is
-- an operator's bounded scan of a scope, never the hot path, and indexing
-- the answer would make every completion a non-HOT update.
--
-- Everything follows 0011: owned by idempotency_owner, SECURITY DEFINER
-- with search_path '', every name qualified, executable by service_role.

-- 1. Data ----------------------------------------------------------------------------------

alter table agent.idempotency_keys add column replaced jsonb;

comment on column agent.idempotency_keys.replaced is
  'What agent.idempotency_redrive_failed replaced, oldest first (at most 20): the audit of failures sent back.';

create type agent.idempotency_failure as (
  id               uuid,
  organization_id  uuid,
  scope            text,
  key              text,
  status           text,
  error            text,
  response         jsonb,
  resource_type    text,
  resource_id      text,
  attempts         integer,
  claimed_at       timestamptz,
  retain_until     timestamptz,
  redrivable       boolean,
  requeues         integer,
  taken            integer
);
alter type agent.idempotency_failure owner to idempotency_owner;

-- 2. Arguments ----------------------------------------------------------------------------

-- Checks the arguments both functions share, refusing what they must
-- refuse (22023, or IDEM1 for an unknown scope), and answers the family's
-- prefix: 'webhook.' for webhook.*, NULL for an exact scope.
create function agent.idempotency_failures_scope(p_scope text, p_limit integer, p_row_cap integer)
returns text
language plpgsql stable security invoker set search_path = ''
as $$
declare
  v_prefix text;
begin
  if p_scope is null then
    raise exception 'p_scope is required' using errcode = '22023';
  end if;
  if char_length(p_scope) > 128 or p_scope !~ '^[a-z0-9_-]+(\.[a-z0-9_-]+)*(\.\*)?$' then
    raise exception 'p_scope must be a scope (webhook.stripe) or a family (webhook.*) of a-z, 0-9, "_" and "-", got %',
                    pg_catalog.left(p_scope, 128)
      using errcode = '22023';
  end if;
  if p_row_cap is null or p_row_cap not between 1 and 100000 then
    raise exception 'p_row_cap must be between 1 and 100000, got %', p_row_cap
      using errcode = '22023',
            hint = 'the row cap the caller is held to: PostgREST db-max-rows, Supabase api.max_rows (default 1000)';
  end if;
  if p_limit is null or p_limit not between 1 and p_row_cap then
    raise exception 'p_limit must be between 1 and the row cap p_row_cap %, got %', p_row_cap, p_limit
      using errcode = '22023',
            hint = 'every failure is answered; more than the row cap would be cut from the answer';
  end if;
  v_prefix := case when right(p_scope, 2) = '.*' then left(p_scope, -1) end;
  if (select p.retain from agent.idempotency_policy(p_scope) p) is null
     and not (v_prefix is not null and exists (select 1 from agent.idempotency_scopes s
                                               where left(s.scope, char_length(v_prefix)) = v_prefix)) then
    raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', p_scope
      using errcode = 'IDEM1',
            hint = 'add the scope (or its family, e.g. webhook.*) to agent.idempotency_scopes in a migration';
  end if;
  return v_prefix;
end
$$;

-- 3. Listing -----------------------------------------------------------------------------

create function agent.idempotency_failures(
  p_scope text,
  p_limit integer,
  p_organization_id uuid default null,
  p_since timestamptz default null,
  p_row_cap integer default 1000
) returns setof agent.idempotency_failure
language plpgsql stable security definer set search_path = ''
as $$
declare
  v_prefix text;
begin
  v_prefix := agent.idempotency_failures_scope(p_scope, p_limit, p_row_cap);
  return query
    with failed as (
      select k.*
        from agent.idempotency_keys k
       where k.status = 'completed'
         and k.response -> 'ok' = 'false'::jsonb
         and (k.scope = p_scope or (v_prefix is not null and left(k.scope, char_length(v_prefix)) = v_prefix))
         and (p_organization_id is null or k.organization_id = p_organization_id)
         and (p_since is null or k.claimed_at >= p_since)
       order by k.claimed_at, k.id
       limit p_limit
    )
    select f.id, f.organization_id, f.scope, f.key, f.status, f.response ->> 'error', f.response,
           f.resource_type, f.resource_id, f.reclaims + 1, f.claimed_at, f.retain_until,
           f.request is not null, coalesce(jsonb_array_length(f.replaced), 0),
           (count(*) over ())::integer
      from failed f
     order by f.claimed_at, f.id;
end
$$;

-- 4. Sending back --------------------------------------------------------------------------

create function agent.idempotency_redrive_failed(
  p_scope text,
  p_limit integer,
  p_organization_id uuid default null,
  p_since timestamptz default null,
  p_claim_ids uuid[] default null,
  p_row_cap integer default 1000
) returns setof agent.idempotency_failure
language plpgsql volatile security definer
set search_path = '' set lock_timeout = '5s'
as $$
declare
  v_prefix text;
  v_at timestamptz;
begin
  v_prefix := agent.idempotency_failures_scope(p_scope, p_limit, p_row_cap);
  if p_claim_ids is not null
     and (cardinality(p_claim_ids) = 0 or array_position(p_claim_ids, null) is not null) then
    raise exception 'p_claim_ids must name at least one claim, and no NULL; omit it to send back every failure'
      using errcode = '22023';
  end if;
  if p_claim_ids is null and p_since is null then
    raise exception 'name what to send back: p_claim_ids (the chosen failures), p_since (every failure claimed since), or both'
      using errcode = '22023';
  end if;

  v_at := pg_catalog.clock_timestamp();
  return query
    with chosen as (
      select k.id, k.organization_id, k.scope, p.retain
        from agent.idempotency_keys k
       cross join lateral agent.idempotency_policy(k.scope) p
       where k.status = 'completed'
         and k.response -> 'ok' = 'false'::jsonb
         and k.request is not null
         and p.retain is not null
         and p.max_attempts > 1
         and (k.scope = p_scope or (v_prefix is not null and left(k.scope, char_length(v_prefix)) = v_prefix))
         and (p_organization_id is null or k.organization_id = p_organization_id)
         and (p_since is null or k.claimed_at >= p_since)
         and (p_claim_ids is null or k.id = any (p_claim_ids))
       order by k.claimed_at, k.id
       limit p_limit
         for update of k skip locked
    ), sent as (
      update agent.idempotency_keys as k
         set status = 'processing',
             response = null,
             resource_type = null,
             resource_id = null,
             lease_token = gen_random_uuid(),
             claimed_at = v_at,
             lease_expires_at = v_at,
             redrive_at = v_at,
             reclaims = 0,
             retain_until = greatest(k.retain_until, v_at + c.retain),
             replaced = (
               select coalesce(jsonb_agg(e.entry order by e.n), '[]'::jsonb)
                 from jsonb_array_elements(
                        coalesce(k.replaced, '[]'::jsonb)
                        || jsonb_build_array(jsonb_build_object(
                             'response', k.response,
                             'resource_type', k.resource_type,
                             'resource_id', k.resource_id,
                             'attempts', k.reclaims + 1,
                             'claimed_at', k.claimed_at,
                             'sent_back_at', v_at))
                      ) with ordinality as e(entry, n)
                where e.n > jsonb_array_length(coalesce(k.replaced, '[]'::jsonb)) + 1 - 20
             )
        from chosen c
       where k.id = c.id and k.organization_id = c.organization_id
      returning k.*
    )
    select s.id, s.organization_id, s.scope, s.key, s.status,
           s.replaced -> -1 -> 'response' ->> 'error', s.replaced -> -1 -> 'response',
           s.replaced -> -1 ->> 'resource_type', s.replaced -> -1 ->> 'resource_id',
           (s.replaced -> -1 ->> 'attempts')::integer, s.claimed_at, s.retain_until,
           true, jsonb_array_length(s.replaced),
           (count(*) over ())::integer
      from sent s
     order by s.id;
end
$$;

-- 5. Owners and execution ------------------------------------------------------------------

alter function agent.idempotency_failures_scope(text, integer, integer) owner to idempotency_owner;
alter function agent.idempotency_failures(text, integer, uuid, timestamptz, integer) owner to idempotency_owner;
alter function agent.idempotency_redrive_failed(text, integer, uuid, timestamptz, uuid[], integer)
  owner to idempotency_owner;

revoke all on function agent.idempotency_failures_scope(text, integer, integer)
from public, anon, authenticated, service_role;
revoke all on function
  agent.idempotency_failures(text, integer, uuid, timestamptz, integer),
  agent.idempotency_redrive_failed(text, integer, uuid, timestamptz, uuid[], integer)
from public, anon, authenticated;
grant execute on function
  agent.idempotency_failures(text, integer, uuid, timestamptz, integer),
  agent.idempotency_redrive_failed(text, integer, uuid, timestamptz, uuid[], integer)
to service_role;
