-- The queue in one transaction with the journal.
--
-- Queue consumers (Rust and TypeScript) read pgmq through Supabase's
-- pgmq_public, claimed in a second request, journaled in a third and
-- archived one message per request: a consumer stopped between journal and
-- archive left a message to be delivered again, a failed command was one
-- dead letter per copy, a message no client could read (1e400) stopped its
-- whole batch, and a failure could not be run again after a fix, since no
-- claim kept its message.
--
-- Now the plane takes and settles messages itself, where pgmq is installed
-- and the plane's owner may reach the queue (docs/queues.md lists the
-- privileges, per queue):
--   agent.idempotency_queue_take    reads a batch and claims each message
--                                   under its key in the same transaction,
--                                   storing its payload as the claim's work;
--                                   dead-letters what no client can read
--   agent.idempotency_queue_settle  journals the batch's endings and
--                                   archives exactly the messages whose
--                                   ending it journaled, one transaction;
--                                   a failed command is one dead letter
--   agent.idempotency_queue_extend  a heartbeat that keeps the messages
--                                   hidden as long as their claims' leases
--   agent.idempotency_request_hash  a JSON value's request hash (SHA-256 of
--                                   its RFC 8785 form), as clients take it
-- agent.idempotency_keys gains dead_lettered_at (when a failure was sent
-- to a dead-letter queue), and agent.idempotency_complete drops the work a
-- claim carries when it journals a success: only a failure may be sent
-- back to run again. The work and answer columns take lz4 where the server
-- has it.

ALTER TABLE agent.idempotency_keys ADD COLUMN dead_lettered_at timestamp with time zone;

COMMENT ON COLUMN agent.idempotency_keys.dead_lettered_at IS 'When the failure journaled for this key was sent to a dead-letter queue: a copy of the command that failed is archived beside that letter, never sent again.';

-- The work a claim carries and its answer take lz4 where the server was
-- built with it (quicker than pglz, as compact on JSON); pglz, PostgreSQL's
-- default, where it was not.
DO $$
begin
  alter table agent.idempotency_keys
    alter column request set compression lz4,
    alter column response set compression lz4;
exception when feature_not_supported then
  null;
end
$$;

CREATE TYPE agent.idempotency_queue_item AS (
	msg_id bigint,
	read_ct integer,
	enqueued_at timestamp with time zone,
	message jsonb,
	organization_id uuid,
	key text,
	outcome text,
	copy_of bigint,
	id uuid,
	lease_token uuid,
	lease_expires_at timestamp with time zone,
	retain_until timestamp with time zone,
	lease_live boolean,
	attempt integer,
	payload jsonb,
	response jsonb,
	archived boolean,
	dead_lettered boolean,
	reason text,
	taken integer
);

ALTER TYPE agent.idempotency_queue_item OWNER TO idempotency_owner;

CREATE TYPE agent.idempotency_queue_settled AS (
	item integer,
	journaled boolean,
	archived integer,
	dead_lettered boolean
);

ALTER TYPE agent.idempotency_queue_settled OWNER TO idempotency_owner;

CREATE TYPE agent.idempotency_queue_extended AS (
	item integer,
	lease_expires_at timestamp with time zone
);

ALTER TYPE agent.idempotency_queue_extended OWNER TO idempotency_owner;

CREATE FUNCTION agent.idempotency_json_number(p_number numeric) RETURNS text
    LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
    SET search_path TO ''
    SET extra_float_digits TO '1'
    AS $$
declare
  v_text text;
  v_parts text[];
  v_digits text;
  v_sign text := '';
  v_point integer;
  v_length integer;
