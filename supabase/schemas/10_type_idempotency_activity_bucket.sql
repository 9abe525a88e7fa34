-- agent.idempotency_activity_bucket
--
-- One time bucket of agent.idempotency_activity: claims made (by their
-- latest claim time), claims answered from the journal (replays) and
-- failures journaled (by the claim time of the attempt that failed).

CREATE TYPE agent.idempotency_activity_bucket AS (
	bucket timestamp with time zone,
	claims bigint,
	replays bigint,
	failures bigint
);

ALTER TYPE agent.idempotency_activity_bucket OWNER TO idempotency_owner;
