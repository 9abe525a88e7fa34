-- agent.runs
--
-- Admitted Runs: the unique (organization_id, start_key) is the Run's claim,
-- and a replay finds the Run admitted first.

CREATE TABLE agent.runs (
    id uuid DEFAULT gen_random_uuid() NOT NULL,
    organization_id uuid NOT NULL,
    start_key text NOT NULL,
    input jsonb NOT NULL,
    status text DEFAULT 'admitted'::text NOT NULL,
    admitted_at timestamp with time zone DEFAULT now() NOT NULL,
    retain_until timestamp with time zone DEFAULT (now() + '396 days'::interval) NOT NULL,
    admission_token uuid,
    max_run_duration interval,
    CONSTRAINT runs_max_run_duration_cap CHECK (((max_run_duration IS NULL) OR ((max_run_duration > '00:00:00'::interval) AND (max_run_duration <= '30 days'::interval)))),
    CONSTRAINT runs_start_key_length CHECK (((char_length(start_key) >= 1) AND (char_length(start_key) <= 512))),
    CONSTRAINT runs_status_check CHECK ((status = ANY (ARRAY['admitted'::text, 'running'::text, 'succeeded'::text, 'failed'::text, 'cancelled'::text])))
);

ALTER TABLE agent.runs OWNER TO idempotency_owner;

COMMENT ON TABLE agent.runs IS 'Admitted Runs. The unique (organization_id, start_key) is the Run claim; replays find the admitted Run.';

COMMENT ON COLUMN agent.runs.max_run_duration IS 'The longest this Run may take, set by its definition: above zero, at most 30 days (every tool claim is kept 30 days, so a Run''s replay journal outlives it).';

ALTER TABLE ONLY agent.runs
    ADD CONSTRAINT runs_org_start_key_key UNIQUE (organization_id, start_key);

ALTER TABLE ONLY agent.runs
    ADD CONSTRAINT runs_pkey PRIMARY KEY (id);

ALTER TABLE agent.runs ENABLE ROW LEVEL SECURITY;
