-- agent.idempotency_claim_outcome
--
-- What a claim answers: outcome (claimed, reclaimed, completed, processing,
-- conflict; reclaimable where the caller may not take over, as for
-- agent.idempotency_try_claim, never from agent.idempotency_claim) and the
-- claim. Only claimed and reclaimed carry the lease token; processing and
-- conflict carry no response or resource, conflict not the stored hash;
-- traceparent, to claimed and reclaimed alone, the trace that first claimed
-- the key.

CREATE TYPE agent.idempotency_claim_outcome AS (
	outcome text,
	id uuid,
	organization_id uuid,
	scope text,
	key text,
	request_hash text,
	status text,
	lease_token uuid,
	resource_type text,
	resource_id text,
	response jsonb,
	claimed_at timestamp with time zone,
	lease_expires_at timestamp with time zone,
	retain_until timestamp with time zone,
	lease_live boolean,
	traceparent text
);

ALTER TYPE agent.idempotency_claim_outcome OWNER TO idempotency_owner;
