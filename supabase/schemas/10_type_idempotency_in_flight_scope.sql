-- agent.idempotency_in_flight_scope
--
-- Per scope, the claims still processing: how many, how many under a live
-- lease, how many are orphans waiting for a re-drive (lease passed, carrying
-- work), and the oldest claim and lease among them: agent.idempotency_in_flight's
-- answer.

CREATE TYPE agent.idempotency_in_flight_scope AS (
	scope text,
	processing bigint,
	live bigint,
	orphans bigint,
	oldest_claimed_at timestamp with time zone,
	oldest_lease_expires_at timestamp with time zone
);

ALTER TYPE agent.idempotency_in_flight_scope OWNER TO idempotency_owner;
