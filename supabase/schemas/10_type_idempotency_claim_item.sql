-- agent.idempotency_claim_item
--
-- One item of agent.idempotency_claim_many's answer: its place in the batch
-- (item, 0-based), then what its single claim would answer (traceparent:
-- the trace that first claimed the key, to claimed and reclaimed items).

CREATE TYPE agent.idempotency_claim_item AS (
	item integer,
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

ALTER TYPE agent.idempotency_claim_item OWNER TO idempotency_owner;
