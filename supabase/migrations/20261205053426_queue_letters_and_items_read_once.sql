-- Dead letters of work run from the plane name their organization; a
-- queue settle or extend reads its items once; a take finds a batch's
-- copies in one pass.
--
-- A job whose consumer stopped (or that an operator sent back after a fix)
-- runs again from its claim's stored work, without its message. When it
-- failed there, idempotency_queue_take and idempotency_queue_settle built its
-- dead letter from the claim as {idempotency_key, payload}: a tenant's letter
-- lost its organization_id, so the letter sent back to the queue after a fix
-- was claimed under the consumer's own organization, a new command that ran
-- the job a second time. Such a letter now carries organization_id.
--
-- idempotency_queue_settle parsed its items three times, one PL/pgSQL call
-- per field of each item (about 70 microseconds an item each time: 11 of
-- the 12 ms a batch of 50 took), and idempotency_queue_extend twice;
-- idempotency_queue_take looked for each message's earlier copy with a query
-- over the whole batch per message. The items are now checked in one
-- statement and read once, into an array of agent.idempotency_queue_ending
-- (new, private); an item is read field by field only when one is malformed,
-- to say which and what is wrong with it, with the same errors as before.
-- What every function answers is unchanged.

SET local check_function_bodies = off;

DROP FUNCTION "agent"."idempotency_queue_items"(jsonb, integer, boolean);

CREATE TYPE "agent"."idempotency_queue_ending" AS (
  "item"            integer,
  "organization_id" uuid,
  "claim_id"        uuid,
  "lease_token"     uuid,
  "msg_ids"         bigint[],
  "ending"          text,
  "response"        jsonb,
  "resource_type"   text,
  "resource_id"     text
);

ALTER TYPE "agent"."idempotency_queue_ending" OWNER TO "idempotency_owner";

CREATE OR REPLACE FUNCTION agent.idempotency_queue_extend (
  p_queue    text,
  p_lease_ms bigint,
  p_items    jsonb,
  p_row_cap  integer DEFAULT NULL::integer
)
  RETURNS SETOF agent.idempotency_queue_extended
  LANGUAGE plpgsql
  SECURITY DEFINER
  SET search_path TO ''
  SET lock_timeout TO '5s'
  AS $function$
declare
  v_items agent.idempotency_queue_ending[];
  v_item agent.idempotency_queue_ending;
  v_orgs uuid[];
  v_claims uuid[];
  v_locked bigint[];
  v_end timestamptz;
  v_visible integer;
begin
  perform agent.idempotency_queue_check(p_queue, 'p_queue');
  if p_lease_ms is null or p_lease_ms not between 1000 and 86400000 then
    raise exception 'p_lease_ms must be between 1000 (one second) and 86400000 (one day), got %', p_lease_ms
      using errcode = '22023';
  end if;
  v_visible := (p_lease_ms + 999) / 1000 + 1;
  v_items := agent.idempotency_queue_items(p_items, p_row_cap, false);
  select pg_catalog.array_agg(i.organization_id order by i.item), pg_catalog.array_agg(i.claim_id order by i.item)
    into v_orgs, v_claims
    from pg_catalog.unnest(v_items) i;
  select coalesce(pg_catalog.array_agg(distinct m order by m), '{}') into v_locked
    from pg_catalog.unnest(v_items) i
   cross join lateral pg_catalog.unnest(i.msg_ids) m;
  perform agent.idempotency_queue_lock(p_queue, v_locked, v_orgs, v_claims);
  foreach v_item in array v_items loop
    v_end := agent.idempotency_extend(v_item.claim_id, v_item.lease_token, p_lease_ms, v_item.organization_id);
    if v_end is not null then
      for i in 1 .. coalesce(pg_catalog.cardinality(v_item.msg_ids), 0) loop
        perform pgmq.set_vt(p_queue, v_item.msg_ids[i], v_visible);
      end loop;
    end if;
    return next (v_item.item, v_end)::agent.idempotency_queue_extended;
  end loop;