begin
  -- 2^1024 - 2^970: from here on, the nearest double is infinity.
  if pg_catalog.abs(p_number) >= 179769313486231580793728971405303415079934132710037826936173778980444968292764750946649017977587207096330286416692887910946555547851940402630657488671505820681908902000708383676273854845817711531764475730270069855571366959622842914819860834936475292719074168444365510704342711559699508093042880177904174497792 then
    raise exception 'the number % is beyond every IEEE 754 double: a JSON reader reads it as infinity',
                    pg_catalog.left(p_number::text, 24) || case when pg_catalog.char_length(p_number::text) > 24 then '...' else '' end
      using errcode = '22003';
  end if;
  -- At most 2^-1075 (half the least double) rounds to zero.
  if p_number = 0 or pg_catalog.abs(p_number) * 404804506614621236704990693437834614099113299528284236713802716054860679135990693783920767402874248990374155728633623822779617474771586953734026799881477019843034848553132722728933815484186432682479535356945490137124014966849385397236206711298319112681620113024717539104666829230461005064372655017292012526615415482186989568 <= 1 then
    return '0';
  end if;
  -- PostgreSQL writes a double with the fewest digits that read back as
  -- it (extra_float_digits > 0); what follows only moves the point.
  v_text := p_number::double precision::text;
  if pg_catalog.left(v_text, 1) = '-' then
    v_sign := '-';
    v_text := pg_catalog.substr(v_text, 2);
  end if;
  v_parts := pg_catalog.regexp_match(v_text, '^([0-9]+)(?:\.([0-9]+))?(?:e([+-][0-9]+))?$');
  v_digits := v_parts[1] || coalesce(v_parts[2], '');
  -- The value is 0.<digits> * 10^v_point.
  v_point := pg_catalog.char_length(v_parts[1]) + coalesce(v_parts[3]::integer, 0);
  v_length := pg_catalog.char_length(v_digits);
  v_digits := pg_catalog.ltrim(v_digits, '0');
  v_point := v_point - (v_length - pg_catalog.char_length(v_digits));
  v_digits := pg_catalog.rtrim(v_digits, '0');
  v_length := pg_catalog.char_length(v_digits);
  -- ECMAScript's Number::toString, with k = v_length and n = v_point.
  if v_length <= v_point and v_point <= 21 then
    return v_sign || v_digits || pg_catalog.repeat('0', v_point - v_length);
  elsif 0 < v_point and v_point <= 21 then
    return v_sign || pg_catalog.left(v_digits, v_point) || '.' || pg_catalog.substr(v_digits, v_point + 1);
  elsif -6 < v_point and v_point <= 0 then
    return v_sign || '0.' || pg_catalog.repeat('0', -v_point) || v_digits;
  end if;
  return v_sign || pg_catalog.left(v_digits, 1)
         || case when v_length > 1 then '.' || pg_catalog.substr(v_digits, 2) else '' end
         || 'e' || case when v_point > 0 then '+' else '-' end || pg_catalog.abs(v_point - 1)::text;
end;
$$;

ALTER FUNCTION agent.idempotency_json_number(p_number numeric) OWNER TO idempotency_owner;

CREATE FUNCTION agent.idempotency_utf16_order(p_key text) RETURNS bytea
    LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
    SET search_path TO ''
    AS $$
declare
  v_bytes bytea := pg_catalog.convert_to(p_key, 'UTF8');
begin
  for i in 0 .. pg_catalog.length(v_bytes) - 1 loop
    case pg_catalog.get_byte(v_bytes, i)
      when 238 then v_bytes := pg_catalog.set_byte(v_bytes, i, 245);
      when 239 then v_bytes := pg_catalog.set_byte(v_bytes, i, 246);
      else null;
    end case;
  end loop;
  return v_bytes;
end;
$$;

ALTER FUNCTION agent.idempotency_utf16_order(p_key text) OWNER TO idempotency_owner;

CREATE FUNCTION agent.idempotency_canonical_json(p_value jsonb) RETURNS text
    LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
    SET search_path TO ''
    AS $$
declare
  v_out text;
  v_type text := pg_catalog.jsonb_typeof(p_value);
