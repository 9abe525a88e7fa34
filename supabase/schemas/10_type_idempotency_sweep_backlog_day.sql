-- agent.idempotency_sweep_backlog_day
--
-- Claims past their retention that the sweep has not retired yet, by the
-- day (UTC) their retention ended: agent.idempotency_sweep_backlog's answer.

CREATE TYPE agent.idempotency_sweep_backlog_day AS (
	retain_date date,
	rows bigint
);

ALTER TYPE agent.idempotency_sweep_backlog_day OWNER TO idempotency_owner;
