-- agent.idempotency_claim_of
--
-- A claim-table row as agent.idempotency_claim, with lease_live by the
-- database clock. Private.

CREATE FUNCTION agent.idempotency_claim_of(k agent.idempotency_keys) RETURNS agent.idempotency_claim
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $$
begin
  return (k.id, k.organization_id, k.scope, k.key, k.request_hash, k.status,
          k.lease_token, k.resource_type, k.resource_id, k.response, k.claimed_at,
          k.lease_expires_at, k.retain_until,
          k.status = 'processing' and k.lease_expires_at > pg_catalog.clock_timestamp())::agent.idempotency_claim;
end
$$;

ALTER FUNCTION agent.idempotency_claim_of(k agent.idempotency_keys) OWNER TO idempotency_owner;
