-- agent.idempotency_queue_ending
--
-- One item of a queue settle or extend, checked (private): the claim, its
-- messages (empty for a re-driven claim) and, for a settle, its ending.

CREATE TYPE agent.idempotency_queue_ending AS (
	item integer,
	organization_id uuid,
	claim_id uuid,
	lease_token uuid,
	msg_ids bigint[],
	ending text,
	response jsonb,
	resource_type text,
	resource_id text
);

ALTER TYPE agent.idempotency_queue_ending OWNER TO idempotency_owner;