end
$function$;

CREATE OR REPLACE FUNCTION agent.idempotency_queue_items (
  p_items   jsonb,
  p_row_cap integer,
  p_endings boolean
)
  RETURNS agent.idempotency_queue_ending[]
  LANGUAGE plpgsql
  STABLE
  SET search_path TO ''
  AS $function$
declare
  v_item jsonb;
  v_index integer;
  v_bad integer;
  v_ending text;
  v_resource text;
  v_items agent.idempotency_queue_ending[];
  c_uuid constant text := '^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$';
  c_ids constant jsonpath := 'strict $[*] ? (@.type() != "number" || @ < 1 || @ > 9223372036854775807 || @.floor() != @)';
begin
  perform agent.idempotency_check_batch(p_items, p_row_cap);
  select (e.ordinality - 1)::integer into v_bad
    from pg_catalog.jsonb_array_elements(p_items) with ordinality e
   where not coalesce(
           pg_catalog.jsonb_typeof(e.value) = 'object'
           and pg_catalog.jsonb_typeof(e.value -> 'organization_id') = 'string'
           and (e.value ->> 'organization_id') ~ c_uuid
           and pg_catalog.jsonb_typeof(e.value -> 'claim_id') = 'string'
           and (e.value ->> 'claim_id') ~ c_uuid
           and pg_catalog.jsonb_typeof(e.value -> 'lease_token') = 'string'
           and (e.value ->> 'lease_token') ~ c_uuid
           and pg_catalog.jsonb_typeof(e.value -> 'msg_ids') = 'array'
           and not pg_catalog.jsonb_path_exists(e.value -> 'msg_ids', c_ids)
           and (not p_endings
                or (pg_catalog.jsonb_typeof(e.value -> 'ending') = 'string'
                    and (e.value ->> 'ending') in ('journal', 'release', 'leave')
                    and ((e.value ->> 'ending') <> 'journal'
                         or (coalesce(pg_catalog.jsonb_typeof(e.value -> 'resource_type'), 'null') in ('null', 'string')
                             and coalesce(pg_catalog.jsonb_typeof(e.value -> 'resource_id'), 'null') in ('null', 'string')
                             and (nullif(e.value -> 'response', 'null'::jsonb) is not null
                                  or nullif(e.value ->> 'resource_id', '') is not null))))),
           false)
   order by e.ordinality
   limit 1;
  if v_bad is not null then
    -- Say what is wrong with the first malformed item.
    for v_item, v_index in select e.value, (e.ordinality - 1)::integer
                             from pg_catalog.jsonb_array_elements(p_items) with ordinality e
                            where e.ordinality <= v_bad + 1 loop
      perform agent.idempotency_check_item(v_item, v_index);
      if pg_catalog.jsonb_typeof(v_item -> 'msg_ids') is distinct from 'array'
         or pg_catalog.jsonb_path_exists(v_item -> 'msg_ids', c_ids) then
        raise exception 'p_items[%].msg_ids must be an array of message ids (empty for a re-driven claim)', v_index
          using errcode = '22023';
      end if;
      if p_endings then
        v_ending := agent.idempotency_item_text(v_item, v_index, 'ending', true);
        if v_ending not in ('journal', 'release', 'leave') then
          raise exception 'p_items[%].ending must be journal, release or leave, got %', v_index, pg_catalog.left(v_ending, 40)
            using errcode = '22023';
        end if;
        if v_ending = 'journal' then
          perform agent.idempotency_item_text(v_item, v_index, 'resource_type', false);
          v_resource := nullif(agent.idempotency_item_text(v_item, v_index, 'resource_id', false), '');
          if nullif(v_item -> 'response', 'null'::jsonb) is null and v_resource is null then
            raise exception 'p_items[%] is journaled with neither a response nor a resource; a journal carries one', v_index
              using errcode = '22023';
          end if;
        end if;
      end if;
      perform agent.idempotency_item_uuid(v_item, v_index, 'organization_id');
      perform agent.idempotency_item_uuid(v_item, v_index, 'claim_id');
      perform agent.idempotency_item_uuid(v_item, v_index, 'lease_token');
    end loop;
    raise exception 'p_items[%] is malformed', v_bad using errcode = '22023';
  end if;
  select pg_catalog.array_agg(
           ((e.ordinality - 1)::integer, (e.value ->> 'organization_id')::uuid, (e.value ->> 'claim_id')::uuid,
            (e.value ->> 'lease_token')::uuid,
            coalesce((select pg_catalog.array_agg(m.value::text::bigint order by m.ordinality)
                        from pg_catalog.jsonb_array_elements(e.value -> 'msg_ids') with ordinality m), '{}'),
            case when p_endings then e.value ->> 'ending' end,
            case when p_endings and (e.value ->> 'ending') = 'journal' then nullif(e.value -> 'response', 'null'::jsonb) end,
            case when p_endings and (e.value ->> 'ending') = 'journal' then nullif(e.value ->> 'resource_type', '') end,
            case when p_endings and (e.value ->> 'ending') = 'journal' then nullif(e.value ->> 'resource_id', '') end
           )::agent.idempotency_queue_ending
           order by e.ordinality)
    into v_items
    from pg_catalog.jsonb_array_elements(p_items) with ordinality e;
  return v_items;
