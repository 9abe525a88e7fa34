-- agent.run_admission
--
-- What agent.run_admit and agent.run_get answer: the admitted Run and whether
-- this call admitted it.

CREATE TYPE agent.run_admission AS (
	id uuid,
	organization_id uuid,
	start_key text,
	input jsonb,
	status text,
	admitted_at timestamp with time zone,
	retain_until timestamp with time zone,
	admitted boolean
);

ALTER TYPE agent.run_admission OWNER TO idempotency_owner;
