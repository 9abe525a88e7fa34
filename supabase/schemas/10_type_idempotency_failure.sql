-- agent.idempotency_failure
--
-- A journaled failure as agent.idempotency_failures and
-- agent.idempotency_redrive_failed answer it.

CREATE TYPE agent.idempotency_failure AS (
	id uuid,
	organization_id uuid,
	scope text,
	key text,
	status text,
	error text,
	response jsonb,
	resource_type text,
	resource_id text,
	attempts integer,
	claimed_at timestamp with time zone,
	retain_until timestamp with time zone,
	redrivable boolean,
	requeues integer,
	taken integer
);

ALTER TYPE agent.idempotency_failure OWNER TO idempotency_owner;
