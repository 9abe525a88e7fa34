-- agent.idempotency_replays
--
-- How many claims were answered from the journal (replays), when and in
-- which scope: a replay writes nothing to agent.idempotency_keys, so the
-- console's plot of replays over time reads it here. Append-only and
-- UNLOGGED (no WAL, no replica; emptied by a crash, which a plot can
-- afford); the sweep trims rows older than 7 days. Written and read only
-- through the functions.

CREATE UNLOGGED TABLE agent.idempotency_replays (
    at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    scope text NOT NULL,
    replays integer DEFAULT 1 NOT NULL,
    CONSTRAINT idempotency_replays_replays_positive CHECK ((replays >= 1))
);

ALTER TABLE agent.idempotency_replays OWNER TO idempotency_owner;

COMMENT ON TABLE agent.idempotency_replays IS 'Claims answered from the journal (replays), counted for agent.idempotency_activity. Unlogged; trimmed to 7 days by the sweep.';

CREATE INDEX idempotency_replays_at_idx ON agent.idempotency_replays USING brin (at);

ALTER TABLE agent.idempotency_replays ENABLE ROW LEVEL SECURITY;
