-- agent.idempotency_completion_item
--
-- One item of agent.idempotency_complete_many's answer: completed, and the
-- completed claim where the fence held.

CREATE TYPE agent.idempotency_completion_item AS (
	item integer,
	completed boolean,
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

ALTER TYPE agent.idempotency_completion_item OWNER TO idempotency_owner;
