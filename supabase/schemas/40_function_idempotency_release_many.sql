-- agent.idempotency_release_many
--
-- Releases a batch (public): one row per item, in order.

CREATE FUNCTION agent.idempotency_release_many(p_organization_id uuid, p_items jsonb, p_row_cap integer DEFAULT NULL::integer) RETURNS SETOF agent.idempotency_release_item
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

ALTER FUNCTION agent.idempotency_release_many(p_organization_id uuid, p_items jsonb, p_row_cap integer) OWNER TO idempotency_owner;
