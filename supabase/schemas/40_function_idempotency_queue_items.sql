-- agent.idempotency_queue_items
--
-- The items of a queue settle or extend, checked whole before anything is
-- written (private): organization_id, claim_id, lease_token and msg_ids (the
-- message and its copies; empty for a re-driven claim), and for a settle the
-- ending (journal with a response or a resource, release, or leave). One
-- array, in input order. Every item is checked in one statement; only when
-- one is malformed are the items read again one by one, to say which and
-- what is wrong with it.

CREATE FUNCTION agent.idempotency_queue_items(p_items jsonb, p_row_cap integer, p_endings boolean) RETURNS agent.idempotency_queue_ending[]
    LANGUAGE plpgsql STABLE
    SET search_path TO ''
    AS $_$
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
$_$;

ALTER FUNCTION agent.idempotency_queue_items(p_items jsonb, p_row_cap integer, p_endings boolean) OWNER TO idempotency_owner;
