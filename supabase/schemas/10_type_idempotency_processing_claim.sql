-- agent.idempotency_processing_claim
--
-- A claim still processing, as agent.idempotency_processing answers it for an
-- operator: never its lease token or its work, but version, a digest of the
-- claim's state (token, lease end, attempt) that agent.idempotency_abandon
-- compares so it ends only the claim the operator saw.

CREATE TYPE agent.idempotency_processing_claim AS (
	id uuid,
	organization_id uuid,
	scope text,
	key text,
	claimed_at timestamp with time zone,
	lease_expires_at timestamp with time zone,
	lease_live boolean,
	attempt integer,
	carries_work boolean,
	version text
);

ALTER TYPE agent.idempotency_processing_claim OWNER TO idempotency_owner;
