-- agent.idempotency_replays
--
-- How many claims were answered from the journal (replays), per minute,
-- scope and database backend: a replay writes nothing to
-- agent.idempotency_keys, so the console's plot of replays over time reads
-- it here. A backend runs one transaction at a time, so each counter row is
-- only ever written by one transaction at a time: counting never waits on
-- a lock and never takes part in a deadlock (a prepared transaction of a
-- two-phase commit, which outlives its backend, is the one exception: a
-- new backend given its pid would wait for it to be committed). UNLOGGED (no WAL, no replica;
-- emptied by a crash, which a plot can afford); the sweep trims rows older
-- than 7 days. Written and read only through the functions.

CREATE UNLOGGED TABLE agent.idempotency_replays (
    minute timestamp with time zone NOT NULL,
    scope text NOT NULL,
    backend integer NOT NULL,
    replays bigint DEFAULT 0 NOT NULL,
    CONSTRAINT idempotency_replays_replays_positive CHECK ((replays >= 0))
);

ALTER TABLE agent.idempotency_replays OWNER TO idempotency_owner;

COMMENT ON TABLE agent.idempotency_replays IS 'Claims answered from the journal (replays) per minute, scope and backend, for agent.idempotency_activity. Unlogged; trimmed to 7 days by the sweep.';

ALTER TABLE ONLY agent.idempotency_replays
    ADD CONSTRAINT idempotency_replays_pkey PRIMARY KEY (minute, scope, backend);

ALTER TABLE agent.idempotency_replays ENABLE ROW LEVEL SECURITY;
