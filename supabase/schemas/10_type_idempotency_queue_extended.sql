-- agent.idempotency_queue_extended
--
-- One item's heartbeat as agent.idempotency_queue_extend answers it.

CREATE TYPE agent.idempotency_queue_extended AS (
	item integer,
	lease_expires_at timestamp with time zone
);

ALTER TYPE agent.idempotency_queue_extended OWNER TO idempotency_owner;
