-- One holder in every batch: each key decided once, in key order.
--
-- agent.idempotency_claim_many decided a batch in two passes: a bulk
-- insert of free keys in key order, then agent.idempotency_decide for every
-- other item in input order. That broke the plane's first promise twice:
--
-- - A key's later occurrence was decided again, with its own token. When
--   the batch waited on another transaction's row for longer than the
--   lease, the later occurrence found its own batch's claim past its lease
--   and took it over: two items of one batch held one key, both answered
--   lease_live.
-- - Two batches over the same keys could wait for each other in a cycle
--   (40P01): the second pass went in input order, and took over or
--   inserted rows after the first pass had locked others.
--
-- Now each key is decided once, by its first occurrence, in one INSERT ...
-- ON CONFLICT DO UPDATE that visits the keys in key order: a free key is
-- inserted, a taken one is locked (ON CONFLICT DO UPDATE locks the row it
-- finds, whether or not it updates it) and taken over when its lease has
-- passed and the request is the same. Every item is then answered from
-- its key's row, which the batch holds: the first occurrence what it
-- decided, a later one what a single claim would answer it now (its
-- batch's claim is held, so: processing, completed or a conflict). The
-- leases won are timed from the end of the batch, and lease_live is read
-- when the answer is made. The work each first occurrence stores is
-- measured before anything is written, by agent.idempotency_check_work,
-- which agent.idempotency_decide now calls too.
--
-- The other batches lock in the same order: agent.idempotency_complete_many
-- and agent.idempotency_release_many lock their rows in (organization,
-- scope, key) order before writing any; agent.idempotency_delete_expired
-- skips rows another transaction holds (the next pass deletes them), so the
-- sweep never waits on a claim.

SET local check_function_bodies = off;

CREATE FUNCTION agent.idempotency_check_work(p_scope text, p_request jsonb) RETURNS void
    LANGUAGE plpgsql STABLE
    SET search_path TO ''
    AS $$
declare
  v_size bigint := octet_length(p_request::text);
  v_limit integer;
begin
  -- No text under the smallest limit a policy may set (1024) can be above
  -- one, or 64 levels deep under 130 bytes.
  if v_size >= 130
     and jsonb_path_exists(p_request, 'strict $.**{64} ? (@.type() == "array" || @.type() == "object")') then
    raise exception 'the request nests arrays and objects deeper than 64 levels, more than every client reads back'
      using errcode = 'IDEM6',
            hint = 'flatten the request, or store it as its JSON text ({"$json": "<text>"})';
  end if;
  if v_size > 1024 then
    select p.max_request_bytes into v_limit from agent.idempotency_policy(p_scope) p;
    if v_limit is null then
      raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', p_scope
        using errcode = 'IDEM1',
              hint = 'add the scope (or its family, e.g. tool.*) to agent.idempotency_scopes in a migration';
    end if;
    if v_size > v_limit then
      v_size := agent.idempotency_json_size(p_request);
      if v_size > v_limit then
        raise exception 'the request is % bytes as compact JSON, above the % bytes scope % keeps',
                        v_size, v_limit, p_scope
          using errcode = 'IDEM5',
                hint = 'store the work elsewhere and claim with a reference to it, '
                       'or raise max_request_bytes for the scope';
      end if;
    end if;
  end if;
end
$$;

ALTER FUNCTION agent.idempotency_check_work(p_scope text, p_request jsonb) OWNER TO idempotency_owner;
REVOKE ALL ON FUNCTION agent.idempotency_check_work(p_scope text, p_request jsonb) FROM PUBLIC;

CREATE OR REPLACE FUNCTION agent.idempotency_decide(p_organization_id uuid, p_scope text, p_key text, p_request_hash text, p_lease_token uuid, p_lease_ms bigint, p_retain_ms bigint, p_may_insert boolean, p_may_take_over boolean, p_request jsonb DEFAULT NULL::jsonb) RETURNS SETOF agent.idempotency_claim_outcome
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $_$
declare
  v_policy_retain interval;
  v_lease interval;
  v_retain interval;
  v_at timestamptz;
  v_won boolean := false;
  v_outcome text;
  v_request jsonb := nullif(p_request, 'null'::jsonb);
  r agent.idempotency_keys;
begin
  -- One test on the way in; the messages are built only for a refusal.
  if p_organization_id is null or p_scope is null
     or char_length(p_scope) not between 1 and 128 or p_scope ~ '[^a-z0-9._-]'
     or p_key is null or char_length(p_key) not between 1 and 512
     or p_request_hash is null or octet_length(p_request_hash) <> 64 or p_request_hash ~ '[^0-9a-f]'
     or p_lease_token is null
     or p_lease_ms is null or p_lease_ms not between 1000 and 86400000
     or p_retain_ms not between 1 and 31622400000
     or p_may_insert is null or p_may_take_over is null then
    perform agent.idempotency_check_key(p_organization_id, p_scope, p_key);
    if p_request_hash is null then
      raise exception 'p_request_hash is required' using errcode = '22023';
    elsif octet_length(p_request_hash) <> 64 or p_request_hash ~ '[^0-9a-f]' then
      raise exception 'p_request_hash must be 64 lowercase hex digits (a SHA-256), got %',
                      pg_catalog.left(p_request_hash, 80)
        using errcode = '22023';
    elsif p_lease_token is null then
      raise exception 'p_lease_token is required' using errcode = '22023';
    elsif p_lease_ms is null or p_lease_ms not between 1000 and 86400000 then
      raise exception 'p_lease_ms must be between 1000 (one second) and 86400000 (one day), got %', p_lease_ms
        using errcode = '22023';
    elsif p_retain_ms not between 1 and 31622400000 then
      raise exception 'p_retain_ms must be between 1 and 31622400000 (366 days), got %', p_retain_ms
        using errcode = '22023';
    else
      raise exception 'p_may_insert and p_may_take_over are required' using errcode = '22023';
    end if;
  end if;

  -- The work is measured before anything is locked, as a completion's
  -- answer is (see 0014).
  if v_request is not null then
    perform agent.idempotency_check_work(p_scope, v_request);
  end if;

  v_lease := p_lease_ms * interval '1 millisecond';
  -- What the caller asks for; the scope's policy is the floor of it.
  v_retain := greatest(coalesce(p_retain_ms, 0) * interval '1 millisecond', v_lease);

  -- Each pass decides, or sees the row change under it (released, taken
  -- over by someone else) and looks again; a key that keeps changing hands
  -- gives up with a serialization failure, which is safe to retry.
  for pass in 1..4 loop
    if p_may_insert then
      v_at := pg_catalog.clock_timestamp();
      -- The first claim, the hot path, reads its scope's policy in the
      -- same statement: no policy row, no insert.
      insert into agent.idempotency_keys as k
        (organization_id, scope, key, request_hash, status, lease_token,
         claimed_at, lease_expires_at, retain_until, request, redrive_at)
      select p_organization_id, p_scope, p_key, p_request_hash, 'processing', p_lease_token,
             v_at, v_at + v_lease, v_at + v_lease + greatest(s.retain, v_retain),
             v_request, case when v_request is not null then v_at + v_lease end
        from agent.idempotency_scopes s
       where s.scope = p_scope
          or (s.scope like '%.*'
              and char_length(p_scope) > char_length(s.scope) - 1
              and left(p_scope, char_length(s.scope) - 1) = left(s.scope, -1))
       order by s.scope = p_scope desc, char_length(s.scope) desc
       limit 1
      on conflict (organization_id, scope, key) do nothing
      returning k.* into r;
      if found then
        v_outcome := 'claimed';
        v_won := true;
        exit;
      end if;
    end if;
    if v_policy_retain is null then
      select p.retain into v_policy_retain from agent.idempotency_policy(p_scope) p;
      if v_policy_retain is null then
        raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', p_scope
          using errcode = 'IDEM1',
                hint = 'add the scope (or its family, e.g. tool.*) to agent.idempotency_scopes in a migration';
      end if;
      v_retain := greatest(v_retain, v_policy_retain);
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
           reclaims = k.reclaims + 1,
           request = coalesce(k.request, v_request),
           redrive_at = case when coalesce(k.request, v_request) is not null then v_at + v_lease end
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

  -- A win that waited: the lease starts now, and the retention, counted
  -- from the lease's end, moves with it.
  if v_won and pg_catalog.clock_timestamp() - v_at > interval '10 milliseconds' then
    v_at := pg_catalog.clock_timestamp();
    update agent.idempotency_keys as k
       set claimed_at = v_at,
           lease_expires_at = v_at + v_lease,
           retain_until = greatest(k.retain_until, v_at + v_lease + (k.retain_until - k.lease_expires_at)),
           redrive_at = case when k.redrive_at is not null then v_at + v_lease end
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
$_$;

CREATE OR REPLACE FUNCTION agent.idempotency_claim_many(p_organization_id uuid, p_scope text, p_lease_ms bigint, p_items jsonb, p_row_cap integer DEFAULT 1000) RETURNS SETOF agent.idempotency_claim_item
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $_$
declare
  v_keys text[];
  v_hashes text[];
  v_tokens uuid[];
  v_requests jsonb[];
  v_item jsonb;
  v_index integer;
  v_text text;
  v_earlier integer;
  v_state text;
  v_message text;
  v_hint text;
  v_retain interval;
  v_lease interval := p_lease_ms * interval '1 millisecond';
  v_at timestamptz;
  v_firsts boolean[];
  v_rows agent.idempotency_keys[];
  v_answered integer;
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
  v_retain := greatest(v_retain, v_lease);

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
    v_text := agent.idempotency_item_text(v_item, v_index, 'key', true);
    if char_length(v_text) not between 1 and 512 then
      raise exception 'p_items[%].key must be 1 to 512 characters, got %', v_index, char_length(v_text)
        using errcode = '22023';
    end if;
    v_text := agent.idempotency_item_text(v_item, v_index, 'request_hash', true);
    if octet_length(v_text) <> 64 or v_text ~ '[^0-9a-f]' then
      raise exception 'p_items[%].request_hash must be 64 lowercase hex digits (a SHA-256), got %',
                      v_index, pg_catalog.left(v_text, 80)
        using errcode = '22023';
    end if;
    perform agent.idempotency_item_uuid(v_item, v_index, 'lease_token');
    raise exception 'p_items[%] is malformed', v_index using errcode = '22023';
  end if;
  -- The items' fields, and whether each is its key's first occurrence.
  select pg_catalog.array_agg(t.key order by t.n), pg_catalog.array_agg(t.hash order by t.n),
         pg_catalog.array_agg(t.token order by t.n), pg_catalog.array_agg(t.request order by t.n),
         pg_catalog.array_agg(t.first order by t.n)
    into v_keys, v_hashes, v_tokens, v_requests, v_firsts
    from (select e.ordinality as n, e.value ->> 'key' as key, e.value ->> 'request_hash' as hash,
                 (e.value ->> 'lease_token')::uuid as token, nullif(e.value -> 'request', 'null'::jsonb) as request,
                 pg_catalog.row_number() over (partition by e.value ->> 'key' order by e.ordinality) = 1 as first
            from pg_catalog.jsonb_array_elements(p_items) with ordinality e) t;
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
  -- The work each key's first occurrence stores, measured as a single
  -- claim's is; later occurrences store nothing.
  if pg_catalog.array_length(pg_catalog.array_remove(v_requests, null), 1) is not null then
    begin
      for i in 1 .. pg_catalog.cardinality(v_keys) loop
        v_index := i - 1;
        if v_firsts[i] and v_requests[i] is not null then
          perform agent.idempotency_check_work(p_scope, v_requests[i]);
        end if;
      end loop;
    exception when others then
      get stacked diagnostics v_state = returned_sqlstate, v_message = message_text, v_hint = pg_exception_hint;
      raise exception 'p_items[%]: %', v_index, v_message using errcode = v_state, hint = v_hint;
    end;
  end if;

  -- Each key is decided once, by its first occurrence, in one statement
  -- that visits the keys in key order: a free key is inserted; a taken one
  -- is locked, and taken over when its lease has passed and the request is
  -- the same (the row's work kept, or this item's stored). Every row the
  -- batch touches is locked in (organization, scope, key) order, as every
  -- batch of the plane locks them, so batches over the same keys wait for
  -- each other in one order and never deadlock; and no other transaction
  -- can change a row between this decision and the answer read below.
  v_at := pg_catalog.clock_timestamp();
  with firsts as (
    select v_keys[i] as key, v_hashes[i] as hash, v_tokens[i] as token, v_requests[i] as request
      from pg_catalog.generate_subscripts(v_keys, 1) i
     where v_firsts[i]
  ), decided as (
    insert into agent.idempotency_keys as k
      (organization_id, scope, key, request_hash, status, lease_token,
       claimed_at, lease_expires_at, retain_until, request, redrive_at)
    select p_organization_id, p_scope, f.key, f.hash, 'processing', f.token,
           v_at, v_at + v_lease, v_at + v_lease + v_retain,
           f.request, case when f.request is not null then v_at + v_lease end
      from firsts f
     order by f.key
    on conflict (organization_id, scope, key) do update
       set lease_token = excluded.lease_token,
           claimed_at = v_at,
           lease_expires_at = v_at + v_lease,
           retain_until = greatest(k.retain_until, v_at + v_lease + v_retain),
           reclaims = k.reclaims + 1,
           request = coalesce(k.request, excluded.request),
           redrive_at = case when coalesce(k.request, excluded.request) is not null then v_at + v_lease end
     where k.status = 'processing'
       and k.request_hash = excluded.request_hash
       and k.lease_expires_at <= pg_catalog.clock_timestamp()
    returning k.*
  )
  select pg_catalog.array_agg(row(decided.*)::agent.idempotency_keys) into v_rows from decided;

  -- The leases won are timed from the end of the batch, when the answer
  -- is made: time spent waiting on other transactions' rows is not taken
  -- out of them. The retention, counted from the lease's end, moves with it.
  if v_rows is not null and pg_catalog.clock_timestamp() - v_at > interval '10 milliseconds' then
    v_at := pg_catalog.clock_timestamp();
    with moved as (
      update agent.idempotency_keys as k
         set claimed_at = v_at,
             lease_expires_at = v_at + v_lease,
             retain_until = greatest(k.retain_until, v_at + v_lease + (k.retain_until - k.lease_expires_at)),
             redrive_at = case when k.redrive_at is not null then v_at + v_lease end
        from pg_catalog.unnest(v_rows) w
       where k.organization_id = p_organization_id and k.id = w.id
      returning k.*
    )
    select pg_catalog.array_agg(row(moved.*)::agent.idempotency_keys) into v_rows from moved;
  end if;
  -- The rows of the keys the batch did not win, which it holds all the same.
  if coalesce(pg_catalog.cardinality(v_rows), 0) < pg_catalog.cardinality(v_keys) then
    select coalesce(v_rows, '{}') || coalesce(pg_catalog.array_agg(k), '{}') into v_rows
      from agent.idempotency_keys k
     where k.organization_id = p_organization_id and k.scope = p_scope
       and k.key = any (v_keys)
       and k.id <> all (select w.id from pg_catalog.unnest(coalesce(v_rows, '{}')) w);
  end if;

  -- Every item answered from its key's row: the first occurrence what it
  -- decided, a later one what a single claim would answer it now (the key
  -- is its batch's first occurrence's, so never claimed a second time).
  return query
    select (i - 1)::integer, o.outcome, k.id, k.organization_id, k.scope, k.key,
           case when o.outcome = 'conflict' then null else k.request_hash end,
           k.status,
           case when o.outcome in ('claimed', 'reclaimed') then k.lease_token end,
           case when o.outcome = 'completed' then k.resource_type end,
           case when o.outcome = 'completed' then k.resource_id end,
           case when o.outcome = 'completed' then k.response end,
           k.claimed_at, k.lease_expires_at, k.retain_until,
           k.status = 'processing' and k.lease_expires_at > pg_catalog.clock_timestamp()
      from pg_catalog.generate_subscripts(v_keys, 1) i
      join pg_catalog.unnest(v_rows) k on k.key = v_keys[i]
     cross join lateral (
       select case when k.request_hash <> v_hashes[i] then 'conflict'
                   when k.status = 'completed' then 'completed'
                   when k.lease_token <> v_tokens[i] then 'processing'
                   when k.reclaims > 0 then 'reclaimed'
                   else 'claimed' end as outcome
     ) o
     order by i;
  get diagnostics v_answered = row_count;
  if v_answered <> pg_catalog.cardinality(v_keys) then
    raise exception 'claim_many answered % of % items', v_answered, pg_catalog.cardinality(v_keys)
      using errcode = 'XX000';
  end if;
end
$_$;

CREATE OR REPLACE FUNCTION agent.idempotency_complete_many(p_organization_id uuid, p_items jsonb, p_row_cap integer DEFAULT 1000) RETURNS SETOF agent.idempotency_completion_item
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
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

  -- The rows are locked in (organization, scope, key) order before any is
  -- written, as every batch of the plane locks them, so that batches over
  -- the same keys never wait for each other in a cycle.
  perform 1
     from agent.idempotency_keys k
    where k.organization_id = p_organization_id and k.id = any (v_ids)
    order by k.scope, k.key
      for update of k;

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

CREATE OR REPLACE FUNCTION agent.idempotency_release_many(p_organization_id uuid, p_items jsonb, p_row_cap integer DEFAULT 1000) RETURNS SETOF agent.idempotency_release_item
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
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

  -- The rows are locked in (organization, scope, key) order before any is
  -- written, as every batch of the plane locks them, so that batches over
  -- the same keys never wait for each other in a cycle.
  perform 1
     from agent.idempotency_keys k
    where k.organization_id = p_organization_id and k.id = any (v_ids)
    order by k.scope, k.key
      for update of k;

  for i in 1 .. pg_catalog.cardinality(v_ids) loop
    return next (i - 1, agent.idempotency_release(v_ids[i], v_tokens[i], p_organization_id))
      ::agent.idempotency_release_item;
  end loop;
end
$$;

CREATE OR REPLACE FUNCTION agent.idempotency_delete_expired(p_ids uuid[]) RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
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
  if array_position(p_ids, null) is not null then
    raise exception 'p_ids holds a NULL at position %', array_position(p_ids, null) using errcode = '22023';
  end if;
  -- A row another transaction holds is left for the next pass: the sweep
  -- never waits on a claim, so it never takes part in a cycle of waits.
  delete from agent.idempotency_keys k
   where k.id in (select x.id
                    from agent.idempotency_keys x
                   where x.id = any (p_ids)
                     and x.retain_until < now()
                     for update of x skip locked);
  get diagnostics v_deleted = row_count;
  return v_deleted;
end
$$;
