-- agent.idempotency_sweep_report
--
-- One pass of agent.idempotency_sweep: rows read, deleted, the bound, and
-- whether the read filled it.

CREATE TYPE agent.idempotency_sweep_report AS (
	read integer,
	deleted integer,
	bound integer,
	filled boolean,
	dead_lettered integer
);

ALTER TYPE agent.idempotency_sweep_report OWNER TO idempotency_owner;
