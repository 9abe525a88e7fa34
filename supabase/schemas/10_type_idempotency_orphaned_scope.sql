-- agent.idempotency_orphaned_scope
--
-- Per scope, the claims still processing whose lease passed and that carry
-- work: agent.idempotency_orphans' answer.

CREATE TYPE agent.idempotency_orphaned_scope AS (
	scope text,
	orphans bigint,
	oldest timestamp with time zone,
	waited_ms bigint
);

ALTER TYPE agent.idempotency_orphaned_scope OWNER TO idempotency_owner;
