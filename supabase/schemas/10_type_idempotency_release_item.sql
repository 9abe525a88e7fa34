-- agent.idempotency_release_item
--
-- One item of agent.idempotency_release_many's answer: released or not.

CREATE TYPE agent.idempotency_release_item AS (
	item integer,
	released boolean
);

ALTER TYPE agent.idempotency_release_item OWNER TO idempotency_owner;
