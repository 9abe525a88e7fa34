-- Surface v2: the plane decides, for every client alike.
--
-- * agent.idempotency_scopes holds each scope's retention and response
--   limit. Every claim reads its scope's policy: an unknown scope is refused
--   (SQLSTATE IDEM1, HTTP 400), a tool scope keeps at least 30 days, and an
--   argument can only lengthen a retention.
-- * agent.idempotency_complete refuses a response above its scope's limit
--   (IDEM2, HTTP 400), whichever client sent it.
-- * agent.idempotency_claim decides a claim in one call: claimed,
--   reclaimed, completed, processing or conflict.
--
-- The v1 functions keep their arguments and answers. Every claim decision
-- is written once, in agent.idempotency_decide, which the one-call claim and
-- the v1 try_claim and reclaim call with what each may do (insert a free
-- key, take over a passed lease). It is one lean plpgsql body on purpose:
-- nested helper calls, each with its own SET search_path, cost more than
-- the statements they wrap on the hot path of every effect.
--
-- Retention counts from the end of the lease: a claim is remembered until
-- lease_expires_at + retention, so an answer given within the lease is kept
-- for the whole retention without moving retain_until; only a completion
-- after the lease passed moves it. A completion then changes no indexed
-- column, and with room left on the page (fillfactor 80) it is a HOT update.

-- Policy ---------------------------------------------------------------------

create table agent.idempotency_scopes (
  scope              text     primary key,
  retain             interval not null,
  max_response_bytes integer  not null,
  -- An exact scope (tool.email.send) or a family (tool.*): dot-separated
  -- names of a-z 0-9 _ -, a family ending in ".*".
  constraint idempotency_scopes_scope_shape
    check (scope ~ '^[a-z0-9_-]+(\.[a-z0-9_-]+)*(\.\*)?$' and char_length(scope) <= 128),
  constraint idempotency_scopes_retain_range
    check (retain >= interval '1 second' and retain <= interval '366 days'),
  -- A tool claim is the replay journal of a Run that may wait on an
  -- approval for up to 30 days (the cap on max_run_duration).
  constraint idempotency_scopes_tool_retention
    check (scope not like 'tool.%' or retain >= interval '30 days'),
  constraint idempotency_scopes_max_response_bytes_range
    check (max_response_bytes between 1024 and 16777216)
);

comment on table agent.idempotency_scopes is
  'Retention and response limit per scope (exact, or a family such as tool.*). A scope with no row is refused.';

insert into agent.idempotency_scopes (scope, retain, max_response_bytes) values
  ('tool.*', interval '30 days', 65536),
  ('webhook.*', interval '24 hours', 65536),
  ('surface.saved_search.start', interval '24 hours', 65536);

alter table agent.idempotency_scopes enable row level security;

-- The policy of p_scope: its exact row, else the longest family whose
-- prefix it extends (tool.crm.* before tool.*). Both NULL when none applies.
create function agent.idempotency_policy(p_scope text, out retain interval, out max_response_bytes integer)
language plpgsql stable security invoker set search_path = ''
as $$
begin
  select s.retain, s.max_response_bytes into retain, max_response_bytes
    from agent.idempotency_scopes s
   where s.scope = p_scope
      or (s.scope like '%.*'
          and char_length(p_scope) > char_length(s.scope) - 1
          and left(p_scope, char_length(s.scope) - 1) = left(s.scope, -1))
   order by s.scope = p_scope desc, char_length(s.scope) desc
   limit 1;
end
$$;

-- Data shape ----------------------------------------------------------------

-- How many times the claim was taken over from a worker whose lease passed;
-- lets a repeated call tell its own reclaim from a first claim.
alter table agent.idempotency_keys add column reclaims integer not null default 0;
alter table agent.idempotency_keys set (fillfactor = 80);

