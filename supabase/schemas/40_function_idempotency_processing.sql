-- agent.idempotency_processing
--
-- The claims still processing in a scope, a family (webhook.*) or every
-- scope (*) (public), oldest claim first, at most p_limit (1 to the row cap):
-- for an operator to find a stuck claim. Answers no lease token and no work;
-- version is what agent.idempotency_abandon compares. Never writes.

CREATE FUNCTION agent.idempotency_processing(p_scope text, p_limit integer) RETURNS SETOF agent.idempotency_processing_claim
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
declare
  v_prefix text;
begin
  v_prefix := agent.idempotency_failures_scope(p_scope, p_limit, null);
  return query
    select k.id, k.organization_id, k.scope, k.key, k.claimed_at, k.lease_expires_at,
           k.lease_expires_at > pg_catalog.clock_timestamp(), k.reclaims + 1, k.request is not null,
           agent.idempotency_version(k.lease_token, k.lease_expires_at, k.reclaims)
      from agent.idempotency_keys k
     where k.status = 'processing'
       and (k.scope = p_scope or (v_prefix is not null and left(k.scope, char_length(v_prefix)) = v_prefix))
     order by k.claimed_at, k.id
     limit p_limit;
end
$$;

ALTER FUNCTION agent.idempotency_processing(p_scope text, p_limit integer) OWNER TO idempotency_owner;