begin
  if v_type = 'object' then
    select pg_catalog.string_agg(
             pg_catalog.to_jsonb(e.key)::text || ':' ||
             case pg_catalog.jsonb_typeof(e.value)
               when 'object' then agent.idempotency_canonical_json(e.value)
               when 'array' then agent.idempotency_canonical_json(e.value)
               when 'number' then
                 case when e.value::text ~ '^-?(0|[1-9][0-9]{0,14})(\.[0-9]{0,14})?$'
                           and pg_catalog.char_length(pg_catalog.rtrim(pg_catalog.replace(pg_catalog.ltrim(e.value::text, '-0'), '.', ''), '0')) <= 15
                           and (pg_catalog.abs(e.value::numeric) >= 0.000001 or e.value::numeric = 0)
                      then pg_catalog.trim_scale(e.value::numeric)::text
                      else agent.idempotency_json_number(e.value::numeric) end
               else e.value::text
             end,
             ',' order by case when e.key ~ '[\uE000-\uFFFF]' then agent.idempotency_utf16_order(e.key)
                              else pg_catalog.convert_to(e.key, 'UTF8') end)
      into v_out
      from pg_catalog.jsonb_each(p_value) e;
    return '{' || coalesce(v_out, '') || '}';
  elsif v_type = 'array' then
    select pg_catalog.string_agg(
             case pg_catalog.jsonb_typeof(e.value)
               when 'object' then agent.idempotency_canonical_json(e.value)
               when 'array' then agent.idempotency_canonical_json(e.value)
               when 'number' then
                 case when e.value::text ~ '^-?(0|[1-9][0-9]{0,14})(\.[0-9]{0,14})?$'
                           and pg_catalog.char_length(pg_catalog.rtrim(pg_catalog.replace(pg_catalog.ltrim(e.value::text, '-0'), '.', ''), '0')) <= 15
                           and (pg_catalog.abs(e.value::numeric) >= 0.000001 or e.value::numeric = 0)
                      then pg_catalog.trim_scale(e.value::numeric)::text
                      else agent.idempotency_json_number(e.value::numeric) end
               else e.value::text
             end,
             ',' order by e.position)
      into v_out
      from pg_catalog.jsonb_array_elements(p_value) with ordinality e(value, position);
    return '[' || coalesce(v_out, '') || ']';
  elsif v_type = 'number' then
    return agent.idempotency_json_number(p_value::numeric);
  end if;
  return p_value::text;
end;
$$;

ALTER FUNCTION agent.idempotency_canonical_json(p_value jsonb) OWNER TO idempotency_owner;

CREATE FUNCTION agent.idempotency_request_hash(p_value jsonb) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    SET search_path TO ''
    AS $$
  select pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(agent.idempotency_canonical_json(p_value), 'UTF8')), 'hex')
$$;

ALTER FUNCTION agent.idempotency_request_hash(p_value jsonb) OWNER TO idempotency_owner;

