-- agent.idempotency_complete_many
--
-- Completes a batch (public), each item fenced by its own token: one row per
-- item, in order.

CREATE FUNCTION agent.idempotency_complete_many(p_organization_id uuid, p_items jsonb, p_row_cap integer DEFAULT NULL::integer) RETURNS SETOF agent.idempotency_completion_item
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

ALTER FUNCTION agent.idempotency_complete_many(p_organization_id uuid, p_items jsonb, p_row_cap integer) OWNER TO idempotency_owner;
