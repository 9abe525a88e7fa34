-- agent.idempotency_queue_item
--
-- One message (or re-driven claim) as agent.idempotency_queue_take answers it.

CREATE TYPE agent.idempotency_queue_item AS (
	msg_id bigint,
	read_ct integer,
	enqueued_at timestamp with time zone,
	message jsonb,
	organization_id uuid,
	key text,
	outcome text,
	copy_of bigint,
	id uuid,
	lease_token uuid,
	lease_expires_at timestamp with time zone,
	retain_until timestamp with time zone,
	lease_live boolean,
	attempt integer,
	payload jsonb,
	response jsonb,
	archived boolean,
	dead_lettered boolean,
	reason text,
	taken integer,
	traceparent text
);

ALTER TYPE agent.idempotency_queue_item OWNER TO idempotency_owner;
