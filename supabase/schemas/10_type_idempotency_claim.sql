-- agent.idempotency_claim
--
-- A claim as the functions answer it: the row's columns an answer needs (not
-- the stored request, the reclaim count, the re-drive time or the audit of
-- replaced failures), plus lease_live (processing and its lease not passed,
-- by the database clock).

CREATE TYPE agent.idempotency_claim AS (
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
	lease_live boolean
);

ALTER TYPE agent.idempotency_claim OWNER TO idempotency_owner;
