-- agent.idempotency_claim
--
-- The one-call claim (public): whether this call runs (claimed, or reclaimed
-- after the lease passed), replays (completed), waits (processing) or is
-- refused (conflict: same key, another request), decided by
-- agent.idempotency_decide. A repeat with the same lease token after a lost
-- answer answers that caller's own claim. p_request is the work the claim
-- carries, for re-drive; p_traceparent the W3C traceparent of the caller's
-- span, stored with the claim so whoever runs the work again links to it.

CREATE FUNCTION agent.idempotency_claim(p_organization_id uuid, p_scope text, p_key text, p_request_hash text, p_lease_token uuid, p_lease_ms bigint, p_request jsonb DEFAULT NULL::jsonb, p_traceparent text DEFAULT NULL::text) RETURNS SETOF agent.idempotency_claim_outcome
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
begin
  return query
    select * from agent.idempotency_decide(p_organization_id, p_scope, p_key, p_request_hash, p_lease_token,
                                           p_lease_ms, null, true, true, p_request, p_traceparent);
end
$$;

ALTER FUNCTION agent.idempotency_claim(p_organization_id uuid, p_scope text, p_key text, p_request_hash text, p_lease_token uuid, p_lease_ms bigint, p_request jsonb, p_traceparent text) OWNER TO idempotency_owner;
