-- agent.idempotency_redrivable
--
-- Whether each named claim can be sent back to re-drive, and why not
-- (public), for operators: the answer to "I sent it back and nothing
-- happened". One row per id of p_claim_ids, in their order, with the
-- claim's scope, key, status, error and attempts when it exists, and
-- `reason`: redrivable (idempotency_redrive_failed would send it back), or
-- absent (no claim has this id: never made, released, or swept),
-- other_organization / other_scope / before_since (outside the filters
-- given, as idempotency_redrive_failed would read them), in_flight (a
-- worker holds a live lease), orphaned (processing with its lease passed:
-- waiting for a re-drive, which takes it as it is, a failure sent back
-- included), succeeded (journaled a success: nothing to run again),
-- no_work (a failure whose work is not kept: nothing can run it again),
-- single_attempt (its scope's max_attempts is 1, or it lost its policy).
-- At most the row cap of ids. Never writes.

CREATE FUNCTION agent.idempotency_redrivable(p_claim_ids uuid[], p_scope text DEFAULT NULL::text, p_organization_id uuid DEFAULT NULL::uuid, p_since timestamp with time zone DEFAULT NULL::timestamp with time zone, p_row_cap integer DEFAULT NULL::integer) RETURNS TABLE(claim_id uuid, organization_id uuid, scope text, key text, status text, error text, attempts integer, claimed_at timestamp with time zone, reason text)
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
declare
  v_prefix text;
  v_cap integer := agent.idempotency_row_cap(p_row_cap);
begin
  if p_claim_ids is null or cardinality(p_claim_ids) = 0 or array_position(p_claim_ids, null) is not null then
    raise exception 'p_claim_ids must name at least one claim, and no NULL' using errcode = '22023';
  end if;
  if cardinality(p_claim_ids) > v_cap then
    raise exception 'p_claim_ids may name at most the row cap %, got %', v_cap, cardinality(p_claim_ids)
      using errcode = '22023';
  end if;
  if p_scope is not null then
    v_prefix := agent.idempotency_failures_scope(p_scope, 1, p_row_cap);
  end if;
  return query
    select c.id, k.organization_id, k.scope, k.key, k.status, k.response ->> 'error', k.reclaims + 1, k.claimed_at,
           case
             when k.id is null then 'absent'
             when p_organization_id is not null and k.organization_id <> p_organization_id then 'other_organization'
             when p_scope is not null and k.scope <> p_scope
                  and (v_prefix is null or left(k.scope, char_length(v_prefix)) <> v_prefix) then 'other_scope'
             when k.status = 'processing' and k.lease_expires_at > pg_catalog.clock_timestamp() then 'in_flight'
             when k.status = 'processing' then 'orphaned'
             when k.response -> 'ok' is distinct from 'false'::jsonb then 'succeeded'
             when k.request is null then 'no_work'
             when p.retain is null or p.max_attempts <= 1 then 'single_attempt'
             when p_since is not null and k.claimed_at < p_since then 'before_since'
             else 'redrivable'
           end
      from unnest(p_claim_ids) with ordinality c(id, n)
      left join agent.idempotency_keys k on k.id = c.id
      left join lateral agent.idempotency_policy(k.scope) p on true
     order by c.n;
end
$$;

ALTER FUNCTION agent.idempotency_redrivable(p_claim_ids uuid[], p_scope text, p_organization_id uuid, p_since timestamp with time zone, p_row_cap integer) OWNER TO idempotency_owner;
