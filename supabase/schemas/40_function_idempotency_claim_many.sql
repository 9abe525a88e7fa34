-- agent.idempotency_claim_many
--
-- Claims a batch in one round trip (public): one row per item, in input
-- order, what the items' single claims made one after another would answer.
-- Each key is decided once, by its first occurrence, in one statement that
-- visits the keys in key order and locks every row it finds, so batches
-- never deadlock; a later occurrence answers from the row its first left
-- (processing, completed or a conflict), never a second claim. The leases
-- won are timed from the end of the batch. A malformed item or more than
-- p_row_cap items refuses the whole batch (22023) and writes nothing.

CREATE FUNCTION agent.idempotency_claim_many(p_organization_id uuid, p_scope text, p_lease_ms bigint, p_items jsonb, p_row_cap integer DEFAULT NULL::integer) RETURNS SETOF agent.idempotency_claim_item
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $_$
declare
  v_keys text[];
  v_hashes text[];
  v_tokens uuid[];
  v_requests jsonb[];
  v_traceparents text[];
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
                          ~ '^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$'
                      and (coalesce(pg_catalog.jsonb_typeof(e.value -> 'traceparent'), 'null') = 'null'
                           or e.value ->> 'traceparent' = ''
                           or ((e.value ->> 'traceparent') ~ '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'
                               and substr(e.value ->> 'traceparent', 4, 32) <> '00000000000000000000000000000000'
                               and substr(e.value ->> 'traceparent', 37, 16) <> '0000000000000000')),
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
    perform agent.idempotency_check_traceparent(agent.idempotency_item_text(v_item, v_index, 'traceparent', false),
                                                'p_items[' || v_index || '].traceparent');
    raise exception 'p_items[%] is malformed', v_index using errcode = '22023';
  end if;
  -- The items' fields, and whether each is its key's first occurrence.
  select pg_catalog.array_agg(t.key order by t.n), pg_catalog.array_agg(t.hash order by t.n),
         pg_catalog.array_agg(t.token order by t.n), pg_catalog.array_agg(t.request order by t.n),
         pg_catalog.array_agg(t.first order by t.n), pg_catalog.array_agg(t.traceparent order by t.n)
    into v_keys, v_hashes, v_tokens, v_requests, v_firsts, v_traceparents
    from (select e.ordinality as n, e.value ->> 'key' as key, e.value ->> 'request_hash' as hash,
                 (e.value ->> 'lease_token')::uuid as token, nullif(e.value -> 'request', 'null'::jsonb) as request,
                 nullif(e.value ->> 'traceparent', '') as traceparent,
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
    select v_keys[i] as key, v_hashes[i] as hash, v_tokens[i] as token, v_requests[i] as request,
           v_traceparents[i] as traceparent
      from pg_catalog.generate_subscripts(v_keys, 1) i
     where v_firsts[i]
  ), decided as (
    insert into agent.idempotency_keys as k
      (organization_id, scope, key, request_hash, status, lease_token,
       claimed_at, lease_expires_at, retain_until, request, redrive_at, traceparent)
    select p_organization_id, p_scope, f.key, f.hash, 'processing', f.token,
           v_at, v_at + v_lease, v_at + v_lease + v_retain,
           f.request, case when f.request is not null then v_at + v_lease end, f.traceparent
      from firsts f
     order by f.key
    on conflict (organization_id, scope, key) do update
       set lease_token = excluded.lease_token,
           claimed_at = v_at,
           lease_expires_at = v_at + v_lease,
           retain_until = greatest(k.retain_until, v_at + v_lease + v_retain),
           reclaims = k.reclaims + 1,
           request = coalesce(k.request, excluded.request),
           redrive_at = case when coalesce(k.request, excluded.request) is not null then v_at + v_lease end,
           traceparent = coalesce(k.traceparent, excluded.traceparent)
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
           k.status = 'processing' and k.lease_expires_at > pg_catalog.clock_timestamp(),
           case when o.outcome in ('claimed', 'reclaimed') then k.traceparent end
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
  -- Items answered from the journal, counted as replays.
  select pg_catalog.count(*) into v_answered
    from pg_catalog.generate_subscripts(v_keys, 1) i
    join pg_catalog.unnest(v_rows) k on k.key = v_keys[i]
   where k.status = 'completed' and k.request_hash = v_hashes[i];
  if v_answered > 0 then
    perform agent.idempotency_count_replays(p_scope, v_answered);
  end if;
end
$_$;

ALTER FUNCTION agent.idempotency_claim_many(p_organization_id uuid, p_scope text, p_lease_ms bigint, p_items jsonb, p_row_cap integer) OWNER TO idempotency_owner;
