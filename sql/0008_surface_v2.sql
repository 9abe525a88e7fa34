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
-- The v1 functions keep their arguments and answers. Each decision is
-- written once, in a helper the v1 and v2 functions share: the policy
-- (idempotency_terms), claiming a free key (idempotency_insert), taking over
-- a passed lease (idempotency_take_over), stamping a lease
-- (idempotency_restamp), and what a claim answer shows (idempotency_claim_of,
-- idempotency_outcome_of).
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
-- prefix it extends (tool.crm.* before tool.*). No row when none applies.
create function agent.idempotency_policy(p_scope text)
returns setof agent.idempotency_scopes
language sql stable security invoker set search_path = ''
as $$
  select s.*
    from agent.idempotency_scopes s
   where s.scope = p_scope
      or (s.scope like '%.*'
          and char_length(p_scope) > char_length(s.scope) - 1
          and left(p_scope, char_length(s.scope) - 1) = left(s.scope, -1))
   order by s.scope = p_scope desc, char_length(s.scope) desc
   limit 1;
$$;

-- The terms of a claim: its lease, and its retention, which is the scope's
-- policy, lengthened by p_retain_ms when given and never under the lease.
-- Bad durations raise 22023; a scope with no policy raises IDEM1.
create function agent.idempotency_terms(p_scope text, p_lease_ms bigint, p_retain_ms bigint,
                                        out lease interval, out retain interval)
language plpgsql stable security invoker set search_path = ''
as $$
declare
  v_policy interval;
begin
  if p_lease_ms is null or p_lease_ms < 1000 or p_lease_ms > 86400000 then
    raise exception 'p_lease_ms must be between 1000 (one second) and 86400000 (one day), got %', p_lease_ms
      using errcode = '22023';
  end if;
  if p_retain_ms is not null and (p_retain_ms <= 0 or p_retain_ms > 31622400000) then
    raise exception 'p_retain_ms must be between 1 and 31622400000 (366 days), got %', p_retain_ms
      using errcode = '22023';
  end if;
  select p.retain into v_policy from agent.idempotency_policy(p_scope) p;
  if v_policy is null then
    raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', p_scope
      using errcode = 'IDEM1',
            hint = 'add the scope (or its family, e.g. tool.*) to agent.idempotency_scopes with its retention';
  end if;
  lease := p_lease_ms * interval '1 millisecond';
  retain := greatest(v_policy, coalesce(p_retain_ms, 0) * interval '1 millisecond', lease);
end
$$;

-- Data shape ----------------------------------------------------------------

-- How many times the claim was taken over from a worker whose lease passed;
-- lets a repeated call tell its own reclaim from a first claim.
alter table agent.idempotency_keys add column reclaims integer not null default 0;
alter table agent.idempotency_keys set (fillfactor = 80);

-- Retention now counts from the end of the lease.
create or replace function agent.idempotency_restamp(p_id uuid, p_lease interval, p_retain interval)
returns agent.idempotency_keys
language sql volatile security invoker set search_path = ''
as $$
  update agent.idempotency_keys as k
     set claimed_at = c.at,
         lease_expires_at = c.at + p_lease,
         retain_until = greatest(k.retain_until, c.at + p_lease + p_retain)
    from (select pg_catalog.clock_timestamp() as at) c
   where k.id = p_id
  returning k.*;
$$;

-- Claims a free key: the new row, or NULL when the key is taken. The lease
-- starts when the row is won (a wait on a concurrent insert of the same key
-- is not taken out of it).
create function agent.idempotency_insert(p_organization_id uuid, p_scope text, p_key text, p_request_hash text,
                                         p_lease_token uuid, p_lease interval, p_retain interval)
returns agent.idempotency_keys
language plpgsql volatile security invoker set search_path = ''
as $$
declare
  r agent.idempotency_keys;
  v_at timestamptz := pg_catalog.clock_timestamp();
begin
  insert into agent.idempotency_keys as k
    (organization_id, scope, key, request_hash, status, lease_token,
     claimed_at, lease_expires_at, retain_until)
  values
    (p_organization_id, p_scope, p_key, p_request_hash, 'processing', p_lease_token,
     v_at, v_at + p_lease, v_at + p_lease + p_retain)
  on conflict (organization_id, scope, key) do nothing
  returning k.* into r;
  if found and pg_catalog.clock_timestamp() - v_at > interval '10 milliseconds' then
    r := agent.idempotency_restamp(r.id, p_lease, p_retain);
  end if;
  return r;
end
$$;

-- Takes over a claim whose worker is gone: processing, lease passed, same
-- hash. One UPDATE decides, so of any number of concurrent callers exactly
-- one wins; the others wait for its row lock, re-check the row it wrote,
-- find a live lease and match nothing. NULL when nothing was taken over.
create function agent.idempotency_take_over(p_organization_id uuid, p_scope text, p_key text, p_request_hash text,
                                            p_lease_token uuid, p_lease interval, p_retain interval)
