-- agent.idempotency_claim_many
--
-- Claims a batch in one round trip (public): one row per item, in input
-- order, exactly what the items' single claims made one after another would
-- answer. A malformed item or more than p_row_cap items refuses the whole
-- batch (22023) and writes nothing.

CREATE FUNCTION agent.idempotency_claim_many(p_organization_id uuid, p_scope text, p_lease_ms bigint, p_items jsonb, p_row_cap integer DEFAULT 1000) RETURNS SETOF agent.idempotency_claim_item
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $_$
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
$_$;

ALTER FUNCTION agent.idempotency_claim_many(p_organization_id uuid, p_scope text, p_lease_ms bigint, p_items jsonb, p_row_cap integer) OWNER TO idempotency_owner;
