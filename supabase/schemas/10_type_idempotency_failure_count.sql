-- agent.idempotency_failure_count
--
-- Per scope, the journaled failures: how many, how many can be sent back
-- (they carry their work), how many went to a dead-letter queue, and the
-- oldest failed claim: agent.idempotency_failure_counts' answer.

CREATE TYPE agent.idempotency_failure_count AS (
	scope text,
	failures bigint,
	redrivable bigint,
	dead_lettered bigint,
	oldest_claimed_at timestamp with time zone
);

ALTER TYPE agent.idempotency_failure_count OWNER TO idempotency_owner;