returns agent.idempotency_keys
language plpgsql volatile security invoker set search_path = ''
as $$
declare
  r agent.idempotency_keys;
  v_at timestamptz := pg_catalog.clock_timestamp();
begin
  update agent.idempotency_keys as k
     set lease_token = p_lease_token,
         claimed_at = v_at,
         lease_expires_at = v_at + p_lease,
         retain_until = greatest(k.retain_until, v_at + p_lease + p_retain),
         reclaims = k.reclaims + 1
   where k.organization_id = p_organization_id
     and k.scope = p_scope
     and k.key = p_key
     and k.request_hash = p_request_hash
     and k.status = 'processing'
     and k.lease_expires_at <= pg_catalog.clock_timestamp()
  returning k.* into r;
  if found and pg_catalog.clock_timestamp() - v_at > interval '10 milliseconds' then
    r := agent.idempotency_restamp(r.id, p_lease, p_retain);
  end if;
  return r;
end
$$;

-- The caller's own live claim: what a repeat with the same token finds
-- after its answer was lost. NULL when the token holds no live claim.
create function agent.idempotency_own(p_organization_id uuid, p_scope text, p_key text, p_request_hash text,
                                      p_lease_token uuid)
returns setof agent.idempotency_keys
language sql stable security invoker set search_path = ''
as $$
  select k.*
    from agent.idempotency_keys k
   where k.organization_id = p_organization_id
     and k.scope = p_scope
     and k.key = p_key
     and k.lease_token = p_lease_token
     and k.request_hash = p_request_hash
     and k.status = 'processing'
     and k.lease_expires_at > pg_catalog.clock_timestamp();
$$;

-- v1, on the shared helpers ---------------------------------------------------

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
  t record;
  r agent.idempotency_keys;
begin
  if p_lease_token is null then
    raise exception 'p_lease_token is required' using errcode = '22023';
  end if;
  t := agent.idempotency_terms(p_scope, p_lease_ms, p_retain_ms);
  r := agent.idempotency_insert(p_organization_id, p_scope, p_key, p_request_hash, p_lease_token, t.lease, t.retain);
  if r.id is null then
    select o.* into r from agent.idempotency_own(p_organization_id, p_scope, p_key, p_request_hash, p_lease_token) o;
  end if;
  if r.id is not null then
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
  t record;
  r agent.idempotency_keys;
begin
  if p_lease_token is null then
    raise exception 'p_lease_token is required' using errcode = '22023';
  end if;
  t := agent.idempotency_terms(p_scope, p_lease_ms, p_retain_ms);
  r := agent.idempotency_take_over(p_organization_id, p_scope, p_key, p_request_hash, p_lease_token, t.lease,
                                   t.retain);
  if r.id is null then
    select o.* into r from agent.idempotency_own(p_organization_id, p_scope, p_key, p_request_hash, p_lease_token) o;
  end if;
  if r.id is not null then
    return next agent.idempotency_claim_of(r);
  end if;
end
$$;

-- Completes a claim the caller still holds; see 0002 for the rules. The
-- answer is remembered for the claim's retention from the later of its
-- lease's end and the completion, and a response above its scope's
-- max_response_bytes (as compact JSON) is refused with IDEM2.
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
      select p.max_response_bytes into v_limit from agent.idempotency_policy(r.scope) p;
      if v_limit is null then
        raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', r.scope
          using errcode = 'IDEM1';
      end if;
      v_size := agent.idempotency_json_size(v_response, v_limit);
      if v_size > v_limit then
        raise exception 'the response is % bytes as compact JSON, above the % bytes scope % keeps',
                        v_size, v_limit, r.scope
          using errcode = 'IDEM2',
                hint = 'store the response elsewhere and complete with its resource (and a reference to it)';
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

-- The size of p_value as compact JSON, in bytes, as far as it matters
-- against p_limit: PostgreSQL's text form of a jsonb is the compact form
-- plus one space after every ',' and ':' between tokens, so a text no
-- longer than p_limit fits, and only a longer one is measured exactly (its
-- separators counted outside string literals).
create function agent.idempotency_json_size(p_value jsonb, p_limit bigint)
returns bigint
language plpgsql immutable security invoker set search_path = ''
as $$
declare
  v_text text := p_value::text;
  v_bare text;
begin
  if octet_length(v_text) <= p_limit then
    return octet_length(v_text);
  end if;
  v_bare := pg_catalog.regexp_replace(v_text, '"(?:[^"\\]|\\.)*"', '', 'g');
  return octet_length(v_text)
         - (octet_length(v_bare) - octet_length(pg_catalog.replace(v_bare, ', ', ','))
            + octet_length(v_bare) - octet_length(pg_catalog.replace(v_bare, ': ', ':')));
end
$$;

-- v2: one call decides ----------------------------------------------------------

-- What the one-call claim answers: the outcome, and the claim as the caller
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