CREATE FUNCTION agent.idempotency_queue_check(p_name text, p_argument text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
    SET search_path TO ''
    AS $$
begin
  if p_name is null or p_name !~ '^[a-z0-9_]{1,47}$' then
    raise exception '% must be a pgmq queue name (1 to 47 characters of a-z, 0-9 and _), got %',
                    p_argument, pg_catalog.left(p_name, 64)
      using errcode = '22023';
  end if;
end
$$;

ALTER FUNCTION agent.idempotency_queue_check(p_name text, p_argument text) OWNER TO idempotency_owner;

CREATE FUNCTION agent.idempotency_queue_letter(p_queue text, p_dead_letter_queue text, p_msg_id bigint, p_read_ct integer, p_message jsonb, p_failure jsonb) RETURNS void
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $$
begin
  if p_failure ->> 'error' = 'malformed_message' then
    -- What no client could read goes on as text, so the dead-letter queue
    -- stays readable by every client.
    perform pgmq.send(p_dead_letter_queue,
                      pg_catalog.jsonb_build_object(
                        'dead_letter', pg_catalog.jsonb_build_object(
                          'queue', p_queue, 'msg_id', p_msg_id, 'reads', p_read_ct, 'message_text', p_message::text,
                          'failure', pg_catalog.jsonb_build_object(
                            'ok', false, 'error', p_failure -> 'error', 'output', p_failure -> 'output'))));
    return;
  end if;
  perform pgmq.send(p_dead_letter_queue,
                    case when pg_catalog.jsonb_typeof(p_message) = 'object' then p_message else '{}'::jsonb end
                    || pg_catalog.jsonb_build_object(
                         'dead_letter', pg_catalog.jsonb_build_object(
                           'queue', p_queue, 'msg_id', p_msg_id, 'reads', p_read_ct, 'message', p_message,
                           'failure', pg_catalog.jsonb_build_object(
                             'ok', false, 'error', p_failure -> 'error', 'output', p_failure -> 'output'))));
end
$$;

ALTER FUNCTION agent.idempotency_queue_letter(p_queue text, p_dead_letter_queue text, p_msg_id bigint, p_read_ct integer, p_message jsonb, p_failure jsonb) OWNER TO idempotency_owner;

CREATE FUNCTION agent.idempotency_queue_items(p_items jsonb, p_row_cap integer, p_endings boolean) RETURNS TABLE(item integer, organization_id uuid, claim_id uuid, lease_token uuid, msg_ids bigint[], ending text, response jsonb, resource_type text, resource_id text)
    LANGUAGE plpgsql STABLE
    SET search_path TO ''
    AS $$
declare
  v_item jsonb;
  v_index integer;
  v_ids bigint[];
  v_ending text;
  v_response jsonb;
  v_type text;
  v_resource text;
begin
  perform agent.idempotency_check_batch(p_items, p_row_cap);
  for v_item, v_index in select e.value, (e.ordinality - 1)::integer
                           from pg_catalog.jsonb_array_elements(p_items) with ordinality e loop
    perform agent.idempotency_check_item(v_item, v_index);
    if pg_catalog.jsonb_typeof(v_item -> 'msg_ids') is distinct from 'array'
       or pg_catalog.jsonb_path_exists(v_item -> 'msg_ids',
                                       'strict $[*] ? (@.type() != "number" || @ < 1 || @ > 9223372036854775807 || @.floor() != @)') then
      raise exception 'p_items[%].msg_ids must be an array of message ids (empty for a re-driven claim)', v_index
        using errcode = '22023';
    end if;
    select coalesce(pg_catalog.array_agg(e.value::text::bigint order by e.ordinality), '{}')
      into v_ids
      from pg_catalog.jsonb_array_elements(v_item -> 'msg_ids') with ordinality e;
    v_ending := null;
    v_response := null;
    v_type := null;
    v_resource := null;
    if p_endings then
      v_ending := agent.idempotency_item_text(v_item, v_index, 'ending', true);
      if v_ending not in ('journal', 'release', 'leave') then
        raise exception 'p_items[%].ending must be journal, release or leave, got %', v_index, pg_catalog.left(v_ending, 40)
          using errcode = '22023';
      end if;
      if v_ending = 'journal' then
        v_type := nullif(agent.idempotency_item_text(v_item, v_index, 'resource_type', false), '');
        v_resource := nullif(agent.idempotency_item_text(v_item, v_index, 'resource_id', false), '');
        v_response := nullif(v_item -> 'response', 'null'::jsonb);
        if v_response is null and v_resource is null then
          raise exception 'p_items[%] is journaled with neither a response nor a resource; a journal carries one', v_index
            using errcode = '22023';
        end if;
      end if;
    end if;
    return query select v_index, agent.idempotency_item_uuid(v_item, v_index, 'organization_id'),
                        agent.idempotency_item_uuid(v_item, v_index, 'claim_id'),
                        agent.idempotency_item_uuid(v_item, v_index, 'lease_token'),
                        v_ids, v_ending, v_response, v_type, v_resource;
  end loop;
end
$$;

ALTER FUNCTION agent.idempotency_queue_items(p_items jsonb, p_row_cap integer, p_endings boolean) OWNER TO idempotency_owner;

CREATE FUNCTION agent.idempotency_queue_lock(p_queue text, p_msg_ids bigint[], p_organizations uuid[], p_claim_ids uuid[]) RETURNS void
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $_$
begin
  if pg_catalog.cardinality(p_msg_ids) > 0 then
    execute pg_catalog.format('select 1 from pgmq.%I q where q.msg_id = any ($1) order by q.msg_id for update',
                              'q_' || p_queue)
      using p_msg_ids;
  end if;
  perform 1
     from agent.idempotency_keys k
     join rows from (pg_catalog.unnest(p_organizations), pg_catalog.unnest(p_claim_ids)) c(organization_id, id)
       on k.organization_id = c.organization_id and k.id = c.id
    order by k.organization_id, k.scope, k.key
      for update of k;
end
$_$;

ALTER FUNCTION agent.idempotency_queue_lock(p_queue text, p_msg_ids bigint[], p_organizations uuid[], p_claim_ids uuid[]) OWNER TO idempotency_owner;

CREATE FUNCTION agent.idempotency_queue_privileges(p_queue text, p_dead_letter_queue text) RETURNS SETOF text
    LANGUAGE plpgsql STABLE
    SET search_path TO ''
    AS $$
begin
  perform agent.idempotency_queue_check(p_queue, 'p_queue');
  perform agent.idempotency_queue_check(p_dead_letter_queue, 'p_dead_letter_queue');
  return next 'grant usage on schema pgmq to idempotency_owner';
  return query
    select pg_catalog.format('grant execute on function %s to idempotency_owner', p.oid::pg_catalog.regprocedure)
      from pg_catalog.pg_proc p
     where p.pronamespace = (select n.oid from pg_catalog.pg_namespace n where n.nspname = 'pgmq')
       and p.proname in ('read', 'archive', 'send', 'set_vt')
     order by p.proname, p.oid::pg_catalog.regprocedure::text;
  return next pg_catalog.format('grant select, update, delete on pgmq.%I to idempotency_owner', 'q_' || p_queue);
  return next pg_catalog.format('grant insert, select (msg_id) on pgmq.%I to idempotency_owner', 'a_' || p_queue);
  return next pg_catalog.format('grant insert, select (msg_id) on pgmq.%I to idempotency_owner',
                                'q_' || p_dead_letter_queue);
end
$$;

ALTER FUNCTION agent.idempotency_queue_privileges(p_queue text, p_dead_letter_queue text) OWNER TO idempotency_owner;

CREATE FUNCTION agent.idempotency_queue_take(p_queue text, p_dead_letter_queue text, p_organization_id uuid, p_lease_ms bigint, p_lease_tokens uuid[], p_max_reads integer DEFAULT 5, p_scope text DEFAULT NULL::text, p_organizations uuid[] DEFAULT NULL::uuid[], p_row_cap integer DEFAULT NULL::integer) RETURNS SETOF agent.idempotency_queue_item
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
      select pg_catalog.min(j) into v_first
        from pg_catalog.generate_subscripts(v_items, 1) j
       where j < v_index and v_items[j].organization_id = v_org and v_items[j].key = v_items[v_index].key
         and v_items[j].id is not null;
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
      select j into v_first from pg_catalog.generate_subscripts(v_items, 1) j where v_items[j].msg_id = v_items[i].copy_of;
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
                      pg_catalog.jsonb_build_object('idempotency_key', v_work.key, 'payload', v_body),
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

ALTER FUNCTION agent.idempotency_queue_take(p_queue text, p_dead_letter_queue text, p_organization_id uuid, p_lease_ms bigint, p_lease_tokens uuid[], p_max_reads integer, p_scope text, p_organizations uuid[], p_row_cap integer) OWNER TO idempotency_owner;

CREATE FUNCTION agent.idempotency_queue_settle(p_queue text, p_dead_letter_queue text, p_items jsonb, p_row_cap integer DEFAULT NULL::integer) RETURNS SETOF agent.idempotency_queue_settled
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $_$
declare
  v_item record;
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
  select pg_catalog.array_agg(i.organization_id order by i.item), pg_catalog.array_agg(i.claim_id order by i.item)
    into v_orgs, v_claims
    from agent.idempotency_queue_items(p_items, p_row_cap, true) i;
  select coalesce(pg_catalog.array_agg(distinct m order by m), '{}') into v_locked
    from agent.idempotency_queue_items(p_items, p_row_cap, true) i
   cross join lateral pg_catalog.unnest(i.msg_ids) m
   where i.ending = 'journal';
  perform agent.idempotency_queue_lock(p_queue, v_locked, v_orgs, v_claims);

  begin
    for v_item in select * from agent.idempotency_queue_items(p_items, p_row_cap, true) order by item loop
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
                      coalesce(v_body, pg_catalog.jsonb_build_object('idempotency_key', v_key, 'payload', v_request)),
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
$_$;

ALTER FUNCTION agent.idempotency_queue_settle(p_queue text, p_dead_letter_queue text, p_items jsonb, p_row_cap integer) OWNER TO idempotency_owner;

CREATE FUNCTION agent.idempotency_queue_extend(p_queue text, p_lease_ms bigint, p_items jsonb, p_row_cap integer DEFAULT NULL::integer) RETURNS SETOF agent.idempotency_queue_extended
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $_$
declare
  v_item record;
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
  select pg_catalog.array_agg(i.organization_id order by i.item), pg_catalog.array_agg(i.claim_id order by i.item),
         coalesce(pg_catalog.array_agg(distinct m order by m) filter (where m is not null), '{}')
    into v_orgs, v_claims, v_locked
    from agent.idempotency_queue_items(p_items, p_row_cap, false) i
    left join lateral pg_catalog.unnest(i.msg_ids) m on true;
  perform agent.idempotency_queue_lock(p_queue, v_locked, v_orgs, v_claims);
  for v_item in select * from agent.idempotency_queue_items(p_items, p_row_cap, false) order by item loop
    v_end := agent.idempotency_extend(v_item.claim_id, v_item.lease_token, p_lease_ms, v_item.organization_id);
    if v_end is not null then
      for i in 1 .. coalesce(pg_catalog.cardinality(v_item.msg_ids), 0) loop
        perform pgmq.set_vt(p_queue, v_item.msg_ids[i], v_visible);
      end loop;
    end if;
    return next (v_item.item, v_end)::agent.idempotency_queue_extended;
  end loop;
end
$_$;

ALTER FUNCTION agent.idempotency_queue_extend(p_queue text, p_lease_ms bigint, p_items jsonb, p_row_cap integer) OWNER TO idempotency_owner;

CREATE OR REPLACE FUNCTION agent.idempotency_complete(p_claim_id uuid, p_lease_token uuid, p_resource_type text DEFAULT NULL::text, p_resource_id text DEFAULT NULL::text, p_response jsonb DEFAULT NULL::jsonb, p_organization_id uuid DEFAULT NULL::uuid) RETURNS SETOF agent.idempotency_claim
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $_$
declare
  v_resource_type text := nullif(p_resource_type, '');
  v_resource_id   text := nullif(p_resource_id, '');
  v_response      jsonb := nullif(p_response, 'null'::jsonb);
  r agent.idempotency_keys;
  v_organization_id uuid := p_organization_id;
  v_scope text;
  v_limit integer;
  v_size bigint;
begin
  if p_claim_id is null then
    raise exception 'p_claim_id is required' using errcode = '22023';
  end if;
  if p_lease_token is null then
    raise exception 'p_lease_token is required' using errcode = '22023';
  end if;
  if v_response is null and v_resource_id is null then
    raise exception 'a completion carries a response or a resource; this one carries neither'
      using errcode = '22023';
  end if;
  if v_resource_id is not null and v_resource_type is null then
    raise exception 'p_resource_id needs p_resource_type, so a reader can tell what it names'
      using errcode = '22023';
  end if;
  if char_length(v_resource_type) > 128 or char_length(v_resource_id) > 512 then
    raise exception 'p_resource_type may have at most 128 characters and p_resource_id at most 512'
      using errcode = '22023';
  end if;

  if v_organization_id is null then
    select k.organization_id into v_organization_id from agent.idempotency_keys k where k.id = p_claim_id;
    if not found then
      return;
    end if;
  end if;

  if v_response is not null then
    v_size := octet_length(v_response::text);
    if v_size >= 130
       and jsonb_path_exists(v_response, 'strict $.**{64} ? (@.type() == "array" || @.type() == "object")') then
      raise exception 'the response nests arrays and objects deeper than 64 levels, more than every client reads back'
        using errcode = 'IDEM3',
              hint = 'flatten the response, or store it elsewhere and complete with its resource';
    end if;
    if v_size > 1024 then
      select k.scope into v_scope
        from agent.idempotency_keys k
       where k.organization_id = v_organization_id and k.id = p_claim_id;
      if not found then
        return;
      end if;
      select p.max_response_bytes into v_limit from agent.idempotency_policy(v_scope) p;
      if v_limit is null then
        raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', v_scope
          using errcode = 'IDEM1';
      end if;
      if v_size > v_limit then
        v_size := agent.idempotency_json_size(v_response);
        if v_size > v_limit then
          raise exception 'the response is % bytes as compact JSON, above the % bytes scope % keeps',
                          v_size, v_limit, v_scope
            using errcode = 'IDEM2',
                  hint = 'store the response elsewhere and complete with its resource (and a reference to it)';
        end if;
      end if;
    end if;
  end if;

  update agent.idempotency_keys as k
     set status = 'completed',
         resource_type = v_resource_type,
         resource_id = v_resource_id,
         response = v_response,
         -- The work a claim carries is kept for a failure, which a fix may
         -- send back to run again; a success needs it no more.
         request = case when v_response -> 'ok' = 'false'::jsonb then k.request end,
         retain_until = greatest(k.retain_until,
                                 pg_catalog.clock_timestamp() + (k.retain_until - k.lease_expires_at)),
         redrive_at = null
   where k.organization_id = v_organization_id
     and k.id = p_claim_id
     and k.lease_token = p_lease_token
     and k.status = 'processing'
  returning k.* into r;

  if not found then
    -- Completed already by this very token: an earlier attempt of this call.
    select k.* into r
      from agent.idempotency_keys k
     where k.organization_id = v_organization_id
       and k.id = p_claim_id
       and k.lease_token = p_lease_token
       and k.status = 'completed'
       and k.resource_type is not distinct from v_resource_type
       and k.resource_id is not distinct from v_resource_id
       and k.response is not distinct from v_response;
  end if;
  if found then
    return next (r.id, r.organization_id, r.scope, r.key, r.request_hash, r.status,
                 r.lease_token, r.resource_type, r.resource_id, r.response, r.claimed_at,
                 r.lease_expires_at, r.retain_until,
                 r.status = 'processing' and r.lease_expires_at > pg_catalog.clock_timestamp())::agent.idempotency_claim;
  end if;
end
$_$;

ALTER FUNCTION agent.idempotency_complete(p_claim_id uuid, p_lease_token uuid, p_resource_type text, p_resource_id text, p_response jsonb, p_organization_id uuid) OWNER TO idempotency_owner;

REVOKE ALL ON TYPE agent.idempotency_queue_extended FROM PUBLIC;
GRANT ALL ON TYPE agent.idempotency_queue_extended TO service_role;

REVOKE ALL ON TYPE agent.idempotency_queue_item FROM PUBLIC;
GRANT ALL ON TYPE agent.idempotency_queue_item TO service_role;

REVOKE ALL ON TYPE agent.idempotency_queue_settled FROM PUBLIC;
GRANT ALL ON TYPE agent.idempotency_queue_settled TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_canonical_json(p_value jsonb) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_json_number(p_number numeric) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_queue_check(p_name text, p_argument text) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_queue_extend(p_queue text, p_lease_ms bigint, p_items jsonb, p_row_cap integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_queue_extend(p_queue text, p_lease_ms bigint, p_items jsonb, p_row_cap integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_queue_items(p_items jsonb, p_row_cap integer, p_endings boolean) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_queue_letter(p_queue text, p_dead_letter_queue text, p_msg_id bigint, p_read_ct integer, p_message jsonb, p_failure jsonb) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_queue_lock(p_queue text, p_msg_ids bigint[], p_organizations uuid[], p_claim_ids uuid[]) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_queue_privileges(p_queue text, p_dead_letter_queue text) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_queue_settle(p_queue text, p_dead_letter_queue text, p_items jsonb, p_row_cap integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_queue_settle(p_queue text, p_dead_letter_queue text, p_items jsonb, p_row_cap integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_queue_take(p_queue text, p_dead_letter_queue text, p_organization_id uuid, p_lease_ms bigint, p_lease_tokens uuid[], p_max_reads integer, p_scope text, p_organizations uuid[], p_row_cap integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_queue_take(p_queue text, p_dead_letter_queue text, p_organization_id uuid, p_lease_ms bigint, p_lease_tokens uuid[], p_max_reads integer, p_scope text, p_organizations uuid[], p_row_cap integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_request_hash(p_value jsonb) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_request_hash(p_value jsonb) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_utf16_order(p_key text) FROM PUBLIC;
