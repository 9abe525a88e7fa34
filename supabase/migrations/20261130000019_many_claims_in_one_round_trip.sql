-- Many claims in one round trip.
--
-- A worker that drains a queue holds a batch of messages, not one request.
-- Claiming them one by one costs a round trip each; these functions make
-- the same decisions for a whole batch in one call and one transaction:
--
-- 1. agent.idempotency_claim_many(p_organization_id, p_scope, p_lease_ms,
--    p_items, p_row_cap) claims every item of p_items, a JSON array of
--    {"key", "request_hash", "lease_token", "request"} ("request", the work
--    the claim carries, may be absent), all of one organization and scope,
--    all with one lease length. It answers one row per item, in input
--    order, numbered by item (0-based): exactly what that item's
--    agent.idempotency_claim would answer, made one after another in input
--    order. So a key repeated in a batch is decided once: its first
--    occurrence claims it (or replays it, or finds it processing), and each
--    later occurrence finds it as the first left it: processing, held by
--    the first, or completed, or a conflict for another request hash. No
--    two items of a batch ever hold one claim. Each item carries a lease
--    token of its own (a fresh random value, as for a single claim); a
--    token named by two items is refused, since a single claim repeated
--    with its token answers "claimed" again.
-- 2. agent.idempotency_complete_many(p_organization_id, p_items, p_row_cap)
--    completes every item of p_items, a JSON array of {"claim_id",
--    "lease_token", "resource_type", "resource_id", "response"}, each
--    fenced by its own token, as agent.idempotency_complete does: one row
--    per item, in input order, completed true with the claim's row, or
--    completed false (and no row) where the fence moved on.
-- 3. agent.idempotency_release_many(p_organization_id, p_items, p_row_cap)
--    releases every item of p_items, a JSON array of {"claim_id",
--    "lease_token"}, as agent.idempotency_release does: one row per item, in
--    input order, released true or false.
--
-- A batch is bounded by the row cap the caller is held to (p_row_cap,
-- default 1000: PostgREST db-max-rows, Supabase api.max_rows), since it
-- answers a row per item: a batch of more items, or of none, is refused
-- (22023). Every item is checked before anything is written: a NULL or
-- malformed item anywhere refuses the whole batch, naming the item's index
-- (p_items[3].key). A refusal the single function raises for an item (an
-- unknown scope, a request or response above the scope's limit, a key that
-- kept changing hands) refuses the whole batch too, with its own SQLSTATE
-- and the item named; the batch is one transaction, so nothing of it is
-- written. A caller that wants the other items' endings whatever one of
-- them does sends that item alone.
--
-- The first claims of free keys that carry no work, the common case of a
-- queue's batch, are inserted in one statement; every other item is
-- decided by agent.idempotency_decide, one after another, with the same
-- answers.
--
-- Claims and completions are safe to send again after a lost answer: each
-- item answers its caller's own claim to a repeat with the same token, as
-- the single functions do. A release is not (a repeat of a release that
-- happened answers false).
--
-- Everything follows 0011: owned by idempotency_owner, SECURITY DEFINER
-- with search_path '', every name qualified, executable by service_role.

-- 1. Answers ------------------------------------------------------------------------------