-- A row as the one-call claim answers it under p_outcome. Only claimed and
-- reclaimed show the lease token (the caller's own secret); processing and
-- conflict show neither the answer nor the resource, and conflict not the
-- stored request hash either.
create function agent.idempotency_outcome_of(p_outcome text, k agent.idempotency_keys)
returns agent.idempotency_claim_outcome
language sql volatile security invoker set search_path = ''
as $$
  select p_outcome, c.id, c.organization_id, c.scope, c.key,
         case when p_outcome = 'conflict' then null else c.request_hash end,
         c.status,
         case when p_outcome in ('claimed', 'reclaimed') then c.lease_token end,
         case when p_outcome = 'completed' then c.resource_type end,
         case when p_outcome = 'completed' then c.resource_id end,
         case when p_outcome = 'completed' then c.response end,
         c.claimed_at, c.lease_expires_at, c.retain_until, c.lease_live
    from agent.idempotency_claim_of(k) c;
$$;

-- Claims a key, or answers why not, in one call and one transaction,
-- following the spec's diagram: insert; or load the row; a different hash
-- is a conflict whatever the lease says; completed replays; a live lease is
-- processing; a passed lease is taken over (exactly one of any number of
-- concurrent callers wins). A repeat with the same token after a lost
-- answer answers that caller's own row again. Always exactly one row.
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
declare
  t record;
  r agent.idempotency_keys;
begin
  if p_organization_id is null or p_lease_token is null then
    raise exception 'p_organization_id and p_lease_token are required' using errcode = '22023';
  end if;
  if p_request_hash is null or p_request_hash !~ '^[0-9a-f]{64}$' then
    raise exception 'p_request_hash must be a lowercase hex SHA-256' using errcode = '22023';
  end if;
  t := agent.idempotency_terms(p_scope, p_lease_ms, null);
  -- Each pass either decides or sees the row change under it (released,
  -- taken over by someone else); a key that keeps changing hands gives up
  -- with a retryable serialization failure.
  for pass in 1..4 loop
    r := agent.idempotency_insert(p_organization_id, p_scope, p_key, p_request_hash, p_lease_token, t.lease,
                                  t.retain);
    if r.id is not null then
      return next agent.idempotency_outcome_of('claimed', r);
      return;
    end if;
    select k.* into r
      from agent.idempotency_keys k
     where k.organization_id = p_organization_id and k.scope = p_scope and k.key = p_key;
    continue when not found;  -- released since our insert: insert again
    if r.request_hash <> p_request_hash then
      return next agent.idempotency_outcome_of('conflict', r);
      return;
    end if;
    if r.status = 'completed' then
      return next agent.idempotency_outcome_of('completed', r);
      return;
    end if;
    if r.lease_expires_at > pg_catalog.clock_timestamp() then
      if r.lease_token = p_lease_token then
        -- Our own claim, whose answer was lost on the way back.
        return next agent.idempotency_outcome_of(case when r.reclaims > 0 then 'reclaimed' else 'claimed' end, r);
      else
        return next agent.idempotency_outcome_of('processing', r);
      end if;
      return;
    end if;
    r := agent.idempotency_take_over(p_organization_id, p_scope, p_key, p_request_hash, p_lease_token, t.lease,
                                     t.retain);
    if r.id is not null then
      return next agent.idempotency_outcome_of('reclaimed', r);
      return;
    end if;
  end loop;
  raise exception 'the key %/% kept changing hands; try again', p_scope, p_key using errcode = '40001';
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
  if not exists (select 1 from agent.idempotency_policy(p_scope)) then
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

-- The old durations helper is replaced by idempotency_terms.
drop function agent.idempotency_durations(bigint, bigint);

-- Privileges ------------------------------------------------------------------

revoke all on agent.idempotency_scopes from public, anon, authenticated;
grant select on agent.idempotency_scopes to service_role;

revoke all on type agent.idempotency_claim_outcome from public;
grant usage on type agent.idempotency_claim_outcome to service_role;

revoke all on function
  agent.idempotency_policy(text),
  agent.idempotency_terms(text, bigint, bigint),
  agent.idempotency_insert(uuid, text, text, text, uuid, interval, interval),
  agent.idempotency_take_over(uuid, text, text, text, uuid, interval, interval),
  agent.idempotency_own(uuid, text, text, text, uuid),
  agent.idempotency_json_size(jsonb, bigint),
  agent.idempotency_outcome_of(text, agent.idempotency_keys),
  agent.idempotency_claim(uuid, text, text, text, uuid, bigint)
from public, anon, authenticated;
grant execute on function
  agent.idempotency_policy(text),
  agent.idempotency_terms(text, bigint, bigint),
  agent.idempotency_insert(uuid, text, text, text, uuid, interval, interval),
  agent.idempotency_take_over(uuid, text, text, text, uuid, interval, interval),
  agent.idempotency_own(uuid, text, text, text, uuid),
  agent.idempotency_json_size(jsonb, bigint),
  agent.idempotency_outcome_of(text, agent.idempotency_keys),
  agent.idempotency_claim(uuid, text, text, text, uuid, bigint)
to service_role;