end
$function$;

ALTER FUNCTION "agent"."idempotency_queue_items"(jsonb, integer, boolean) OWNER TO "idempotency_owner";

CREATE OR REPLACE FUNCTION agent.idempotency_queue_settle (
  p_queue             text,
  p_dead_letter_queue text,
  p_items             jsonb,
  p_row_cap           integer DEFAULT NULL::integer
)
  RETURNS SETOF agent.idempotency_queue_settled
  LANGUAGE plpgsql
  SECURITY DEFINER
  SET search_path TO ''
  SET lock_timeout TO '5s'
  AS $function$
declare
  v_items agent.idempotency_queue_ending[];
  v_item agent.idempotency_queue_ending;
  v_orgs uuid[];
  v_claims uuid[];
  v_locked bigint[];
  v_row agent.idempotency_claim;
  v_archive bigint[] := '{}'::bigint[];
  v_body jsonb;
  v_reads integer;
  v_request jsonb;
  v_key text;
  v_lettered boolean;
  v_released boolean;
  v_state text;
  v_message text;
  v_hint text;
  v_index integer;
begin
  perform agent.idempotency_queue_check(p_queue, 'p_queue');
  perform agent.idempotency_queue_check(p_dead_letter_queue, 'p_dead_letter_queue');
  v_items := agent.idempotency_queue_items(p_items, p_row_cap, true);
  select pg_catalog.array_agg(i.organization_id order by i.item), pg_catalog.array_agg(i.claim_id order by i.item)
    into v_orgs, v_claims
    from pg_catalog.unnest(v_items) i;
  select coalesce(pg_catalog.array_agg(distinct m order by m), '{}') into v_locked
    from pg_catalog.unnest(v_items) i
   cross join lateral pg_catalog.unnest(i.msg_ids) m
   where i.ending = 'journal';
  perform agent.idempotency_queue_lock(p_queue, v_locked, v_orgs, v_claims);

  begin
    foreach v_item in array v_items loop
      v_index := v_item.item;
      v_lettered := false;
      if v_item.ending = 'journal' then
        select * into v_row
          from agent.idempotency_complete(v_item.claim_id, v_item.lease_token, v_item.resource_type,
                                          v_item.resource_id, v_item.response, v_item.organization_id);
        if not found then
          -- The claim is no longer this caller's: its messages stay, and
          -- come back to whoever holds it now.
          return next (v_index, false, 0, false)::agent.idempotency_queue_settled;
          continue;
        end if;
        if v_row.response -> 'ok' = 'false'::jsonb then
          update agent.idempotency_keys k
             set dead_lettered_at = pg_catalog.clock_timestamp()
           where k.organization_id = v_item.organization_id and k.id = v_item.claim_id
             and k.dead_lettered_at is null
          returning k.request, k.key into v_request, v_key;
          if found then
            v_body := null;
            v_reads := null;
            if pg_catalog.cardinality(v_item.msg_ids) > 0 then
              execute pg_catalog.format('select q.message, q.read_ct from pgmq.%I q where q.msg_id = $1',
                                        'q_' || p_queue)
                into v_body, v_reads
                using v_item.msg_ids[1];
            end if;
            perform agent.idempotency_queue_letter(
                      p_queue, p_dead_letter_queue, v_item.msg_ids[1], v_reads,
                      coalesce(v_body, pg_catalog.jsonb_build_object('idempotency_key', v_key, 'organization_id', v_item.organization_id,
                                                                 'payload', v_request)),
                      v_row.response);
            v_lettered := true;
          end if;
        end if;
        v_archive := v_archive || v_item.msg_ids;
        return next (v_index, true, pg_catalog.cardinality(v_item.msg_ids), v_lettered)::agent.idempotency_queue_settled;
      elsif v_item.ending = 'release' then
        v_released := agent.idempotency_release(v_item.claim_id, v_item.lease_token, v_item.organization_id);
        return next (v_index, false, 0, false)::agent.idempotency_queue_settled;
      else
        return next (v_index, false, 0, false)::agent.idempotency_queue_settled;
      end if;
    end loop;
  exception when others then
    get stacked diagnostics v_state = returned_sqlstate, v_message = message_text, v_hint = pg_exception_hint;
    raise exception 'p_items[%]: %', v_index, v_message using errcode = v_state, hint = v_hint;
  end;
  if pg_catalog.cardinality(v_archive) > 0 then
    perform pgmq.archive(p_queue, v_archive);
  end if;
