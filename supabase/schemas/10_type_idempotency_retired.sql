-- agent.idempotency_retired
--
-- What agent.idempotency_retire_expired did with the claims past retention
-- it was given: how many it deleted, and how many unfinished ones (work
-- nobody re-drove) it journaled as dead letters instead.

CREATE TYPE agent.idempotency_retired AS (
	deleted integer,
	dead_lettered integer
);

ALTER TYPE agent.idempotency_retired OWNER TO idempotency_owner;
