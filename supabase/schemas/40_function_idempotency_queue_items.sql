-- agent.idempotency_queue_items
--
-- The items of a queue settle or extend, checked whole before anything is
-- written (private): organization_id, claim_id, lease_token and msg_ids (the
-- message and its copies; empty for a re-driven claim), and for a settle the
-- ending (journal with a response or a resource, release, or leave).

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