end
$function$;

CREATE OR REPLACE FUNCTION agent.idempotency_queue_take (
  p_queue             text,
  p_dead_letter_queue text,
  p_organization_id   uuid,
  p_lease_ms          bigint,
  p_lease_tokens      uuid[],
  p_max_reads         integer DEFAULT 5,
  p_scope             text    DEFAULT NULL::text,
  p_organizations     uuid[]  DEFAULT NULL::uuid[],
  p_row_cap           integer DEFAULT NULL::integer
)
  RETURNS SETOF agent.idempotency_queue_item
  LANGUAGE plpgsql
  SECURITY DEFINER
  SET search_path TO ''
  SET lock_timeout TO '5s'
  AS $function$
declare
  v_scope text := coalesce(p_scope, 'queue.' || p_queue);
  v_cap integer;
  v_count integer;
  v_earlier integer;
  v_index integer;
  v_accepted uuid[];
  v_visible integer;
  v_max_work integer;
  v_items agent.idempotency_queue_item[] := '{}'::agent.idempotency_queue_item[];
  v_item agent.idempotency_queue_item;
  v_hashes text[] := '{}'::text[];
  v_message record;
  v_body jsonb;
  v_key text;
  v_org uuid;
  v_reason text;
  v_claims jsonb;
  v_claim record;
  v_orgs uuid[];
  v_first integer;
  v_firsts integer[];
  v_failure jsonb;
  v_archive bigint[] := '{}'::bigint[];
  v_work record;
  -- 2^1024 - 2^970: from here on the nearest IEEE 754 double is infinity,
  -- which no JSON reader of a client can hash or hand on.
  c_beyond constant jsonb := pg_catalog.jsonb_build_object('max', 179769313486231580793728971405303415079934132710037826936173778980444968292764750946649017977587207096330286416692887910946555547851940402630657488671505820681908902000708383676273854845817711531764475730270069855571366959622842914819860834936475292719074168444365510704342711559699508093042880177904174497792::numeric);
