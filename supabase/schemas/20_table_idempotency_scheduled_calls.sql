-- agent.idempotency_scheduled_calls
--
-- The HTTP calls scheduled jobs make to the plane's routes (pg_cron jobs
-- calling an Edge Function with pg_net), and what each was answered.
-- pg_cron reports a pg_net call succeeded whatever its HTTP status, and
-- pg_net keeps answers 6 hours: the recipes of sql/recipes/ record every
-- call here, with the answers of earlier ones, so a failed call stays where
-- idem doctor reads it. Written and read only through the functions; kept
-- 7 days.

CREATE TABLE agent.idempotency_scheduled_calls (
    request_id bigint NOT NULL,
    job text NOT NULL,
    called_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    answered_at timestamp with time zone,
    status_code integer,
    error text,
    CONSTRAINT idempotency_scheduled_calls_error_length CHECK ((char_length(error) <= 2000)),
    CONSTRAINT idempotency_scheduled_calls_job_length CHECK (((char_length(job) >= 1) AND (char_length(job) <= 200)))
);

ALTER TABLE agent.idempotency_scheduled_calls OWNER TO idempotency_owner;

COMMENT ON TABLE agent.idempotency_scheduled_calls IS 'HTTP calls of scheduled jobs (pg_cron with pg_net) and their answers, which pg_cron does not judge: read by agent.idempotency_scheduled_failures and idem doctor.';

ALTER TABLE ONLY agent.idempotency_scheduled_calls
    ADD CONSTRAINT idempotency_scheduled_calls_pkey PRIMARY KEY (request_id);

CREATE INDEX idempotency_scheduled_calls_called_at_idx ON agent.idempotency_scheduled_calls USING btree (called_at);

ALTER TABLE agent.idempotency_scheduled_calls ENABLE ROW LEVEL SECURITY;
