-- agent.idempotency_rows
--
-- The claim table's columns as a relation an API role may name: the row shape
-- of agent.idempotency_expired and agent.idempotency_cap_probe. It runs with
-- its caller's privileges, so no API role can read the table through it; the
-- functions that answer its rows never answer a lease token.

CREATE VIEW agent.idempotency_rows WITH (security_invoker='true') AS
 SELECT k.id,
    k.organization_id,
    k.scope,
    k.key,
    k.request_hash,
    k.status,
    k.lease_token,
    k.resource_type,
    k.resource_id,
    k.response,
    k.claimed_at,
    k.lease_expires_at,
    k.retain_until,
    k.reclaims
   FROM agent.idempotency_keys k;

ALTER TABLE agent.idempotency_rows OWNER TO idempotency_owner;