begin
  perform agent.idempotency_queue_check(p_queue, 'p_queue');
  perform agent.idempotency_queue_check(p_dead_letter_queue, 'p_dead_letter_queue');
  if p_dead_letter_queue = p_queue then
    raise exception 'p_dead_letter_queue must be another queue than p_queue %', p_queue using errcode = '22023';
  end if;
  if p_lease_ms is null or p_lease_ms not between 1000 and 86400000 then
    raise exception 'p_lease_ms must be between 1000 (one second) and 86400000 (one day), got %', p_lease_ms
      using errcode = '22023';
  end if;
  if p_max_reads is null or p_max_reads < 1 then
    raise exception 'p_max_reads must be at least 1, got %', p_max_reads using errcode = '22023';
  end if;
  if char_length(v_scope) > 128 or v_scope !~ '^[a-z0-9_-]+(\.[a-z0-9_-]+)*$' then
    raise exception 'p_scope must be a scope of a-z, 0-9, ".", "_" and "-", got %', pg_catalog.left(v_scope, 128)
      using errcode = '22023';
  end if;
  v_accepted := coalesce(p_organizations, array[p_organization_id]::uuid[]);
  if pg_catalog.array_position(v_accepted, null) is not null or pg_catalog.cardinality(v_accepted) = 0 then
    raise exception 'p_organization_id or p_organizations must name the organizations whose messages this consumer takes'
      using errcode = '22023';
  end if;
  if p_organization_id is not null and p_organization_id <> all (v_accepted) then
    raise exception 'p_organization_id % is not among p_organizations', p_organization_id using errcode = '22023';
  end if;
  v_cap := agent.idempotency_row_cap(p_row_cap);
  v_count := coalesce(pg_catalog.cardinality(p_lease_tokens), 0);
  if v_count not between 1 and v_cap then
    raise exception 'p_lease_tokens must hold between 1 and the row cap % tokens, got %', v_cap, v_count
      using errcode = '22023',
            hint = 'one fresh token per message (or re-drive) the call may take: the answer names every one';
  end if;
  if pg_catalog.array_position(p_lease_tokens, null) is not null then
    raise exception 'p_lease_tokens[%] is NULL', pg_catalog.array_position(p_lease_tokens, null) - 1
      using errcode = '22023';
  end if;
  select t.first - 1, t.i - 1 into v_earlier, v_index
    from (select i, pg_catalog.min(i) over (partition by p_lease_tokens[i]) as first
            from pg_catalog.generate_subscripts(p_lease_tokens, 1) i) t
   where t.i > t.first
   order by t.i
   limit 1;
  if v_earlier is not null then
    raise exception 'p_lease_tokens[%] repeats p_lease_tokens[%]: each message needs a token of its own', v_index, v_earlier
      using errcode = '22023';
  end if;
  select p.max_request_bytes into v_max_work from agent.idempotency_policy(v_scope) p;
  if v_max_work is null then
    raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', v_scope
      using errcode = 'IDEM1',
            hint = 'add the scope (or its family, queue.*) to agent.idempotency_scopes in a migration';
  end if;

  -- Read: each message hidden for the lease and a second more, so it comes
  -- back only once its claim may be taken over.
  v_visible := (p_lease_ms + 999) / 1000 + 1;
  for v_message in
    select r.msg_id, r.read_ct, r.enqueued_at, r.message
      from pgmq.read(p_queue, v_visible, v_count) r
     order by r.msg_id
  loop
    v_body := v_message.message;
    v_reason := null;
    v_key := null;
    v_org := null;
    if v_body is null or pg_catalog.jsonb_typeof(v_body) <> 'object' then
      v_reason := 'the message is not a JSON object';
    elsif pg_catalog.jsonb_path_exists(v_body, 'strict $.** ? (@.type() == "number" && (@ >= $max || @ <= -$max))',
                                       c_beyond) then
      v_reason := 'the message holds a number beyond every IEEE 754 double, which a client reads as infinity';
    else
      case pg_catalog.jsonb_typeof(v_body -> 'idempotency_key')
        when 'string' then
          v_key := v_body ->> 'idempotency_key';
          if char_length(v_key) not between 1 and 512 then
            v_reason := 'idempotency_key must have 1 to 512 characters';
          end if;
        when 'null' then
          v_key := 'msg-' || v_message.msg_id;
        else
          if v_body ? 'idempotency_key' then
            v_reason := 'idempotency_key is not a string';
          else
            v_key := 'msg-' || v_message.msg_id;
          end if;
      end case;
      if v_reason is null then
        case coalesce(pg_catalog.jsonb_typeof(v_body -> 'organization_id'), 'null')
          when 'null' then
            v_org := p_organization_id;
            if v_org is null then
              v_reason := 'the message names no organization_id, and this consumer has no default one';
            end if;
          when 'string' then
            if (v_body ->> 'organization_id') ~* '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$' then
              v_org := (v_body ->> 'organization_id')::uuid;
              if v_org <> all (v_accepted) then
                v_reason := 'organization_id ' || v_org || ' is not one this consumer accepts';
              end if;
            else
              v_reason := 'organization_id is not a UUID';
            end if;
          else
            v_reason := 'organization_id is not a UUID';
        end case;
      end if;
      if v_reason is null and pg_catalog.octet_length((v_body -> 'payload')::text) > v_max_work
         and agent.idempotency_json_size(v_body -> 'payload') > v_max_work then
        v_reason := 'the payload is above the ' || v_max_work || ' bytes scope ' || v_scope
                    || ' keeps, so a failure could not be run again after a fix';
      end if;
    end if;
    v_item := (v_message.msg_id, v_message.read_ct, v_message.enqueued_at,
               case when v_reason is null then v_body end, v_org, v_key,
               case when v_reason is null then 'unclaimed' else 'malformed' end,
               null, null, null, null, null, null, null,
               case when v_reason is null then coalesce(v_body -> 'payload', 'null'::jsonb) end,
               null, false, false, v_reason, null)::agent.idempotency_queue_item;
    v_items := v_items || v_item;
    v_hashes := v_hashes || case when v_reason is null
                                 then agent.idempotency_request_hash(coalesce(v_body -> 'payload', 'null'::jsonb)) end;
  end loop;

  -- A message no client can read is dead-lettered alone, at once.
  for i in 1 .. coalesce(pg_catalog.cardinality(v_items), 0) loop
    if v_items[i].outcome = 'malformed' then
      select r.message into v_body from pgmq.set_vt(p_queue, v_items[i].msg_id, v_visible) r;
      perform agent.idempotency_queue_letter(p_queue, p_dead_letter_queue, v_items[i].msg_id, v_items[i].read_ct, v_body,
                                             pg_catalog.jsonb_build_object('error', 'malformed_message',
                                                                           'output', pg_catalog.jsonb_build_object('reason', v_items[i].reason)));
      v_items[i].dead_lettered := true;
      v_items[i].archived := true;
      v_archive := v_archive || v_items[i].msg_id;
    end if;
  end loop;

  -- Claim: one batch per organization, in organization order (each batch
  -- locks its keys in key order), every message under its own token; a key
  -- twice among them is decided by its first message, the others are its
  -- copies and end with it.
  select pg_catalog.array_agg(distinct t.organization_id order by t.organization_id) into v_orgs
    from pg_catalog.unnest(v_items) t
   where t.outcome = 'unclaimed';
  -- Each message to claim, and the first message of its key.
  select pg_catalog.array_agg(f.first order by f.n) into v_firsts
    from (select n, case when v_items[n].outcome = 'unclaimed'
                         then pg_catalog.min(n) over (partition by v_items[n].outcome, v_items[n].organization_id,
                                                                   v_items[n].key) end as first
            from pg_catalog.generate_subscripts(v_items, 1) n) f;
  for v_org in select pg_catalog.unnest(coalesce(v_orgs, '{}')) loop
    select pg_catalog.jsonb_agg(pg_catalog.jsonb_build_object(
             'key', v_items[i].key, 'request_hash', v_hashes[i], 'lease_token', p_lease_tokens[i],
             'request', v_items[i].payload) order by i)
      into v_claims
      from pg_catalog.generate_subscripts(v_items, 1) i
     where v_items[i].outcome = 'unclaimed' and v_items[i].organization_id = v_org;
    for v_claim in
      select c.*, x.i
        from agent.idempotency_claim_many(v_org, v_scope, p_lease_ms, v_claims, v_cap) c
        join (select i, pg_catalog.row_number() over (order by i) - 1 as n
                from pg_catalog.generate_subscripts(v_items, 1) i
               where v_items[i].outcome = 'unclaimed' and v_items[i].organization_id = v_org) x on x.n = c.item
       order by c.item
    loop
      v_index := v_claim.i;
      v_items[v_index].id := v_claim.id;
      v_items[v_index].lease_expires_at := v_claim.lease_expires_at;
      v_items[v_index].retain_until := v_claim.retain_until;
      v_items[v_index].lease_live := v_claim.lease_live;
      v_first := nullif(v_firsts[v_index], v_index);
      if v_first is not null and v_hashes[v_first] = v_hashes[v_index] then
        v_items[v_index].outcome := 'copy';
        v_items[v_index].copy_of := v_items[v_first].msg_id;
      else
        v_items[v_index].outcome := v_claim.outcome;
        if v_claim.outcome in ('claimed', 'reclaimed') then
          v_items[v_index].lease_token := v_claim.lease_token;
        elsif v_claim.outcome = 'completed' then
          v_items[v_index].response := v_claim.response;
        end if;
      end if;
    end loop;
  end loop;

  -- What this call can end now, it ends now: a message read too often is
  -- journaled as the failure dead_lettered; a conflict is dead-lettered; a
  -- journaled answer is replayed and archived, a failure's first copy
  -- dead-lettered with it.
  for i in 1 .. coalesce(pg_catalog.cardinality(v_items), 0) loop
    if v_items[i].outcome in ('claimed', 'reclaimed') and v_items[i].read_ct > p_max_reads then
      v_failure := pg_catalog.jsonb_build_object(
                     'ok', false, 'error', 'dead_lettered',
                     'output', pg_catalog.jsonb_build_object('reads', v_items[i].read_ct, 'max_reads', p_max_reads));
      perform agent.idempotency_complete(v_items[i].id, v_items[i].lease_token, null, null, v_failure,
                                         v_items[i].organization_id);
      v_items[i].outcome := 'completed';
      v_items[i].response := v_failure;
      v_items[i].lease_token := null;
    end if;
    if v_items[i].outcome = 'conflict' then
      perform agent.idempotency_queue_letter(p_queue, p_dead_letter_queue, v_items[i].msg_id, v_items[i].read_ct,
                                             v_items[i].message,
                                             pg_catalog.jsonb_build_object('error', 'conflict', 'output',
                                               pg_catalog.jsonb_build_object('key', v_items[i].key)));
      v_items[i].dead_lettered := true;
      v_items[i].archived := true;
      v_archive := v_archive || v_items[i].msg_id;
    elsif v_items[i].outcome = 'completed' then
      if v_items[i].response -> 'ok' = 'false'::jsonb then
        update agent.idempotency_keys k
           set dead_lettered_at = pg_catalog.clock_timestamp()
         where k.organization_id = v_items[i].organization_id and k.id = v_items[i].id
           and k.dead_lettered_at is null;
        if found then
          perform agent.idempotency_queue_letter(p_queue, p_dead_letter_queue, v_items[i].msg_id, v_items[i].read_ct,
                                                 v_items[i].message, v_items[i].response);
          v_items[i].dead_lettered := true;
        end if;
      end if;
      v_items[i].archived := true;
      v_archive := v_archive || v_items[i].msg_id;
    end if;
  end loop;
  -- Copies follow their first message: archived with an answer it found.
  for i in 1 .. coalesce(pg_catalog.cardinality(v_items), 0) loop
    if v_items[i].outcome = 'copy' then
      v_first := v_firsts[i];
      if v_items[v_first].archived then
        v_items[i].response := v_items[v_first].response;
        v_items[i].archived := true;
        v_archive := v_archive || v_items[i].msg_id;
      elsif v_items[v_first].outcome = 'processing' then
        v_items[i].outcome := 'processing';
        v_items[i].copy_of := null;
      end if;
    end if;
  end loop;
  if pg_catalog.cardinality(v_archive) > 0 then
    perform pgmq.archive(p_queue, v_archive);
  end if;

  -- Slots the queue did not fill take over this scope's work whose worker
  -- stopped, or that an operator sent back after a fix: each runs again
  -- under a token of the caller's, with the payload its claim keeps.
  if coalesce(pg_catalog.cardinality(v_items), 0) < v_count then
    for v_org in select o from pg_catalog.unnest(v_accepted) o order by o loop
      exit when coalesce(pg_catalog.cardinality(v_items), 0) >= v_count;
      for v_work in
        select w.*
          from agent.idempotency_redrive(
                 v_scope,
                 (select pg_catalog.array_agg(t order by n)
                    from pg_catalog.unnest(p_lease_tokens) with ordinality u(t, n)
                   where n > coalesce(pg_catalog.cardinality(v_items), 0)),
                 p_lease_ms, v_org, v_cap) w
      loop
        v_items := v_items || (null, null, null, null, v_work.organization_id, v_work.key,
                               case when v_work.status = 'processing' then 'redriven' else 'completed' end,
                               null, v_work.id, v_work.lease_token, v_work.lease_expires_at, v_work.retain_until,
                               v_work.status = 'processing', v_work.attempt, v_work.request, v_work.response,
                               false, false, null, null)::agent.idempotency_queue_item;
        if v_work.status = 'completed' and v_work.response -> 'ok' = 'false'::jsonb then
          -- Re-driven as often as its scope allows: journaled as dead_lettered.
          update agent.idempotency_keys k
             set dead_lettered_at = pg_catalog.clock_timestamp()
           where k.organization_id = v_work.organization_id and k.id = v_work.id
             and k.dead_lettered_at is null
          returning k.request into v_body;
          if found then
            perform agent.idempotency_queue_letter(
                      p_queue, p_dead_letter_queue, null, null,
                      pg_catalog.jsonb_build_object('idempotency_key', v_work.key, 'organization_id', v_work.organization_id,
                                                    'payload', v_body),
                      v_work.response);
            v_items[pg_catalog.cardinality(v_items)].dead_lettered := true;
          end if;
        end if;
      end loop;
    end loop;
  end if;

  -- The answer carries what its reader needs: the message of a message to
  -- run (its payload inside), the payload of re-driven work, the
  -- answer of one replayed; and how many rows it holds, so a cut answer is
  -- told from a whole one.
  for i in 1 .. coalesce(pg_catalog.cardinality(v_items), 0) loop
    if v_items[i].outcome not in ('claimed', 'reclaimed') then
      v_items[i].message := null;
    end if;
    if v_items[i].outcome <> 'redriven' then
      v_items[i].payload := null;
    end if;
    v_items[i].taken := pg_catalog.cardinality(v_items);
  end loop;
  return query select t.* from pg_catalog.unnest(v_items) t;
end
$function$;

REVOKE ALL ON FUNCTION "agent"."idempotency_queue_items"(jsonb, integer, boolean) FROM PUBLIC;

REVOKE ALL ON TYPE "agent"."idempotency_queue_ending" FROM PUBLIC;
