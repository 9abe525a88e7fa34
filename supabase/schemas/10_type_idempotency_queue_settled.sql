-- agent.idempotency_queue_settled
--
-- One item's ending as agent.idempotency_queue_settle answers it.

CREATE TYPE agent.idempotency_queue_settled AS (
	item integer,
	journaled boolean,
	archived integer,
	dead_lettered boolean
);

ALTER TYPE agent.idempotency_queue_settled OWNER TO idempotency_owner;