-- What the claim functions answer: the outcome, and the claim as the caller
-- may see it.
create type agent.idempotency_claim_outcome as (
  outcome          text,
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

-- Every claim decision, following the spec's diagram: insert a free key
-- (when p_may_insert); else load the row; a different hash is a conflict
-- whatever the lease says; completed replays; a live lease is processing,
-- or the caller's own claim when it carries the caller's token (a repeat
-- after a lost answer); a passed lease is taken over (when p_may_take_over)
-- by one UPDATE that re-checks the row it read, so of any number of
-- concurrent callers exactly one wins, or answered 'reclaimable'.
--
-- The lease starts when the row is won: it is stamped from
-- clock_timestamp(), and stamped again when winning took longer than 10 ms
-- (a wait on another transaction's insert or lock of the same key).
-- Retention is the scope's policy (IDEM1 when it has none), lengthened by
-- p_retain_ms when given, never under the lease, counted from the lease's
-- end. Only claimed and reclaimed show the lease token; processing and
-- conflict show neither the answer nor the resource, and conflict not the
-- stored request hash either. Malformed keys, scopes and hashes are refused
-- by the table's checks (23514), bad durations with 22023. Callers set the
-- lock_timeout it runs under.
create function agent.idempotency_decide(
  p_organization_id uuid,
  p_scope text,
  p_key text,
  p_request_hash text,
  p_lease_token uuid,
  p_lease_ms bigint,
  p_retain_ms bigint,
  p_may_insert boolean,
  p_may_take_over boolean
) returns setof agent.idempotency_claim_outcome
language plpgsql volatile security invoker
set search_path = ''
as $$
declare
  v_policy record;
  v_lease interval;
  v_retain interval;
  v_at timestamptz;
  v_won boolean := false;
  v_outcome text;
  r agent.idempotency_keys;
begin
  -- One test on the way in; the messages are built only for a refusal.
  if p_organization_id is null or p_lease_token is null
     or p_lease_ms is null or p_lease_ms not between 1000 and 86400000
     or p_retain_ms not between 1 and 31622400000 then
    if p_organization_id is null or p_lease_token is null then
      raise exception 'p_organization_id and p_lease_token are required' using errcode = '22023';
    elsif p_lease_ms is null or p_lease_ms not between 1000 and 86400000 then
      raise exception 'p_lease_ms must be between 1000 (one second) and 86400000 (one day), got %', p_lease_ms
        using errcode = '22023';
    else
      raise exception 'p_retain_ms must be between 1 and 31622400000 (366 days), got %', p_retain_ms
        using errcode = '22023';
    end if;
  end if;
  select * into v_policy from agent.idempotency_policy(p_scope);
  if v_policy.retain is null then
    raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', p_scope
      using errcode = 'IDEM1',
            hint = 'add the scope (or its family, e.g. tool.*) to agent.idempotency_scopes with its retention';
  end if;
  v_lease := p_lease_ms * interval '1 millisecond';
  v_retain := greatest(v_policy.retain, coalesce(p_retain_ms, 0) * interval '1 millisecond', v_lease);

  -- Each pass decides, or sees the row change under it (released, taken
  -- over by someone else) and looks again; a key that keeps changing hands
  -- gives up with a serialization failure, which is safe to retry.
  for pass in 1..4 loop
    if p_may_insert then
      v_at := pg_catalog.clock_timestamp();
      insert into agent.idempotency_keys as k
        (organization_id, scope, key, request_hash, status, lease_token,
         claimed_at, lease_expires_at, retain_until)
      values
        (p_organization_id, p_scope, p_key, p_request_hash, 'processing', p_lease_token,
         v_at, v_at + v_lease, v_at + v_lease + v_retain)
      on conflict (organization_id, scope, key) do nothing
      returning k.* into r;
      if found then
        v_outcome := 'claimed';
        v_won := true;
        exit;
      end if;
    end if;

    select k.* into r
      from agent.idempotency_keys k
     where k.organization_id = p_organization_id and k.scope = p_scope and k.key = p_key;
    if not found then
      -- Released since our insert: insert again; or nothing to take over.
      continue when p_may_insert;
      return;
    end if;
    if r.request_hash <> p_request_hash then
      v_outcome := 'conflict';
    elsif r.status = 'completed' then
      v_outcome := 'completed';
    elsif r.lease_expires_at > pg_catalog.clock_timestamp() then
      v_outcome := case when r.lease_token <> p_lease_token then 'processing'
                        when r.reclaims > 0 then 'reclaimed'
                        else 'claimed' end;
    elsif not p_may_take_over then
      v_outcome := 'reclaimable';
    end if;
    exit when v_outcome is not null;

    v_at := pg_catalog.clock_timestamp();
    update agent.idempotency_keys as k
       set lease_token = p_lease_token,
           claimed_at = v_at,
           lease_expires_at = v_at + v_lease,
           retain_until = greatest(k.retain_until, v_at + v_lease + v_retain),
           reclaims = k.reclaims + 1
     where k.id = r.id
       and k.lease_token = r.lease_token
       and k.status = 'processing'
       and k.lease_expires_at <= pg_catalog.clock_timestamp()
    returning k.* into r;
    if found then
      v_outcome := 'reclaimed';
      v_won := true;
      exit;
    end if;
  end loop;
  if v_outcome is null then
    raise exception 'the key %/% kept changing hands; try again', p_scope, p_key using errcode = '40001';
  end if;

  if v_won and pg_catalog.clock_timestamp() - v_at > interval '10 milliseconds' then
    v_at := pg_catalog.clock_timestamp();
    update agent.idempotency_keys as k
       set claimed_at = v_at,
           lease_expires_at = v_at + v_lease,
           retain_until = greatest(k.retain_until, v_at + v_lease + v_retain)
     where k.id = r.id
    returning k.* into r;
  end if;

  return next (
    v_outcome, r.id, r.organization_id, r.scope, r.key,
    case when v_outcome = 'conflict' then null else r.request_hash end,
    r.status,
    case when v_outcome in ('claimed', 'reclaimed') then r.lease_token end,
    case when v_outcome = 'completed' then r.resource_type end,
    case when v_outcome = 'completed' then r.resource_id end,
    case when v_outcome = 'completed' then r.response end,
    r.claimed_at, r.lease_expires_at, r.retain_until,
    r.status = 'processing' and r.lease_expires_at > pg_catalog.clock_timestamp()
  )::agent.idempotency_claim_outcome;
end
$$;

-- v2: one call decides ----------------------------------------------------------

-- Claims a key, or answers why not, in one call and one transaction: always
-- exactly one row, whose outcome is claimed, reclaimed, completed,
-- processing or conflict (see agent.idempotency_decide). A repeat with the
-- same token after a lost answer answers that caller's own row again.
create function agent.idempotency_claim(
  p_organization_id uuid,
  p_scope text,
  p_key text,
  p_request_hash text,
  p_lease_token uuid,
  p_lease_ms bigint
) returns setof agent.idempotency_claim_outcome
language plpgsql volatile security invoker
set search_path = '' set lock_timeout = '5s'
as $$
begin
  return query
    select * from agent.idempotency_decide(p_organization_id, p_scope, p_key, p_request_hash, p_lease_token,
                                           p_lease_ms, null, true, true);
end
$$;

-- v1, on the same decisions ---------------------------------------------------

-- Claims a key nobody holds: the new row, or no row when the key is taken
-- (a passed lease included: reclaiming is idempotency_reclaim's). A repeat
-- with the same token answers that caller's live claim.
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
begin
  return query
    select d.id, d.organization_id, d.scope, d.key, d.request_hash, d.status, d.lease_token, d.resource_type,
           d.resource_id, d.response, d.claimed_at, d.lease_expires_at, d.retain_until, d.lease_live
      from agent.idempotency_decide(p_organization_id, p_scope, p_key, p_request_hash, p_lease_token,
                                    p_lease_ms, p_retain_ms, true, false) d
     where d.outcome in ('claimed', 'reclaimed');
end
$$;

-- Takes over a claim whose worker is gone: the row with the caller's new
-- token and lease when it is processing, its lease has passed and its hash
-- matches; else no row. A repeat with the same token answers that caller's
-- live claim.
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
begin
  return query
    select d.id, d.organization_id, d.scope, d.key, d.request_hash, d.status, d.lease_token, d.resource_type,
           d.resource_id, d.response, d.claimed_at, d.lease_expires_at, d.retain_until, d.lease_live
      from agent.idempotency_decide(p_organization_id, p_scope, p_key, p_request_hash, p_lease_token,
                                    p_lease_ms, p_retain_ms, false, true) d
     where d.outcome in ('claimed', 'reclaimed');
end
$$;

-- Completes a claim the caller still holds; see 0002 for the rules. The
-- answer is remembered for the claim's retention from the later of its
-- lease's end and the completion (so a completion within the lease changes
-- no indexed column), and a response above its scope's max_response_bytes
-- (as compact JSON) is refused with IDEM2.
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
  v_limit integer;
  v_size bigint;
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
         retain_until = greatest(k.retain_until,
                                 pg_catalog.clock_timestamp() + (k.retain_until - k.lease_expires_at))
   where k.id = p_claim_id
     and k.lease_token = p_lease_token
     and k.status = 'processing'
  returning k.* into r;

  if found then
    if v_response is not null then
      -- PostgreSQL's text form of a jsonb is the compact form plus a space
      -- after every ',' and ':' between tokens: no text shorter than the
      -- smallest limit a policy may set (1024) can be above one, and only a
      -- text longer than the scope's limit is measured exactly.
      v_size := octet_length(v_response::text);
      if v_size > 1024 then
        select p.max_response_bytes into v_limit from agent.idempotency_policy(r.scope) p;
        if v_limit is null then
          raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', r.scope
            using errcode = 'IDEM1';
        end if;
        if v_size > v_limit then
          v_size := agent.idempotency_json_size(v_response);
          if v_size > v_limit then
            raise exception 'the response is % bytes as compact JSON, above the % bytes scope % keeps',
                            v_size, v_limit, r.scope
              using errcode = 'IDEM2',
                    hint = 'store the response elsewhere and complete with its resource (and a reference to it)';
          end if;
        end if;
      end if;
    end if;
  else
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

-- The size of p_value as compact JSON, in bytes: its text form without the
-- space PostgreSQL writes after every ',' and ':' outside string literals.
create function agent.idempotency_json_size(p_value jsonb)
returns bigint
language plpgsql immutable security invoker set search_path = ''
as $$
declare
  v_text text := p_value::text;
  v_bare text := pg_catalog.regexp_replace(v_text, '"(?:[^"\\]|\\.)*"', '', 'g');
begin
  return octet_length(v_text)
         - (octet_length(v_bare) - octet_length(pg_catalog.replace(v_bare, ', ', ','))
            + octet_length(v_bare) - octet_length(pg_catalog.replace(v_bare, ': ', ':')));
end
$$;

-- A read of a scope with no policy is refused like a claim (IDEM1): no
-- claim can exist under it, and a caller that names one has a bug.
create or replace function agent.idempotency_get(
  p_organization_id uuid,
  p_scope text,
  p_key text
) returns setof agent.idempotency_claim
language plpgsql stable security invoker set search_path = ''
as $$
begin
  if (select p.retain from agent.idempotency_policy(p_scope) p) is null then
    raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', p_scope
      using errcode = 'IDEM1';
  end if;
  return query
    select c.*
      from agent.idempotency_keys k
     cross join lateral agent.idempotency_claim_of(k) c
     where k.organization_id = p_organization_id
       and k.scope = p_scope
       and k.key = p_key;
end
$$;

-- The row-cap probe answers rows of the table's type, which gained a column.
create or replace function agent.idempotency_cap_probe(p_rows integer)
returns setof agent.idempotency_keys
language plpgsql volatile security invoker set search_path = ''
as $$
begin
  if p_rows is null or p_rows < 1 or p_rows > 100001 then
    raise exception 'p_rows must be between 1 and 100001, got %', p_rows using errcode = '22023';
  end if;
  return query
    select gen_random_uuid(), '00000000-0000-0000-0000-000000000000'::uuid, 'probe', 'probe-' || i,
           repeat('0', 64), 'processing', gen_random_uuid(), null::text, null::text, null::jsonb,
           now(), now(), now(), 0
      from generate_series(1, p_rows) as i;
end
$$;

-- A row as the v1 functions answer it. plpgsql, so its plan is cached: a
-- SQL function that cannot be inlined (it pins search_path) is planned anew
-- on every call, which cost more than the completion it shapes.
create or replace function agent.idempotency_claim_of(k agent.idempotency_keys)
returns agent.idempotency_claim
language plpgsql volatile security invoker set search_path = ''
as $$
begin
  return (k.id, k.organization_id, k.scope, k.key, k.request_hash, k.status,
          k.lease_token, k.resource_type, k.resource_id, k.response, k.claimed_at,
          k.lease_expires_at, k.retain_until,
          k.status = 'processing' and k.lease_expires_at > pg_catalog.clock_timestamp())::agent.idempotency_claim;
end
$$;

-- Replaced by idempotency_decide.
drop function agent.idempotency_durations(bigint, bigint);
drop function agent.idempotency_restamp(uuid, interval, interval);

-- Privileges ------------------------------------------------------------------

revoke all on agent.idempotency_scopes from public, anon, authenticated;
grant select on agent.idempotency_scopes to service_role;

revoke all on type agent.idempotency_claim_outcome from public;
grant usage on type agent.idempotency_claim_outcome to service_role;

revoke all on function
  agent.idempotency_policy(text),
  agent.idempotency_decide(uuid, text, text, text, uuid, bigint, bigint, boolean, boolean),
  agent.idempotency_claim(uuid, text, text, text, uuid, bigint),
  agent.idempotency_json_size(jsonb)
from public, anon, authenticated;
grant execute on function
  agent.idempotency_policy(text),
  agent.idempotency_decide(uuid, text, text, text, uuid, bigint, bigint, boolean, boolean),
  agent.idempotency_claim(uuid, text, text, text, uuid, bigint),
  agent.idempotency_json_size(jsonb)
to service_role;
