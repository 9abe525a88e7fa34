-- agent.provider_jobs
--
-- Jobs started at providers that answer by callback: (provider, job_id) to
-- the organization that started it, so a callback finds its claim.

CREATE TABLE agent.provider_jobs (
    id uuid DEFAULT gen_random_uuid() NOT NULL,
    organization_id uuid NOT NULL,
    provider text NOT NULL,
    job_id text NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT provider_jobs_job_id_length CHECK (((char_length(job_id) >= 1) AND (char_length(job_id) <= 512))),
    CONSTRAINT provider_jobs_provider_shape CHECK ((provider ~ '^[a-z0-9_-]{1,64}$'::text))
);

ALTER TABLE agent.provider_jobs OWNER TO idempotency_owner;

COMMENT ON TABLE agent.provider_jobs IS 'Jobs started at providers that answer by callback; maps (provider, job_id) to its organization.';

ALTER TABLE ONLY agent.provider_jobs
    ADD CONSTRAINT provider_jobs_pkey PRIMARY KEY (id);

ALTER TABLE ONLY agent.provider_jobs
    ADD CONSTRAINT provider_jobs_provider_job_id_key UNIQUE (provider, job_id);

ALTER TABLE agent.provider_jobs ENABLE ROW LEVEL SECURITY;
