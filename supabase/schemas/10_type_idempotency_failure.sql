-- agent.idempotency_failure
--
-- A journaled failure as agent.idempotency_failures and
-- agent.idempotency_redrive_failed answer it. claimed_at is the latest
-- attempt's claim; first_claimed_at the claim of the first attempt that
-- failed, kept however often the failure is sent back and fails again;
-- traceparent the trace that first claimed the key.

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
	taken integer,
	first_claimed_at timestamp with time zone,
	traceparent text
);

ALTER TYPE agent.idempotency_failure OWNER TO idempotency_owner;