create type agent.idempotency_claim_item as (
  item             integer,
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

create type agent.idempotency_completion_item as (
  item             integer,
  completed        boolean,
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

create type agent.idempotency_release_item as (
  item     integer,
  released boolean
);

-- 2. The batch's own checks ------------------------------------------------------------

-- Refuses p_items unless it is a JSON array of 1 to p_row_cap objects, and
-- p_row_cap unless it is a row cap (1 to 100000).
create function agent.idempotency_check_batch(p_items jsonb, p_row_cap integer)
returns void
language plpgsql immutable security invoker set search_path = ''
as $$
declare
  v_count integer;
begin
  if p_row_cap is null or p_row_cap not between 1 and 100000 then
    raise exception 'p_row_cap must be between 1 and 100000, got %', p_row_cap
      using errcode = '22023',
            hint = 'the row cap the caller is held to: PostgREST db-max-rows, Supabase api.max_rows (default 1000)';
  end if;
  if p_items is null then
    raise exception 'p_items is required' using errcode = '22023';
  end if;
  if jsonb_typeof(p_items) <> 'array' then
    raise exception 'p_items must be a JSON array of items, got a JSON %', jsonb_typeof(p_items)
      using errcode = '22023';
  end if;
  v_count := jsonb_array_length(p_items);
  if v_count not between 1 and p_row_cap then
    raise exception 'p_items must hold between 1 and the row cap p_row_cap % items, got %', p_row_cap, v_count
      using errcode = '22023',
            hint = 'a batch answers a row per item; more than the row cap would be cut from the answer';
  end if;
end
$$;

-- The text of p_items[p_index].p_field: a JSON string, or NULL where absent
-- or JSON null when not p_required. Anything else is refused by name.
create function agent.idempotency_item_text(p_item jsonb, p_index integer, p_field text, p_required boolean)
returns text
language plpgsql immutable security invoker set search_path = ''
as $$
declare
  v_kind text := jsonb_typeof(p_item -> p_field);
begin
  if v_kind is null or v_kind = 'null' then
    if p_required then
      raise exception 'p_items[%].% is required', p_index, p_field using errcode = '22023';
    end if;
    return null;
  end if;
  if v_kind <> 'string' then
    raise exception 'p_items[%].% must be a JSON string, got a JSON %', p_index, p_field, v_kind
      using errcode = '22023';
  end if;
  return p_item ->> p_field;
end
$$;

-- p_items[p_index].p_field as a UUID: required, in its canonical text form.
create function agent.idempotency_item_uuid(p_item jsonb, p_index integer, p_field text)
returns uuid
language plpgsql immutable security invoker set search_path = ''
as $$
declare
  v_text text := agent.idempotency_item_text(p_item, p_index, p_field, true);
begin
  if v_text !~ '^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$' then
    raise exception 'p_items[%].% must be a UUID, got %', p_index, p_field, pg_catalog.left(v_text, 80)
      using errcode = '22023';
  end if;
  return v_text::uuid;
end
$$;

-- Refuses p_items[p_index] unless it is a JSON object.
create function agent.idempotency_check_item(p_item jsonb, p_index integer)
returns void
language plpgsql immutable security invoker set search_path = ''
as $$
begin
  if p_item is null or jsonb_typeof(p_item) <> 'object' then
    raise exception 'p_items[%] must be a JSON object, got a JSON %', p_index, coalesce(jsonb_typeof(p_item), 'null')
      using errcode = '22023';
  end if;
end
$$;

-- 3. Claims -------------------------------------------------------------------------------

create function agent.idempotency_claim_many(
  p_organization_id uuid,
  p_scope text,
  p_lease_ms bigint,
  p_items jsonb,
  p_row_cap integer default 1000
) returns setof agent.idempotency_claim_item
language plpgsql volatile security definer
set search_path = '' set lock_timeout = '5s'
as $$
declare
  v_keys text[] := '{}'::text[];
  v_hashes text[] := '{}'::text[];
  v_tokens uuid[] := '{}'::uuid[];
  v_requests jsonb[] := '{}'::jsonb[];
  v_item jsonb;
  v_index integer;
  v_hash text;
  v_earlier integer;
  v_state text;
  v_message text;
  v_hint text;
  v_retain interval;
  v_lease interval := p_lease_ms * interval '1 millisecond';
  v_at timestamptz;
  v_won agent.idempotency_keys[];
  v_won_items integer[];
  v_places integer[];
  k agent.idempotency_keys;
  r agent.idempotency_claim_outcome;
begin
  if p_organization_id is null then
    raise exception 'p_organization_id is required' using errcode = '22023';
  end if;
  if p_scope is null then
    raise exception 'p_scope is required' using errcode = '22023';
  end if;
  if char_length(p_scope) not between 1 and 128 or p_scope ~ '[^a-z0-9._-]' then
    raise exception 'p_scope must be 1 to 128 characters of a-z, 0-9, ".", "_" and "-", got %',
                    pg_catalog.left(p_scope, 128)
      using errcode = '22023';
  end if;
  if p_lease_ms is null or p_lease_ms not between 1000 and 86400000 then
    raise exception 'p_lease_ms must be between 1000 (one second) and 86400000 (one day), got %', p_lease_ms
      using errcode = '22023';
  end if;
  perform agent.idempotency_check_batch(p_items, p_row_cap);
  select p.retain into v_retain from agent.idempotency_policy(p_scope) p;
  if v_retain is null then
    raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', p_scope
      using errcode = 'IDEM1',
            hint = 'add the scope (or its family, e.g. tool.*) to agent.idempotency_scopes in a migration';
  end if;

  -- Every item is checked before anything is written, in one pass over
  -- the array; the first bad item, if any, is checked again on its own to
  -- say what is wrong with it.
  select (e.ordinality - 1)::integer, e.value into v_index, v_item
    from pg_catalog.jsonb_array_elements(p_items) with ordinality e
   where not coalesce(pg_catalog.jsonb_typeof(e.value) = 'object'
                      and pg_catalog.jsonb_typeof(e.value -> 'key') = 'string'
                      and char_length(e.value ->> 'key') between 1 and 512
                      and pg_catalog.jsonb_typeof(e.value -> 'request_hash') = 'string'
                      and (e.value ->> 'request_hash') ~ '^[0-9a-f]{64}$'
                      and pg_catalog.jsonb_typeof(e.value -> 'lease_token') = 'string'
                      and (e.value ->> 'lease_token')
                          ~ '^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$',
                      false)
   order by e.ordinality
   limit 1;
  if found then
    perform agent.idempotency_check_item(v_item, v_index);
    v_hash := agent.idempotency_item_text(v_item, v_index, 'key', true);
    if char_length(v_hash) not between 1 and 512 then
      raise exception 'p_items[%].key must be 1 to 512 characters, got %', v_index, char_length(v_hash)
        using errcode = '22023';
    end if;
    v_hash := agent.idempotency_item_text(v_item, v_index, 'request_hash', true);
    if octet_length(v_hash) <> 64 or v_hash ~ '[^0-9a-f]' then
      raise exception 'p_items[%].request_hash must be 64 lowercase hex digits (a SHA-256), got %',
                      v_index, pg_catalog.left(v_hash, 80)
        using errcode = '22023';
    end if;
    perform agent.idempotency_item_uuid(v_item, v_index, 'lease_token');
    raise exception 'p_items[%] is malformed', v_index using errcode = '22023';
  end if;
  select pg_catalog.array_agg(e.value ->> 'key' order by e.ordinality),
         pg_catalog.array_agg(e.value ->> 'request_hash' order by e.ordinality),
         pg_catalog.array_agg((e.value ->> 'lease_token')::uuid order by e.ordinality),
         pg_catalog.array_agg(e.value -> 'request' order by e.ordinality)
    into v_keys, v_hashes, v_tokens, v_requests
    from pg_catalog.jsonb_array_elements(p_items) with ordinality e;
  -- The first item whose token an earlier item named, and that item.
  select t.first - 1, t.i - 1 into v_earlier, v_index
    from (select i, pg_catalog.min(i) over (partition by v_tokens[i]) as first
            from pg_catalog.generate_subscripts(v_tokens, 1) i) t
   where t.i > t.first
   order by t.i
   limit 1;
  if v_earlier is not null then
    raise exception 'p_items[%].lease_token repeats p_items[%].lease_token: each item needs a token of its own',
                    v_index, v_earlier
      using errcode = '22023',
            hint = 'a claim repeated with its token answers claimed again; mint a fresh token per item';
  end if;

  -- The first claims of free keys, the common case, in one statement: each
  -- item that carries no work and is its key's first occurrence in the
  -- batch, inserted as agent.idempotency_decide's first claim inserts it
  -- (the scope's retention, at least the lease). A key already there, or
  -- inserted by another transaction meanwhile, is left to the decision
  -- below, as is every item that carries work (its size is checked there)
  -- and every later occurrence of a key. Keys are inserted in key order,
  -- so that batches over the same keys wait for each other in one order
  -- and never deadlock.
  v_at := pg_catalog.clock_timestamp();
  with items as (
    select i, v_keys[i] as key, v_hashes[i] as hash, v_tokens[i] as token, v_requests[i] as request,
           pg_catalog.row_number() over (partition by v_keys[i] order by i) as occurrence
      from pg_catalog.generate_subscripts(v_keys, 1) i
  ), inserted as (
    insert into agent.idempotency_keys as x
      (organization_id, scope, key, request_hash, status, lease_token, claimed_at, lease_expires_at, retain_until)
    select p_organization_id, p_scope, items.key, items.hash, 'processing', items.token,
           v_at, v_at + v_lease, v_at + v_lease + greatest(v_retain, v_lease)
      from items
     where items.occurrence = 1 and nullif(items.request, 'null'::jsonb) is null
     order by items.key
    on conflict (organization_id, scope, key) do nothing
    returning x.*
  )
  select pg_catalog.array_agg(row(inserted.*)::agent.idempotency_keys order by items.i),
         pg_catalog.array_agg(items.i order by items.i)
    into v_won, v_won_items
    from inserted join items on items.token = inserted.lease_token;
  -- A win that waited (on another transaction's insert of a key that then
  -- rolled back): its lease starts now, as agent.idempotency_decide's does.
  if pg_catalog.clock_timestamp() - v_at > interval '10 milliseconds' and v_won is not null then
    v_at := pg_catalog.clock_timestamp();
    with won as (
      select (v_won[n]).id as id, n from pg_catalog.generate_subscripts(v_won, 1) n
    ), moved as (
      update agent.idempotency_keys as x
         set claimed_at = v_at,
             lease_expires_at = v_at + v_lease,
             retain_until = greatest(x.retain_until, v_at + v_lease + greatest(v_retain, v_lease))
        from won
       where x.organization_id = p_organization_id and x.id = won.id
      returning x, won.n
    )
    select pg_catalog.array_agg(moved.x order by moved.n) into v_won from moved;
  end if;
  -- Each item's place in v_won, or 0.
  v_places := pg_catalog.array_fill(0, array[pg_catalog.cardinality(v_keys)]);
  for j in 1 .. coalesce(pg_catalog.cardinality(v_won_items), 0) loop
    v_places[v_won_items[j]] := j;
  end loop;

  begin
    for i in 1 .. pg_catalog.cardinality(v_keys) loop
      v_index := i - 1;
      if v_places[i] > 0 then
        k := v_won[v_places[i]];
        return next (v_index, 'claimed', k.id, k.organization_id, k.scope, k.key, k.request_hash, k.status,
                     k.lease_token, null, null, null, k.claimed_at, k.lease_expires_at, k.retain_until,
                     k.lease_expires_at > pg_catalog.clock_timestamp())::agent.idempotency_claim_item;
        continue;
      end if;
      select * into r
        from agent.idempotency_decide(p_organization_id, p_scope, v_keys[i], v_hashes[i], v_tokens[i],
                                      p_lease_ms, null, true, true, v_requests[i]);
      return next (v_index, r.outcome, r.id, r.organization_id, r.scope, r.key, r.request_hash, r.status,
                   r.lease_token, r.resource_type, r.resource_id, r.response, r.claimed_at,
                   r.lease_expires_at, r.retain_until, r.lease_live)::agent.idempotency_claim_item;
    end loop;
  exception when others then
    get stacked diagnostics v_state = returned_sqlstate, v_message = message_text, v_hint = pg_exception_hint;
    raise exception 'p_items[%]: %', v_index, v_message using errcode = v_state, hint = v_hint;
  end;
end
$$;

-- 4. Completions ------------------------------------------------------------------------

create function agent.idempotency_complete_many(
  p_organization_id uuid,
  p_items jsonb,
  p_row_cap integer default 1000
) returns setof agent.idempotency_completion_item
language plpgsql volatile security definer
set search_path = '' set lock_timeout = '5s'
as $$
declare
  v_ids uuid[] := '{}'::uuid[];
  v_tokens uuid[] := '{}'::uuid[];
  v_types text[] := '{}'::text[];
  v_resources text[] := '{}'::text[];
  v_responses jsonb[] := '{}'::jsonb[];
  v_item jsonb;
  v_index integer;
  v_type text;
  v_resource text;
  v_response jsonb;
  v_state text;
  v_message text;
  v_hint text;
  r agent.idempotency_claim;
begin
  if p_organization_id is null then
    raise exception 'p_organization_id is required' using errcode = '22023';
  end if;
  perform agent.idempotency_check_batch(p_items, p_row_cap);

  for v_item, v_index in select e.value, (e.ordinality - 1)::integer
                           from jsonb_array_elements(p_items) with ordinality e loop
    perform agent.idempotency_check_item(v_item, v_index);
    v_ids := pg_catalog.array_append(v_ids, agent.idempotency_item_uuid(v_item, v_index, 'claim_id'));
    v_tokens := pg_catalog.array_append(v_tokens, agent.idempotency_item_uuid(v_item, v_index, 'lease_token'));
    v_type := nullif(agent.idempotency_item_text(v_item, v_index, 'resource_type', false), '');
    v_resource := nullif(agent.idempotency_item_text(v_item, v_index, 'resource_id', false), '');
    v_response := nullif(v_item -> 'response', 'null'::jsonb);
    if v_response is null and v_resource is null then
      raise exception 'p_items[%] carries neither a response nor a resource; a completion carries one', v_index
        using errcode = '22023';
    end if;
    if v_resource is not null and v_type is null then
      raise exception 'p_items[%].resource_id needs resource_type, so a reader can tell what it names', v_index
        using errcode = '22023';
    end if;
    if char_length(v_type) > 128 or char_length(v_resource) > 512 then
      raise exception 'p_items[%]: resource_type may have at most 128 characters and resource_id at most 512', v_index
        using errcode = '22023';
    end if;
    v_types := pg_catalog.array_append(v_types, v_type);
    v_resources := pg_catalog.array_append(v_resources, v_resource);
    v_responses := pg_catalog.array_append(v_responses, v_response);
  end loop;

  begin
    for i in 1 .. pg_catalog.cardinality(v_ids) loop
      v_index := i - 1;
      select * into r
        from agent.idempotency_complete(v_ids[i], v_tokens[i], v_types[i], v_resources[i], v_responses[i],
                                        p_organization_id);
      if found then
        return next (v_index, true, r.id, r.organization_id, r.scope, r.key, r.request_hash, r.status,
                     r.lease_token, r.resource_type, r.resource_id, r.response, r.claimed_at,
                     r.lease_expires_at, r.retain_until, r.lease_live)::agent.idempotency_completion_item;
      else
        return next (v_index, false, null, null, null, null, null, null, null, null, null, null, null, null,
                     null, null)::agent.idempotency_completion_item;
      end if;
    end loop;
  exception when others then
    get stacked diagnostics v_state = returned_sqlstate, v_message = message_text, v_hint = pg_exception_hint;
    raise exception 'p_items[%]: %', v_index, v_message using errcode = v_state, hint = v_hint;
  end;
end
$$;

-- 5. Releases ---------------------------------------------------------------------------

create function agent.idempotency_release_many(
  p_organization_id uuid,
  p_items jsonb,
  p_row_cap integer default 1000
) returns setof agent.idempotency_release_item
language plpgsql volatile security definer
set search_path = '' set lock_timeout = '5s'
as $$
declare
  v_ids uuid[] := '{}'::uuid[];
  v_tokens uuid[] := '{}'::uuid[];
  v_item jsonb;
  v_index integer;
begin
  if p_organization_id is null then
    raise exception 'p_organization_id is required' using errcode = '22023';
  end if;
  perform agent.idempotency_check_batch(p_items, p_row_cap);

  for v_item, v_index in select e.value, (e.ordinality - 1)::integer
                           from jsonb_array_elements(p_items) with ordinality e loop
    perform agent.idempotency_check_item(v_item, v_index);
    v_ids := pg_catalog.array_append(v_ids, agent.idempotency_item_uuid(v_item, v_index, 'claim_id'));
    v_tokens := pg_catalog.array_append(v_tokens, agent.idempotency_item_uuid(v_item, v_index, 'lease_token'));
  end loop;

  for i in 1 .. pg_catalog.cardinality(v_ids) loop
    return next (i - 1, agent.idempotency_release(v_ids[i], v_tokens[i], p_organization_id))
      ::agent.idempotency_release_item;
  end loop;
end
$$;

-- 6. Owners and execution ------------------------------------------------------------------

alter type agent.idempotency_claim_item owner to idempotency_owner;
alter type agent.idempotency_completion_item owner to idempotency_owner;
alter type agent.idempotency_release_item owner to idempotency_owner;
revoke all on type agent.idempotency_claim_item, agent.idempotency_completion_item,
                   agent.idempotency_release_item from public;
grant usage on type agent.idempotency_claim_item, agent.idempotency_completion_item,
                    agent.idempotency_release_item to service_role;

alter function agent.idempotency_check_batch(jsonb, integer) owner to idempotency_owner;
alter function agent.idempotency_item_text(jsonb, integer, text, boolean) owner to idempotency_owner;
alter function agent.idempotency_item_uuid(jsonb, integer, text) owner to idempotency_owner;
alter function agent.idempotency_check_item(jsonb, integer) owner to idempotency_owner;
alter function agent.idempotency_claim_many(uuid, text, bigint, jsonb, integer) owner to idempotency_owner;
alter function agent.idempotency_complete_many(uuid, jsonb, integer) owner to idempotency_owner;
alter function agent.idempotency_release_many(uuid, jsonb, integer) owner to idempotency_owner;

revoke all on function
  agent.idempotency_check_batch(jsonb, integer),
  agent.idempotency_item_text(jsonb, integer, text, boolean),
  agent.idempotency_item_uuid(jsonb, integer, text),
  agent.idempotency_check_item(jsonb, integer)
from public, anon, authenticated, service_role;
revoke all on function
  agent.idempotency_claim_many(uuid, text, bigint, jsonb, integer),
  agent.idempotency_complete_many(uuid, jsonb, integer),
  agent.idempotency_release_many(uuid, jsonb, integer)
from public, anon, authenticated;
grant execute on function
  agent.idempotency_claim_many(uuid, text, bigint, jsonb, integer),
  agent.idempotency_complete_many(uuid, jsonb, integer),
  agent.idempotency_release_many(uuid, jsonb, integer)
to service_role;
