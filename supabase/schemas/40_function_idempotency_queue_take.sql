-- agent.idempotency_queue_take
--
-- Takes a batch from a pgmq queue (public): reads up to one message per lease
-- token the caller supplies, each hidden for the lease and a second more, and
-- claims each under its idempotency key in the same transaction, storing the
-- message's payload with its claim as work. Answers per message, in message
-- order: claimed or reclaimed (run it, under the token answered), completed
-- (its answer was journaled before: archived here, never run again), a copy
-- (its key is an earlier message's of this batch, with the same payload: it
-- ends with that message), processing (held elsewhere: left to come back),
-- conflict (the key answers for another payload) or malformed (no client
-- could read or hash it); the last two are dead-lettered and archived here.
-- A claimed message read more than p_max_reads times is journaled as the
-- failure dead_lettered instead of run. A failure is sent to the dead-letter
-- queue once per command: a copy of a command whose failure was dead-lettered
-- is archived beside that letter. Slots the queue did not fill take over the
-- scope's work whose worker stopped, or that an operator sent back after a
-- fix (agent.idempotency_redrive), answered as redriven with their payload.
-- A message may name its organization_id; it must be one of p_organizations
-- (p_organization_id alone by default). The tokens are the caller's, one per
-- slot, as a claim's; a lost answer leaves what it took to its lease, as a
-- worker that stopped would. p_traceparent, the consumer's W3C traceparent,
-- is stored with each claim the take makes; claimed, reclaimed and redriven
-- items answer the trace that first claimed them. Needs the pgmq privileges
-- that agent.idempotency_queue_privileges lists.

CREATE FUNCTION agent.idempotency_queue_take(p_queue text, p_dead_letter_queue text, p_organization_id uuid, p_lease_ms bigint, p_lease_tokens uuid[], p_max_reads integer DEFAULT 5, p_scope text DEFAULT NULL::text, p_organizations uuid[] DEFAULT NULL::uuid[], p_row_cap integer DEFAULT NULL::integer, p_traceparent text DEFAULT NULL::text) RETURNS SETOF agent.idempotency_queue_item
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $_$
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
  v_traceparent text := agent.idempotency_check_traceparent(p_traceparent, 'p_traceparent');
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
               null, false, false, v_reason, null, null)::agent.idempotency_queue_item;
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
             'request', v_items[i].payload, 'traceparent', v_traceparent) order by i)
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
          v_items[v_index].traceparent := v_claim.traceparent;
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
                               false, false, null, null, v_work.traceparent)::agent.idempotency_queue_item;
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
$_$;

ALTER FUNCTION agent.idempotency_queue_take(p_queue text, p_dead_letter_queue text, p_organization_id uuid, p_lease_ms bigint, p_lease_tokens uuid[], p_max_reads integer, p_scope text, p_organizations uuid[], p_row_cap integer, p_traceparent text) OWNER TO idempotency_owner;
