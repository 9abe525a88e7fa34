-- The idempotency plane v0.1: its schema agent whole, in one migration, after
-- the roles (20261130000001_roles.sql).
--
-- Written by scripts/draft-migration.sh --baseline from supabase/schemas/,
-- which stays the source: every file there but 00_roles.sql, in file-name
-- order (the order the declared schema is applied in), each after a line
-- naming it. Edit those files, not this one, and run the command again.
-- Once v0.1 is released this file is deployed history and never changes: a
-- change is a new migration, drafted with scripts/draft-migration.sh NAME.

-- supabase/schemas/01_schema.sql

-- Schema agent holds the whole plane. Its owner is the role that applies
-- the schema (postgres on Supabase). Only service_role may use it: anon,
-- authenticated and PUBLIC hold no USAGE, so they cannot call anything in
-- it even where the event trigger (80_event_trigger.sql) does not fire.
-- PostgREST must expose it (supabase/config.toml, [api] schemas).

CREATE SCHEMA agent;

GRANT USAGE ON SCHEMA agent TO service_role;
GRANT ALL ON SCHEMA agent TO idempotency_owner;

-- supabase/schemas/10_type_idempotency_claim.sql

-- agent.idempotency_claim
--
-- A claim as the functions answer it: the row's columns an answer needs (not
-- the stored request, the reclaim count, the re-drive time or the audit of
-- replaced failures), plus lease_live (processing and its lease not passed,
-- by the database clock).

CREATE TYPE agent.idempotency_claim AS (
	id uuid,
	organization_id uuid,
	scope text,
	key text,
	request_hash text,
	status text,
	lease_token uuid,
	resource_type text,
	resource_id text,
	response jsonb,
	claimed_at timestamp with time zone,
	lease_expires_at timestamp with time zone,
	retain_until timestamp with time zone,
	lease_live boolean
);

ALTER TYPE agent.idempotency_claim OWNER TO idempotency_owner;

-- supabase/schemas/10_type_idempotency_claim_item.sql

-- agent.idempotency_claim_item
--
-- One item of agent.idempotency_claim_many's answer: its place in the batch
-- (item, 0-based), then what its single claim would answer.

CREATE TYPE agent.idempotency_claim_item AS (
	item integer,
	outcome text,
	id uuid,
	organization_id uuid,
	scope text,
	key text,
	request_hash text,
	status text,
	lease_token uuid,
	resource_type text,
	resource_id text,
	response jsonb,
	claimed_at timestamp with time zone,
	lease_expires_at timestamp with time zone,
	retain_until timestamp with time zone,
	lease_live boolean
);

ALTER TYPE agent.idempotency_claim_item OWNER TO idempotency_owner;

-- supabase/schemas/10_type_idempotency_claim_outcome.sql

-- agent.idempotency_claim_outcome
--
-- What a claim answers: outcome (claimed, reclaimed, completed, processing,
-- conflict; reclaimable where the caller may not take over, as for
-- agent.idempotency_try_claim, never from agent.idempotency_claim) and the
-- claim. Only claimed and reclaimed carry the lease token; processing and
-- conflict carry no response or resource, conflict not the stored hash.

CREATE TYPE agent.idempotency_claim_outcome AS (
	outcome text,
	id uuid,
	organization_id uuid,
	scope text,
	key text,
	request_hash text,
	status text,
	lease_token uuid,
	resource_type text,
	resource_id text,
	response jsonb,
	claimed_at timestamp with time zone,
	lease_expires_at timestamp with time zone,
	retain_until timestamp with time zone,
	lease_live boolean
);

ALTER TYPE agent.idempotency_claim_outcome OWNER TO idempotency_owner;

-- supabase/schemas/10_type_idempotency_completion_item.sql

-- agent.idempotency_completion_item
--
-- One item of agent.idempotency_complete_many's answer: completed, and the
-- completed claim where the fence held.

CREATE TYPE agent.idempotency_completion_item AS (
	item integer,
	completed boolean,
	id uuid,
	organization_id uuid,
	scope text,
	key text,
	request_hash text,
	status text,
	lease_token uuid,
	resource_type text,
	resource_id text,
	response jsonb,
	claimed_at timestamp with time zone,
	lease_expires_at timestamp with time zone,
	retain_until timestamp with time zone,
	lease_live boolean
);

ALTER TYPE agent.idempotency_completion_item OWNER TO idempotency_owner;

-- supabase/schemas/10_type_idempotency_failure.sql

-- agent.idempotency_failure
--
-- A journaled failure as agent.idempotency_failures and
-- agent.idempotency_redrive_failed answer it. claimed_at is the latest
-- attempt's claim; first_claimed_at the claim of the first attempt that
-- failed, kept however often the failure is sent back and fails again.

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
	first_claimed_at timestamp with time zone
);

ALTER TYPE agent.idempotency_failure OWNER TO idempotency_owner;

-- supabase/schemas/10_type_idempotency_orphaned_scope.sql

-- agent.idempotency_orphaned_scope
--
-- Per scope, the claims still processing whose lease passed and that carry
-- work: agent.idempotency_orphans' answer.

CREATE TYPE agent.idempotency_orphaned_scope AS (
	scope text,
	orphans bigint,
	oldest timestamp with time zone,
	waited_ms bigint
);

ALTER TYPE agent.idempotency_orphaned_scope OWNER TO idempotency_owner;

-- supabase/schemas/10_type_idempotency_queue_ending.sql

-- agent.idempotency_queue_ending
--
-- One item of a queue settle or extend, checked (private): the claim, its
-- messages (empty for a re-driven claim) and, for a settle, its ending.

CREATE TYPE agent.idempotency_queue_ending AS (
	item integer,
	organization_id uuid,
	claim_id uuid,
	lease_token uuid,
	msg_ids bigint[],
	ending text,
	response jsonb,
	resource_type text,
	resource_id text
);

ALTER TYPE agent.idempotency_queue_ending OWNER TO idempotency_owner;

-- supabase/schemas/10_type_idempotency_queue_extended.sql

-- agent.idempotency_queue_extended
--
-- One item's heartbeat as agent.idempotency_queue_extend answers it.

CREATE TYPE agent.idempotency_queue_extended AS (
	item integer,
	lease_expires_at timestamp with time zone
);

ALTER TYPE agent.idempotency_queue_extended OWNER TO idempotency_owner;

-- supabase/schemas/10_type_idempotency_queue_item.sql

-- agent.idempotency_queue_item
--
-- One message (or re-driven claim) as agent.idempotency_queue_take answers it.

CREATE TYPE agent.idempotency_queue_item AS (
	msg_id bigint,
	read_ct integer,
	enqueued_at timestamp with time zone,
	message jsonb,
	organization_id uuid,
	key text,
	outcome text,
	copy_of bigint,
	id uuid,
	lease_token uuid,
	lease_expires_at timestamp with time zone,
	retain_until timestamp with time zone,
	lease_live boolean,
	attempt integer,
	payload jsonb,
	response jsonb,
	archived boolean,
	dead_lettered boolean,
	reason text,
	taken integer
);

ALTER TYPE agent.idempotency_queue_item OWNER TO idempotency_owner;

-- supabase/schemas/10_type_idempotency_queue_settled.sql

-- agent.idempotency_queue_settled
--
-- One item's ending as agent.idempotency_queue_settle answers it.

CREATE TYPE agent.idempotency_queue_settled AS (
	item integer,
	journaled boolean,
	archived integer,
	dead_lettered boolean
);

ALTER TYPE agent.idempotency_queue_settled OWNER TO idempotency_owner;

-- supabase/schemas/10_type_idempotency_release_item.sql

-- agent.idempotency_release_item
--
-- One item of agent.idempotency_release_many's answer: released or not.

CREATE TYPE agent.idempotency_release_item AS (
	item integer,
	released boolean
);

ALTER TYPE agent.idempotency_release_item OWNER TO idempotency_owner;

-- supabase/schemas/10_type_idempotency_retired.sql

-- agent.idempotency_retired
--
-- What agent.idempotency_retire_expired did with the claims past retention
-- it was given: how many it deleted, and how many unfinished ones (work
-- nobody re-drove) it journaled as dead letters instead.

CREATE TYPE agent.idempotency_retired AS (
	deleted integer,
	dead_lettered integer
);

ALTER TYPE agent.idempotency_retired OWNER TO idempotency_owner;

-- supabase/schemas/10_type_idempotency_sweep_report.sql

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

-- supabase/schemas/10_type_run_admission.sql

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

-- supabase/schemas/20_table_idempotency_keys.sql

-- agent.idempotency_keys
--
-- The claims and the replay journal, one row per (organization_id, scope,
-- key). Written only through the functions; no API role may read or write it.
-- The lease token fences every ending: a completion, release or heartbeat
-- whose token is not the row's changes nothing.

CREATE TABLE agent.idempotency_keys (
    id uuid DEFAULT gen_random_uuid() NOT NULL,
    organization_id uuid NOT NULL,
    scope text NOT NULL,
    key text NOT NULL,
    request_hash text NOT NULL,
    status text DEFAULT 'processing'::text NOT NULL,
    lease_token uuid NOT NULL,
    resource_type text,
    resource_id text,
    response jsonb,
    claimed_at timestamp with time zone DEFAULT now() NOT NULL,
    lease_expires_at timestamp with time zone NOT NULL,
    retain_until timestamp with time zone NOT NULL,
    reclaims integer DEFAULT 0 NOT NULL,
    request jsonb,
    redrive_at timestamp with time zone,
    replaced jsonb,
    dead_lettered_at timestamp with time zone,
    CONSTRAINT idempotency_keys_completed_has_answer CHECK (((status <> 'completed'::text) OR (NULLIF(response, 'null'::jsonb) IS NOT NULL) OR (resource_id IS NOT NULL))),
    CONSTRAINT idempotency_keys_key_length CHECK (((char_length(key) >= 1) AND (char_length(key) <= 512))),
    CONSTRAINT idempotency_keys_redrive_carries_work CHECK (((redrive_at IS NULL) OR ((status = 'processing'::text) AND (request IS NOT NULL)))),
    CONSTRAINT idempotency_keys_request_hash_hex CHECK (((octet_length(request_hash) = 64) AND (request_hash !~ '[^0-9a-f]'::text))),
    CONSTRAINT idempotency_keys_resource_id_length CHECK (((char_length(resource_id) >= 1) AND (char_length(resource_id) <= 512))),
    CONSTRAINT idempotency_keys_resource_is_typed CHECK (((resource_id IS NULL) OR (resource_type IS NOT NULL))),
    CONSTRAINT idempotency_keys_resource_type_length CHECK (((char_length(resource_type) >= 1) AND (char_length(resource_type) <= 128))),
    CONSTRAINT idempotency_keys_retention_covers_lease CHECK ((retain_until >= lease_expires_at)),
    CONSTRAINT idempotency_keys_scope_length CHECK (((char_length(scope) >= 1) AND (char_length(scope) <= 128))),
    CONSTRAINT idempotency_keys_status_check CHECK ((status = ANY (ARRAY['processing'::text, 'completed'::text])))
)
WITH (fillfactor='80');

ALTER TABLE agent.idempotency_keys OWNER TO idempotency_owner;

-- The work a claim carries and its answer take lz4 where the server was
-- built with it (quicker than pglz, as compact on JSON); pglz, PostgreSQL's
-- default, where it was not.
DO $$
begin
  alter table agent.idempotency_keys
    alter column request set compression lz4,
    alter column response set compression lz4;
exception when feature_not_supported then
  null;
end
$$;

COMMENT ON TABLE agent.idempotency_keys IS 'Idempotency claims and the replay journal. Written only through the agent.idempotency_* functions.';

COMMENT ON COLUMN agent.idempotency_keys.request IS 'The work the claim carries, as its claimant stored it; handed out only by agent.idempotency_redrive.';

COMMENT ON COLUMN agent.idempotency_keys.redrive_at IS 'When a claim carrying work may be re-driven: its lease end while processing, NULL otherwise.';

COMMENT ON COLUMN agent.idempotency_keys.dead_lettered_at IS 'When the failure journaled for this key was sent to a dead-letter queue: a copy of the command that failed is archived beside that letter, never sent again.';

COMMENT ON COLUMN agent.idempotency_keys.replaced IS 'What agent.idempotency_redrive_failed replaced, oldest first (at most 20: the first and the last 19): the audit of failures sent back.';

ALTER TABLE ONLY agent.idempotency_keys
    ADD CONSTRAINT idempotency_keys_org_scope_key_key UNIQUE (organization_id, scope, key);

ALTER TABLE ONLY agent.idempotency_keys
    ADD CONSTRAINT idempotency_keys_pkey PRIMARY KEY (id);

CREATE INDEX idempotency_keys_redrive_idx ON agent.idempotency_keys USING btree (scope, redrive_at) WHERE (redrive_at IS NOT NULL);

CREATE INDEX idempotency_keys_retain_until_idx ON agent.idempotency_keys USING btree (retain_until, id);

ALTER TABLE agent.idempotency_keys ENABLE ROW LEVEL SECURITY;

-- supabase/schemas/20_table_idempotency_scheduled_calls.sql

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

-- supabase/schemas/20_table_idempotency_scopes.sql

-- agent.idempotency_scopes
--
-- The policy of each scope, or of a family such as tool.*: how long a claim
-- is kept, the largest answer and request stored, and how many times work is
-- handed out. A claim in a scope with no row is refused (IDEM1). Add a scope
-- with a migration.

CREATE TABLE agent.idempotency_scopes (
    scope text NOT NULL,
    retain interval NOT NULL,
    max_response_bytes integer NOT NULL,
    max_request_bytes integer DEFAULT 65536 NOT NULL,
    max_attempts integer DEFAULT 5 NOT NULL,
    CONSTRAINT idempotency_scopes_max_attempts_range CHECK (((max_attempts >= 1) AND (max_attempts <= 100))),
    CONSTRAINT idempotency_scopes_max_request_bytes_range CHECK (((max_request_bytes >= 1024) AND (max_request_bytes <= 4194304))),
    CONSTRAINT idempotency_scopes_max_response_bytes_range CHECK (((max_response_bytes >= 1024) AND (max_response_bytes <= 4194304))),
    CONSTRAINT idempotency_scopes_retain_range CHECK (((retain >= '00:00:01'::interval) AND (retain <= '366 days'::interval))),
    CONSTRAINT idempotency_scopes_scope_shape CHECK (((scope ~ '^[a-z0-9_-]+(\.[a-z0-9_-]+)*(\.\*)?$'::text) AND (char_length(scope) <= 128))),
    CONSTRAINT idempotency_scopes_tool_retention CHECK (((scope !~~ 'tool.%'::text) OR (retain >= '30 days'::interval)))
);

ALTER TABLE agent.idempotency_scopes OWNER TO idempotency_owner;

COMMENT ON TABLE agent.idempotency_scopes IS 'Retention, answer and request limits, and attempts per scope (exact, or a family such as tool.*). A scope with no row is refused.';

ALTER TABLE ONLY agent.idempotency_scopes
    ADD CONSTRAINT idempotency_scopes_pkey PRIMARY KEY (scope);

ALTER TABLE agent.idempotency_scopes ENABLE ROW LEVEL SECURITY;

-- The scopes the plane ships with. Add your own with a migration (README).
-- webhook.* keeps 384 KiB of work: a delivery's body as the webhook gates
-- store it takes at most 4 * ceil(n / 3) + 18 bytes (its base64, wrapped),
-- so every body up to the gates' default limit of 256 KiB fits (349,546
-- bytes at most); raise the two together (docs/callers.md, "One body limit").
INSERT INTO agent.idempotency_scopes (scope, retain, max_response_bytes, max_request_bytes, max_attempts) VALUES ('tool.*', '30 days', 65536, 65536, 5);
INSERT INTO agent.idempotency_scopes (scope, retain, max_response_bytes, max_request_bytes, max_attempts) VALUES ('webhook.*', '24:00:00', 65536, 393216, 5);
INSERT INTO agent.idempotency_scopes (scope, retain, max_response_bytes, max_request_bytes, max_attempts) VALUES ('surface.saved_search.start', '24:00:00', 65536, 65536, 5);
INSERT INTO agent.idempotency_scopes (scope, retain, max_response_bytes, max_request_bytes, max_attempts) VALUES ('http.*', '24:00:00', 65536, 65536, 5);
INSERT INTO agent.idempotency_scopes (scope, retain, max_response_bytes, max_request_bytes, max_attempts) VALUES ('queue.*', '7 days', 65536, 65536, 5);

-- supabase/schemas/20_table_idempotency_settings.sql

-- agent.idempotency_settings
--
-- The plane's own settings, one row. max_rows is the plane's row cap: the
-- server's db-max-rows (Supabase api.max_rows, default 1000), which no
-- function that answers rows may exceed, whatever its caller says (a row
-- the server cuts from an answer would be claimed or taken over with a
-- token nobody receives). Set it where the server's cap is set; idem
-- doctor reports a plane cap that differs from the server's.

CREATE TABLE agent.idempotency_settings (
    id boolean DEFAULT true NOT NULL,
    max_rows integer DEFAULT 1000 NOT NULL,
    CONSTRAINT idempotency_settings_max_rows_range CHECK (((max_rows >= 1) AND (max_rows <= 100000))),
    CONSTRAINT idempotency_settings_one_row CHECK (id)
);

ALTER TABLE agent.idempotency_settings OWNER TO idempotency_owner;

COMMENT ON TABLE agent.idempotency_settings IS 'The plane''s settings, one row: max_rows, the row cap no answer may exceed (the server''s db-max-rows).';

ALTER TABLE ONLY agent.idempotency_settings
    ADD CONSTRAINT idempotency_settings_pkey PRIMARY KEY (id);

ALTER TABLE agent.idempotency_settings ENABLE ROW LEVEL SECURITY;

INSERT INTO agent.idempotency_settings (id, max_rows) VALUES (true, 1000);

-- supabase/schemas/20_table_provider_jobs.sql

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

-- supabase/schemas/20_table_runs.sql

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

-- supabase/schemas/30_view_idempotency_rows.sql

-- agent.idempotency_rows
--
-- The claim table's columns as a relation an API role may name: the row shape
-- of agent.idempotency_expired and agent.idempotency_cap_probe. It runs with
-- its caller's privileges, so no API role can read the table through it; the
-- functions that answer its rows never answer a lease token.

CREATE VIEW agent.idempotency_rows WITH (security_invoker='true') AS
 SELECT k.id,
    k.organization_id,
    k.scope,
    k.key,
    k.request_hash,
    k.status,
    k.lease_token,
    k.resource_type,
    k.resource_id,
    k.response,
    k.claimed_at,
    k.lease_expires_at,
    k.retain_until,
    k.reclaims
   FROM agent.idempotency_keys k;

ALTER TABLE agent.idempotency_rows OWNER TO idempotency_owner;

-- supabase/schemas/30_view_idempotency_work.sql

-- agent.idempotency_work
--
-- The row shape of agent.idempotency_redrive: a claim taken over for re-
-- drive, with its fresh lease token, its request and its attempt.

CREATE VIEW agent.idempotency_work WITH (security_invoker='true') AS
 SELECT k.id,
    k.organization_id,
    k.scope,
    k.key,
    k.request_hash,
    k.status,
    k.lease_token,
    k.request,
    (k.reclaims + 1) AS attempt,
    k.claimed_at,
    k.lease_expires_at,
    k.retain_until,
    k.response,
    NULL::integer AS taken
   FROM agent.idempotency_keys k;

ALTER TABLE agent.idempotency_work OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_canonical_json.sql

-- agent.idempotency_canonical_json
--
-- A JSON value in RFC 8785 canonical form (private): no whitespace, object
-- members sorted by their names' UTF-16 code units, strings as ECMAScript's
-- JSON.stringify writes them (jsonb writes them so), numbers as
-- agent.idempotency_json_number spells them. The same text the Rust crate's
-- canonical_json and the TypeScript client's canonicalize write, so a hash
-- the database takes of a value equals a client's.

CREATE FUNCTION agent.idempotency_canonical_json(p_value jsonb) RETURNS text
    LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
    SET search_path TO ''
    AS $$
declare
  v_out text;
  v_type text := pg_catalog.jsonb_typeof(p_value);
begin
  if v_type = 'object' then
    select pg_catalog.string_agg(
             pg_catalog.to_jsonb(e.key)::text || ':' ||
             case pg_catalog.jsonb_typeof(e.value)
               when 'object' then agent.idempotency_canonical_json(e.value)
               when 'array' then agent.idempotency_canonical_json(e.value)
               when 'number' then
                 case when e.value::text ~ '^-?(0|[1-9][0-9]{0,14})(\.[0-9]{0,14})?$'
                           and pg_catalog.char_length(pg_catalog.rtrim(pg_catalog.replace(pg_catalog.ltrim(e.value::text, '-0'), '.', ''), '0')) <= 15
                           and (pg_catalog.abs(e.value::numeric) >= 0.000001 or e.value::numeric = 0)
                      then pg_catalog.trim_scale(e.value::numeric)::text
                      else agent.idempotency_json_number(e.value::numeric) end
               else e.value::text
             end,
             ',' order by case when e.key ~ '[\uE000-\uFFFF]' then agent.idempotency_utf16_order(e.key)
                              else pg_catalog.convert_to(e.key, 'UTF8') end)
      into v_out
      from pg_catalog.jsonb_each(p_value) e;
    return '{' || coalesce(v_out, '') || '}';
  elsif v_type = 'array' then
    select pg_catalog.string_agg(
             case pg_catalog.jsonb_typeof(e.value)
               when 'object' then agent.idempotency_canonical_json(e.value)
               when 'array' then agent.idempotency_canonical_json(e.value)
               when 'number' then
                 case when e.value::text ~ '^-?(0|[1-9][0-9]{0,14})(\.[0-9]{0,14})?$'
                           and pg_catalog.char_length(pg_catalog.rtrim(pg_catalog.replace(pg_catalog.ltrim(e.value::text, '-0'), '.', ''), '0')) <= 15
                           and (pg_catalog.abs(e.value::numeric) >= 0.000001 or e.value::numeric = 0)
                      then pg_catalog.trim_scale(e.value::numeric)::text
                      else agent.idempotency_json_number(e.value::numeric) end
               else e.value::text
             end,
             ',' order by e.position)
      into v_out
      from pg_catalog.jsonb_array_elements(p_value) with ordinality e(value, position);
    return '[' || coalesce(v_out, '') || ']';
  elsif v_type = 'number' then
    return agent.idempotency_json_number(p_value::numeric);
  end if;
  return p_value::text;
end;
$$;

ALTER FUNCTION agent.idempotency_canonical_json(p_value jsonb) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_cap_probe.sql

-- agent.idempotency_cap_probe
--
-- p_rows synthetic rows (public), nothing read or written: idem doctor's
-- check of the server's row cap.

CREATE FUNCTION agent.idempotency_cap_probe(p_rows integer) RETURNS SETOF agent.idempotency_rows
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    AS $$
begin
  if p_rows is null or p_rows < 1 or p_rows > 100001 then
    raise exception 'p_rows must be between 1 and 100001, got %', p_rows using errcode = '22023';
  end if;
  return query
    select gen_random_uuid(), '00000000-0000-0000-0000-000000000000'::uuid, 'probe', 'probe-' || i,
           repeat('0', 64), 'processing', gen_random_uuid(), null::text, null::text, null::jsonb,
           now(), now(), now(), 0
      from generate_series(1, p_rows) as i;
end
$$;

ALTER FUNCTION agent.idempotency_cap_probe(p_rows integer) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_check_batch.sql

-- agent.idempotency_check_batch
--
-- Refuses (22023) a batch that is not a JSON array of 1 to p_row_cap items,
-- or a p_row_cap above the plane's (agent.idempotency_row_cap); without
-- p_row_cap, the plane's. Private.

CREATE FUNCTION agent.idempotency_check_batch(p_items jsonb, p_row_cap integer) RETURNS void
    LANGUAGE plpgsql STABLE
    SET search_path TO ''
    AS $$
declare
  v_count integer;
  v_cap integer := agent.idempotency_row_cap(p_row_cap);
begin
  if p_items is null then
    raise exception 'p_items is required' using errcode = '22023';
  end if;
  if jsonb_typeof(p_items) <> 'array' then
    raise exception 'p_items must be a JSON array of items, got a JSON %', jsonb_typeof(p_items)
      using errcode = '22023';
  end if;
  v_count := jsonb_array_length(p_items);
  if v_count not between 1 and v_cap then
    raise exception 'p_items must hold between 1 and the row cap % items, got %', v_cap, v_count
      using errcode = '22023',
            hint = 'a batch answers a row per item; more than the row cap would be cut from the answer';
  end if;
end
$$;

ALTER FUNCTION agent.idempotency_check_batch(p_items jsonb, p_row_cap integer) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_check_item.sql

-- agent.idempotency_check_item
--
-- Refuses (22023) a batch item that is not a JSON object, naming it
-- p_items[i]. Private.

CREATE FUNCTION agent.idempotency_check_item(p_item jsonb, p_index integer) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
    SET search_path TO ''
    AS $$
begin
  if p_item is null or jsonb_typeof(p_item) <> 'object' then
    raise exception 'p_items[%] must be a JSON object, got a JSON %', p_index, coalesce(jsonb_typeof(p_item), 'null')
      using errcode = '22023';
  end if;
end
$$;

ALTER FUNCTION agent.idempotency_check_item(p_item jsonb, p_index integer) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_check_key.sql

-- agent.idempotency_check_key
--
-- Refuses (22023) a missing organization, a scope that is empty, longer than
-- 128 characters or of other characters than a-z, 0-9, '.', '_' and '-', or a
-- key that is empty or longer than 512 characters. Private.

CREATE FUNCTION agent.idempotency_check_key(p_organization_id uuid, p_scope text, p_key text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
    SET search_path TO ''
    AS $$
begin
  if p_organization_id is null then
    raise exception 'p_organization_id is required' using errcode = '22023';
  end if;
  if p_scope is null then
    raise exception 'p_scope is required' using errcode = '22023';
  end if;
  if char_length(p_scope) not between 1 and 128 or p_scope ~ '[^a-z0-9._-]' then
    raise exception 'p_scope must be 1 to 128 characters of a-z, 0-9, ".", "_" and "-", got %',
                    pg_catalog.left(p_scope, 128)
      using errcode = '22023';
  end if;
  if p_key is null then
    raise exception 'p_key is required' using errcode = '22023';
  end if;
  if char_length(p_key) not between 1 and 512 then
    raise exception 'p_key must be 1 to 512 characters, got %', char_length(p_key) using errcode = '22023';
  end if;
end
$$;

ALTER FUNCTION agent.idempotency_check_key(p_organization_id uuid, p_scope text, p_key text) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_check_work.sql

-- agent.idempotency_check_work
--
-- Refuses work a claim would store that its scope does not keep: above the
-- scope's max_request_bytes as compact JSON (IDEM5), nested deeper than 64
-- levels (IDEM6), or of a scope with no policy (IDEM1). Private: called by
-- the claim functions before anything is written.

CREATE FUNCTION agent.idempotency_check_work(p_scope text, p_request jsonb) RETURNS void
    LANGUAGE plpgsql STABLE
    SET search_path TO ''
    AS $$
declare
  v_size bigint := octet_length(p_request::text);
  v_limit integer;
begin
  -- No text under the smallest limit a policy may set (1024) can be above
  -- one, or 64 levels deep under 130 bytes.
  if v_size >= 130
     and jsonb_path_exists(p_request, 'strict $.**{64} ? (@.type() == "array" || @.type() == "object")') then
    raise exception 'the request nests arrays and objects deeper than 64 levels, more than every client reads back'
      using errcode = 'IDEM6',
            hint = 'flatten the request, or store it as its JSON text ({"$json": "<text>"})';
  end if;
  if v_size > 1024 then
    select p.max_request_bytes into v_limit from agent.idempotency_policy(p_scope) p;
    if v_limit is null then
      raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', p_scope
        using errcode = 'IDEM1',
              hint = 'add the scope (or its family, e.g. tool.*) to agent.idempotency_scopes in a migration';
    end if;
    if v_size > v_limit then
      v_size := agent.idempotency_json_size(p_request);
      if v_size > v_limit then
        raise exception 'the request is % bytes as compact JSON, above the % bytes scope % keeps',
                        v_size, v_limit, p_scope
          using errcode = 'IDEM5',
                hint = 'store the work elsewhere and claim with a reference to it, '
                       'or raise max_request_bytes for the scope';
      end if;
    end if;
  end if;
end
$$;

ALTER FUNCTION agent.idempotency_check_work(p_scope text, p_request jsonb) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_claim.sql

-- agent.idempotency_claim
--
-- The one-call claim (public): whether this call runs (claimed, or reclaimed
-- after the lease passed), replays (completed), waits (processing) or is
-- refused (conflict: same key, another request), decided by
-- agent.idempotency_decide. A repeat with the same lease token after a lost
-- answer answers that caller's own claim. p_request is the work the claim
-- carries, for re-drive.

CREATE FUNCTION agent.idempotency_claim(p_organization_id uuid, p_scope text, p_key text, p_request_hash text, p_lease_token uuid, p_lease_ms bigint, p_request jsonb DEFAULT NULL::jsonb) RETURNS SETOF agent.idempotency_claim_outcome
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
begin
  return query
    select * from agent.idempotency_decide(p_organization_id, p_scope, p_key, p_request_hash, p_lease_token,
                                           p_lease_ms, null, true, true, p_request);
end
$$;

ALTER FUNCTION agent.idempotency_claim(p_organization_id uuid, p_scope text, p_key text, p_request_hash text, p_lease_token uuid, p_lease_ms bigint, p_request jsonb) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_claim_many.sql

-- agent.idempotency_claim_many
--
-- Claims a batch in one round trip (public): one row per item, in input
-- order, what the items' single claims made one after another would answer.
-- Each key is decided once, by its first occurrence, in one statement that
-- visits the keys in key order and locks every row it finds, so batches
-- never deadlock; a later occurrence answers from the row its first left
-- (processing, completed or a conflict), never a second claim. The leases
-- won are timed from the end of the batch. A malformed item or more than
-- p_row_cap items refuses the whole batch (22023) and writes nothing.

CREATE FUNCTION agent.idempotency_claim_many(p_organization_id uuid, p_scope text, p_lease_ms bigint, p_items jsonb, p_row_cap integer DEFAULT NULL::integer) RETURNS SETOF agent.idempotency_claim_item
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $_$
declare
  v_keys text[];
  v_hashes text[];
  v_tokens uuid[];
  v_requests jsonb[];
  v_item jsonb;
  v_index integer;
  v_text text;
  v_earlier integer;
  v_state text;
  v_message text;
  v_hint text;
  v_retain interval;
  v_lease interval := p_lease_ms * interval '1 millisecond';
  v_at timestamptz;
  v_firsts boolean[];
  v_rows agent.idempotency_keys[];
  v_answered integer;
begin
  if p_organization_id is null then
    raise exception 'p_organization_id is required' using errcode = '22023';
  end if;
  if p_scope is null then
    raise exception 'p_scope is required' using errcode = '22023';
  end if;
  if char_length(p_scope) not between 1 and 128 or p_scope ~ '[^a-z0-9._-]' then
    raise exception 'p_scope must be 1 to 128 characters of a-z, 0-9, ".", "_" and "-", got %',
                    pg_catalog.left(p_scope, 128)
      using errcode = '22023';
  end if;
  if p_lease_ms is null or p_lease_ms not between 1000 and 86400000 then
    raise exception 'p_lease_ms must be between 1000 (one second) and 86400000 (one day), got %', p_lease_ms
      using errcode = '22023';
  end if;
  perform agent.idempotency_check_batch(p_items, p_row_cap);
  select p.retain into v_retain from agent.idempotency_policy(p_scope) p;
  if v_retain is null then
    raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', p_scope
      using errcode = 'IDEM1',
            hint = 'add the scope (or its family, e.g. tool.*) to agent.idempotency_scopes in a migration';
  end if;
  v_retain := greatest(v_retain, v_lease);

  -- Every item is checked before anything is written, in one pass over
  -- the array; the first bad item, if any, is checked again on its own to
  -- say what is wrong with it.
  select (e.ordinality - 1)::integer, e.value into v_index, v_item
    from pg_catalog.jsonb_array_elements(p_items) with ordinality e
   where not coalesce(pg_catalog.jsonb_typeof(e.value) = 'object'
                      and pg_catalog.jsonb_typeof(e.value -> 'key') = 'string'
                      and char_length(e.value ->> 'key') between 1 and 512
                      and pg_catalog.jsonb_typeof(e.value -> 'request_hash') = 'string'
                      and (e.value ->> 'request_hash') ~ '^[0-9a-f]{64}$'
                      and pg_catalog.jsonb_typeof(e.value -> 'lease_token') = 'string'
                      and (e.value ->> 'lease_token')
                          ~ '^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$',
                      false)
   order by e.ordinality
   limit 1;
  if found then
    perform agent.idempotency_check_item(v_item, v_index);
    v_text := agent.idempotency_item_text(v_item, v_index, 'key', true);
    if char_length(v_text) not between 1 and 512 then
      raise exception 'p_items[%].key must be 1 to 512 characters, got %', v_index, char_length(v_text)
        using errcode = '22023';
    end if;
    v_text := agent.idempotency_item_text(v_item, v_index, 'request_hash', true);
    if octet_length(v_text) <> 64 or v_text ~ '[^0-9a-f]' then
      raise exception 'p_items[%].request_hash must be 64 lowercase hex digits (a SHA-256), got %',
                      v_index, pg_catalog.left(v_text, 80)
        using errcode = '22023';
    end if;
    perform agent.idempotency_item_uuid(v_item, v_index, 'lease_token');
    raise exception 'p_items[%] is malformed', v_index using errcode = '22023';
  end if;
  -- The items' fields, and whether each is its key's first occurrence.
  select pg_catalog.array_agg(t.key order by t.n), pg_catalog.array_agg(t.hash order by t.n),
         pg_catalog.array_agg(t.token order by t.n), pg_catalog.array_agg(t.request order by t.n),
         pg_catalog.array_agg(t.first order by t.n)
    into v_keys, v_hashes, v_tokens, v_requests, v_firsts
    from (select e.ordinality as n, e.value ->> 'key' as key, e.value ->> 'request_hash' as hash,
                 (e.value ->> 'lease_token')::uuid as token, nullif(e.value -> 'request', 'null'::jsonb) as request,
                 pg_catalog.row_number() over (partition by e.value ->> 'key' order by e.ordinality) = 1 as first
            from pg_catalog.jsonb_array_elements(p_items) with ordinality e) t;
  -- The first item whose token an earlier item named, and that item.
  select t.first - 1, t.i - 1 into v_earlier, v_index
    from (select i, pg_catalog.min(i) over (partition by v_tokens[i]) as first
            from pg_catalog.generate_subscripts(v_tokens, 1) i) t
   where t.i > t.first
   order by t.i
   limit 1;
  if v_earlier is not null then
    raise exception 'p_items[%].lease_token repeats p_items[%].lease_token: each item needs a token of its own',
                    v_index, v_earlier
      using errcode = '22023',
            hint = 'a claim repeated with its token answers claimed again; mint a fresh token per item';
  end if;
  -- The work each key's first occurrence stores, measured as a single
  -- claim's is; later occurrences store nothing.
  if pg_catalog.array_length(pg_catalog.array_remove(v_requests, null), 1) is not null then
    begin
      for i in 1 .. pg_catalog.cardinality(v_keys) loop
        v_index := i - 1;
        if v_firsts[i] and v_requests[i] is not null then
          perform agent.idempotency_check_work(p_scope, v_requests[i]);
        end if;
      end loop;
    exception when others then
      get stacked diagnostics v_state = returned_sqlstate, v_message = message_text, v_hint = pg_exception_hint;
      raise exception 'p_items[%]: %', v_index, v_message using errcode = v_state, hint = v_hint;
    end;
  end if;

  -- Each key is decided once, by its first occurrence, in one statement
  -- that visits the keys in key order: a free key is inserted; a taken one
  -- is locked, and taken over when its lease has passed and the request is
  -- the same (the row's work kept, or this item's stored). Every row the
  -- batch touches is locked in (organization, scope, key) order, as every
  -- batch of the plane locks them, so batches over the same keys wait for
  -- each other in one order and never deadlock; and no other transaction
  -- can change a row between this decision and the answer read below.
  v_at := pg_catalog.clock_timestamp();
  with firsts as (
    select v_keys[i] as key, v_hashes[i] as hash, v_tokens[i] as token, v_requests[i] as request
      from pg_catalog.generate_subscripts(v_keys, 1) i
     where v_firsts[i]
  ), decided as (
    insert into agent.idempotency_keys as k
      (organization_id, scope, key, request_hash, status, lease_token,
       claimed_at, lease_expires_at, retain_until, request, redrive_at)
    select p_organization_id, p_scope, f.key, f.hash, 'processing', f.token,
           v_at, v_at + v_lease, v_at + v_lease + v_retain,
           f.request, case when f.request is not null then v_at + v_lease end
      from firsts f
     order by f.key
    on conflict (organization_id, scope, key) do update
       set lease_token = excluded.lease_token,
           claimed_at = v_at,
           lease_expires_at = v_at + v_lease,
           retain_until = greatest(k.retain_until, v_at + v_lease + v_retain),
           reclaims = k.reclaims + 1,
           request = coalesce(k.request, excluded.request),
           redrive_at = case when coalesce(k.request, excluded.request) is not null then v_at + v_lease end
     where k.status = 'processing'
       and k.request_hash = excluded.request_hash
       and k.lease_expires_at <= pg_catalog.clock_timestamp()
    returning k.*
  )
  select pg_catalog.array_agg(row(decided.*)::agent.idempotency_keys) into v_rows from decided;

  -- The leases won are timed from the end of the batch, when the answer
  -- is made: time spent waiting on other transactions' rows is not taken
  -- out of them. The retention, counted from the lease's end, moves with it.
  if v_rows is not null and pg_catalog.clock_timestamp() - v_at > interval '10 milliseconds' then
    v_at := pg_catalog.clock_timestamp();
    with moved as (
      update agent.idempotency_keys as k
         set claimed_at = v_at,
             lease_expires_at = v_at + v_lease,
             retain_until = greatest(k.retain_until, v_at + v_lease + (k.retain_until - k.lease_expires_at)),
             redrive_at = case when k.redrive_at is not null then v_at + v_lease end
        from pg_catalog.unnest(v_rows) w
       where k.organization_id = p_organization_id and k.id = w.id
      returning k.*
    )
    select pg_catalog.array_agg(row(moved.*)::agent.idempotency_keys) into v_rows from moved;
  end if;
  -- The rows of the keys the batch did not win, which it holds all the same.
  if coalesce(pg_catalog.cardinality(v_rows), 0) < pg_catalog.cardinality(v_keys) then
    select coalesce(v_rows, '{}') || coalesce(pg_catalog.array_agg(k), '{}') into v_rows
      from agent.idempotency_keys k
     where k.organization_id = p_organization_id and k.scope = p_scope
       and k.key = any (v_keys)
       and k.id <> all (select w.id from pg_catalog.unnest(coalesce(v_rows, '{}')) w);
  end if;

  -- Every item answered from its key's row: the first occurrence what it
  -- decided, a later one what a single claim would answer it now (the key
  -- is its batch's first occurrence's, so never claimed a second time).
  return query
    select (i - 1)::integer, o.outcome, k.id, k.organization_id, k.scope, k.key,
           case when o.outcome = 'conflict' then null else k.request_hash end,
           k.status,
           case when o.outcome in ('claimed', 'reclaimed') then k.lease_token end,
           case when o.outcome = 'completed' then k.resource_type end,
           case when o.outcome = 'completed' then k.resource_id end,
           case when o.outcome = 'completed' then k.response end,
           k.claimed_at, k.lease_expires_at, k.retain_until,
           k.status = 'processing' and k.lease_expires_at > pg_catalog.clock_timestamp()
      from pg_catalog.generate_subscripts(v_keys, 1) i
      join pg_catalog.unnest(v_rows) k on k.key = v_keys[i]
     cross join lateral (
       select case when k.request_hash <> v_hashes[i] then 'conflict'
                   when k.status = 'completed' then 'completed'
                   when k.lease_token <> v_tokens[i] then 'processing'
                   when k.reclaims > 0 then 'reclaimed'
                   else 'claimed' end as outcome
     ) o
     order by i;
  get diagnostics v_answered = row_count;
  if v_answered <> pg_catalog.cardinality(v_keys) then
    raise exception 'claim_many answered % of % items', v_answered, pg_catalog.cardinality(v_keys)
      using errcode = 'XX000';
  end if;
end
$_$;

ALTER FUNCTION agent.idempotency_claim_many(p_organization_id uuid, p_scope text, p_lease_ms bigint, p_items jsonb, p_row_cap integer) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_claim_of.sql

-- agent.idempotency_claim_of
--
-- A claim-table row as agent.idempotency_claim, with lease_live by the
-- database clock. Private.

CREATE FUNCTION agent.idempotency_claim_of(k agent.idempotency_keys) RETURNS agent.idempotency_claim
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $$
begin
  return (k.id, k.organization_id, k.scope, k.key, k.request_hash, k.status,
          k.lease_token, k.resource_type, k.resource_id, k.response, k.claimed_at,
          k.lease_expires_at, k.retain_until,
          k.status = 'processing' and k.lease_expires_at > pg_catalog.clock_timestamp())::agent.idempotency_claim;
end
$$;

ALTER FUNCTION agent.idempotency_claim_of(k agent.idempotency_keys) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_complete.sql

-- agent.idempotency_complete
--
-- Journals the answer (public): completes the claim when p_lease_token is
-- still its fence, and answers the completed row; nothing when the fence
-- moved on. The work the claim carries is kept with a failure (an operator
-- may send it back to run again after a fix) and dropped with a success.

CREATE FUNCTION agent.idempotency_complete(p_claim_id uuid, p_lease_token uuid, p_resource_type text DEFAULT NULL::text, p_resource_id text DEFAULT NULL::text, p_response jsonb DEFAULT NULL::jsonb, p_organization_id uuid DEFAULT NULL::uuid) RETURNS SETOF agent.idempotency_claim
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $_$
declare
  v_resource_type text := nullif(p_resource_type, '');
  v_resource_id   text := nullif(p_resource_id, '');
  v_response      jsonb := nullif(p_response, 'null'::jsonb);
  r agent.idempotency_keys;
  v_organization_id uuid := p_organization_id;
  v_scope text;
  v_limit integer;
  v_size bigint;
begin
  if p_claim_id is null then
    raise exception 'p_claim_id is required' using errcode = '22023';
  end if;
  if p_lease_token is null then
    raise exception 'p_lease_token is required' using errcode = '22023';
  end if;
  if v_response is null and v_resource_id is null then
    raise exception 'a completion carries a response or a resource; this one carries neither'
      using errcode = '22023';
  end if;
  if v_resource_id is not null and v_resource_type is null then
    raise exception 'p_resource_id needs p_resource_type, so a reader can tell what it names'
      using errcode = '22023';
  end if;
  if char_length(v_resource_type) > 128 or char_length(v_resource_id) > 512 then
    raise exception 'p_resource_type may have at most 128 characters and p_resource_id at most 512'
      using errcode = '22023';
  end if;

  if v_organization_id is null then
    select k.organization_id into v_organization_id from agent.idempotency_keys k where k.id = p_claim_id;
    if not found then
      return;
    end if;
  end if;

  if v_response is not null then
    v_size := octet_length(v_response::text);
    if v_size >= 130
       and jsonb_path_exists(v_response, 'strict $.**{64} ? (@.type() == "array" || @.type() == "object")') then
      raise exception 'the response nests arrays and objects deeper than 64 levels, more than every client reads back'
        using errcode = 'IDEM3',
              hint = 'flatten the response, or store it elsewhere and complete with its resource';
    end if;
    if v_size > 1024 then
      select k.scope into v_scope
        from agent.idempotency_keys k
       where k.organization_id = v_organization_id and k.id = p_claim_id;
      if not found then
        return;
      end if;
      select p.max_response_bytes into v_limit from agent.idempotency_policy(v_scope) p;
      if v_limit is null then
        raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', v_scope
          using errcode = 'IDEM1';
      end if;
      if v_size > v_limit then
        v_size := agent.idempotency_json_size(v_response);
        if v_size > v_limit then
          raise exception 'the response is % bytes as compact JSON, above the % bytes scope % keeps',
                          v_size, v_limit, v_scope
            using errcode = 'IDEM2',
                  hint = 'store the response elsewhere and complete with its resource (and a reference to it)';
        end if;
      end if;
    end if;
  end if;

  update agent.idempotency_keys as k
     set status = 'completed',
         resource_type = v_resource_type,
         resource_id = v_resource_id,
         response = v_response,
         -- The work a claim carries is kept for a failure, which a fix may
         -- send back to run again; a success needs it no more.
         request = case when v_response -> 'ok' = 'false'::jsonb then k.request end,
         retain_until = greatest(k.retain_until,
                                 pg_catalog.clock_timestamp() + (k.retain_until - k.lease_expires_at)),
         redrive_at = null
   where k.organization_id = v_organization_id
     and k.id = p_claim_id
     and k.lease_token = p_lease_token
     and k.status = 'processing'
  returning k.* into r;

  if not found then
    -- Completed already by this very token: an earlier attempt of this call.
    select k.* into r
      from agent.idempotency_keys k
     where k.organization_id = v_organization_id
       and k.id = p_claim_id
       and k.lease_token = p_lease_token
       and k.status = 'completed'
       and k.resource_type is not distinct from v_resource_type
       and k.resource_id is not distinct from v_resource_id
       and k.response is not distinct from v_response;
  end if;
  if found then
    return next (r.id, r.organization_id, r.scope, r.key, r.request_hash, r.status,
                 r.lease_token, r.resource_type, r.resource_id, r.response, r.claimed_at,
                 r.lease_expires_at, r.retain_until,
                 r.status = 'processing' and r.lease_expires_at > pg_catalog.clock_timestamp())::agent.idempotency_claim;
  end if;
end
$_$;

ALTER FUNCTION agent.idempotency_complete(p_claim_id uuid, p_lease_token uuid, p_resource_type text, p_resource_id text, p_response jsonb, p_organization_id uuid) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_complete_many.sql

-- agent.idempotency_complete_many
--
-- Completes a batch (public), each item fenced by its own token: one row per
-- item, in order.

CREATE FUNCTION agent.idempotency_complete_many(p_organization_id uuid, p_items jsonb, p_row_cap integer DEFAULT NULL::integer) RETURNS SETOF agent.idempotency_completion_item
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
declare
  v_ids uuid[] := '{}'::uuid[];
  v_tokens uuid[] := '{}'::uuid[];
  v_types text[] := '{}'::text[];
  v_resources text[] := '{}'::text[];
  v_responses jsonb[] := '{}'::jsonb[];
  v_item jsonb;
  v_index integer;
  v_type text;
  v_resource text;
  v_response jsonb;
  v_state text;
  v_message text;
  v_hint text;
  r agent.idempotency_claim;
begin
  if p_organization_id is null then
    raise exception 'p_organization_id is required' using errcode = '22023';
  end if;
  perform agent.idempotency_check_batch(p_items, p_row_cap);

  for v_item, v_index in select e.value, (e.ordinality - 1)::integer
                           from jsonb_array_elements(p_items) with ordinality e loop
    perform agent.idempotency_check_item(v_item, v_index);
    v_ids := pg_catalog.array_append(v_ids, agent.idempotency_item_uuid(v_item, v_index, 'claim_id'));
    v_tokens := pg_catalog.array_append(v_tokens, agent.idempotency_item_uuid(v_item, v_index, 'lease_token'));
    v_type := nullif(agent.idempotency_item_text(v_item, v_index, 'resource_type', false), '');
    v_resource := nullif(agent.idempotency_item_text(v_item, v_index, 'resource_id', false), '');
    v_response := nullif(v_item -> 'response', 'null'::jsonb);
    if v_response is null and v_resource is null then
      raise exception 'p_items[%] carries neither a response nor a resource; a completion carries one', v_index
        using errcode = '22023';
    end if;
    if v_resource is not null and v_type is null then
      raise exception 'p_items[%].resource_id needs resource_type, so a reader can tell what it names', v_index
        using errcode = '22023';
    end if;
    if char_length(v_type) > 128 or char_length(v_resource) > 512 then
      raise exception 'p_items[%]: resource_type may have at most 128 characters and resource_id at most 512', v_index
        using errcode = '22023';
    end if;
    v_types := pg_catalog.array_append(v_types, v_type);
    v_resources := pg_catalog.array_append(v_resources, v_resource);
    v_responses := pg_catalog.array_append(v_responses, v_response);
  end loop;

  -- The rows are locked in (organization, scope, key) order before any is
  -- written, as every batch of the plane locks them, so that batches over
  -- the same keys never wait for each other in a cycle.
  perform 1
     from agent.idempotency_keys k
    where k.organization_id = p_organization_id and k.id = any (v_ids)
    order by k.scope, k.key
      for update of k;

  begin
    for i in 1 .. pg_catalog.cardinality(v_ids) loop
      v_index := i - 1;
      select * into r
        from agent.idempotency_complete(v_ids[i], v_tokens[i], v_types[i], v_resources[i], v_responses[i],
                                        p_organization_id);
      if found then
        return next (v_index, true, r.id, r.organization_id, r.scope, r.key, r.request_hash, r.status,
                     r.lease_token, r.resource_type, r.resource_id, r.response, r.claimed_at,
                     r.lease_expires_at, r.retain_until, r.lease_live)::agent.idempotency_completion_item;
      else
        return next (v_index, false, null, null, null, null, null, null, null, null, null, null, null, null,
                     null, null)::agent.idempotency_completion_item;
      end if;
    end loop;
  exception when others then
    get stacked diagnostics v_state = returned_sqlstate, v_message = message_text, v_hint = pg_exception_hint;
    raise exception 'p_items[%]: %', v_index, v_message using errcode = v_state, hint = v_hint;
  end;
end
$$;

ALTER FUNCTION agent.idempotency_complete_many(p_organization_id uuid, p_items jsonb, p_row_cap integer) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_decide.sql

-- agent.idempotency_decide
--
-- The decision behind every claim: insert, take over, replay, wait or refuse.
-- Private: called by the claim functions, which say what it may do
-- (p_may_insert, p_may_take_over).
--
-- Each decision is one statement that cannot be overtaken: an INSERT ... ON
-- CONFLICT DO NOTHING for a free key, or an UPDATE fenced by the lease token
-- just read (compare and set) for a takeover. A statement that loses a race
-- is tried again, up to 4 passes; a key that keeps changing hands after that
-- raises 40001, for the caller to retry. Answers reclaimable where it may not
-- take over a passed lease itself.

CREATE FUNCTION agent.idempotency_decide(p_organization_id uuid, p_scope text, p_key text, p_request_hash text, p_lease_token uuid, p_lease_ms bigint, p_retain_ms bigint, p_may_insert boolean, p_may_take_over boolean, p_request jsonb DEFAULT NULL::jsonb) RETURNS SETOF agent.idempotency_claim_outcome
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $_$
declare
  v_policy_retain interval;
  v_lease interval;
  v_retain interval;
  v_at timestamptz;
  v_won boolean := false;
  v_outcome text;
  v_request jsonb := nullif(p_request, 'null'::jsonb);
  r agent.idempotency_keys;
begin
  -- One test on the way in; the messages are built only for a refusal.
  if p_organization_id is null or p_scope is null
     or char_length(p_scope) not between 1 and 128 or p_scope ~ '[^a-z0-9._-]'
     or p_key is null or char_length(p_key) not between 1 and 512
     or p_request_hash is null or octet_length(p_request_hash) <> 64 or p_request_hash ~ '[^0-9a-f]'
     or p_lease_token is null
     or p_lease_ms is null or p_lease_ms not between 1000 and 86400000
     or p_retain_ms not between 1 and 31622400000
     or p_may_insert is null or p_may_take_over is null then
    perform agent.idempotency_check_key(p_organization_id, p_scope, p_key);
    if p_request_hash is null then
      raise exception 'p_request_hash is required' using errcode = '22023';
    elsif octet_length(p_request_hash) <> 64 or p_request_hash ~ '[^0-9a-f]' then
      raise exception 'p_request_hash must be 64 lowercase hex digits (a SHA-256), got %',
                      pg_catalog.left(p_request_hash, 80)
        using errcode = '22023';
    elsif p_lease_token is null then
      raise exception 'p_lease_token is required' using errcode = '22023';
    elsif p_lease_ms is null or p_lease_ms not between 1000 and 86400000 then
      raise exception 'p_lease_ms must be between 1000 (one second) and 86400000 (one day), got %', p_lease_ms
        using errcode = '22023';
    elsif p_retain_ms not between 1 and 31622400000 then
      raise exception 'p_retain_ms must be between 1 and 31622400000 (366 days), got %', p_retain_ms
        using errcode = '22023';
    else
      raise exception 'p_may_insert and p_may_take_over are required' using errcode = '22023';
    end if;
  end if;

  -- The work is measured before anything is locked, as a completion's
  -- answer is (agent.idempotency_complete).
  if v_request is not null then
    perform agent.idempotency_check_work(p_scope, v_request);
  end if;

  v_lease := p_lease_ms * interval '1 millisecond';
  -- What the caller asks for; the scope's policy is the floor of it.
  v_retain := greatest(coalesce(p_retain_ms, 0) * interval '1 millisecond', v_lease);

  -- Each pass decides, or sees the row change under it (released, taken
  -- over by someone else) and looks again; a key that keeps changing hands
  -- gives up with a serialization failure, which is safe to retry.
  for pass in 1..4 loop
    if p_may_insert then
      v_at := pg_catalog.clock_timestamp();
      -- The first claim, the hot path, reads its scope's policy in the
      -- same statement: no policy row, no insert.
      insert into agent.idempotency_keys as k
        (organization_id, scope, key, request_hash, status, lease_token,
         claimed_at, lease_expires_at, retain_until, request, redrive_at)
      select p_organization_id, p_scope, p_key, p_request_hash, 'processing', p_lease_token,
             v_at, v_at + v_lease, v_at + v_lease + greatest(s.retain, v_retain),
             v_request, case when v_request is not null then v_at + v_lease end
        from agent.idempotency_scopes s
       where s.scope = p_scope
          or (s.scope like '%.*'
              and char_length(p_scope) > char_length(s.scope) - 1
              and left(p_scope, char_length(s.scope) - 1) = left(s.scope, -1))
       order by s.scope = p_scope desc, char_length(s.scope) desc
       limit 1
      on conflict (organization_id, scope, key) do nothing
      returning k.* into r;
      if found then
        v_outcome := 'claimed';
        v_won := true;
        exit;
      end if;
    end if;
    if v_policy_retain is null then
      select p.retain into v_policy_retain from agent.idempotency_policy(p_scope) p;
      if v_policy_retain is null then
        raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', p_scope
          using errcode = 'IDEM1',
                hint = 'add the scope (or its family, e.g. tool.*) to agent.idempotency_scopes in a migration';
      end if;
      v_retain := greatest(v_retain, v_policy_retain);
    end if;

    select k.* into r
      from agent.idempotency_keys k
     where k.organization_id = p_organization_id and k.scope = p_scope and k.key = p_key;
    if not found then
      -- Released since our insert: insert again; or nothing to take over.
      continue when p_may_insert;
      return;
    end if;
    if r.request_hash <> p_request_hash then
      v_outcome := 'conflict';
    elsif r.status = 'completed' then
      v_outcome := 'completed';
    elsif r.lease_expires_at > pg_catalog.clock_timestamp() then
      v_outcome := case when r.lease_token <> p_lease_token then 'processing'
                        when r.reclaims > 0 then 'reclaimed'
                        else 'claimed' end;
    elsif not p_may_take_over then
      v_outcome := 'reclaimable';
    end if;
    exit when v_outcome is not null;

    v_at := pg_catalog.clock_timestamp();
    update agent.idempotency_keys as k
       set lease_token = p_lease_token,
           claimed_at = v_at,
           lease_expires_at = v_at + v_lease,
           retain_until = greatest(k.retain_until, v_at + v_lease + v_retain),
           reclaims = k.reclaims + 1,
           request = coalesce(k.request, v_request),
           redrive_at = case when coalesce(k.request, v_request) is not null then v_at + v_lease end
     where k.id = r.id
       and k.lease_token = r.lease_token
       and k.status = 'processing'
       and k.lease_expires_at <= pg_catalog.clock_timestamp()
    returning k.* into r;
    if found then
      v_outcome := 'reclaimed';
      v_won := true;
      exit;
    end if;
  end loop;
  if v_outcome is null then
    raise exception 'the key %/% kept changing hands; try again', p_scope, p_key using errcode = '40001';
  end if;

  -- A win that waited: the lease starts now, and the retention, counted
  -- from the lease's end, moves with it.
  if v_won and pg_catalog.clock_timestamp() - v_at > interval '10 milliseconds' then
    v_at := pg_catalog.clock_timestamp();
    update agent.idempotency_keys as k
       set claimed_at = v_at,
           lease_expires_at = v_at + v_lease,
           retain_until = greatest(k.retain_until, v_at + v_lease + (k.retain_until - k.lease_expires_at)),
           redrive_at = case when k.redrive_at is not null then v_at + v_lease end
     where k.id = r.id
    returning k.* into r;
  end if;

  return next (
    v_outcome, r.id, r.organization_id, r.scope, r.key,
    case when v_outcome = 'conflict' then null else r.request_hash end,
    r.status,
    case when v_outcome in ('claimed', 'reclaimed') then r.lease_token end,
    case when v_outcome = 'completed' then r.resource_type end,
    case when v_outcome = 'completed' then r.resource_id end,
    case when v_outcome = 'completed' then r.response end,
    r.claimed_at, r.lease_expires_at, r.retain_until,
    r.status = 'processing' and r.lease_expires_at > pg_catalog.clock_timestamp()
  )::agent.idempotency_claim_outcome;
end
$_$;

ALTER FUNCTION agent.idempotency_decide(p_organization_id uuid, p_scope text, p_key text, p_request_hash text, p_lease_token uuid, p_lease_ms bigint, p_retain_ms bigint, p_may_insert boolean, p_may_take_over boolean, p_request jsonb) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_delete_expired.sql

-- agent.idempotency_delete_expired
--
-- Retires the given claims (public) that are still past retention, as
-- agent.idempotency_retire_expired does (unfinished work is journaled as a
-- dead letter, never deleted); answers how many it deleted.

CREATE FUNCTION agent.idempotency_delete_expired(p_ids uuid[]) RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
begin
  return (select r.deleted from agent.idempotency_retire_expired(p_ids) r);
end
$$;

ALTER FUNCTION agent.idempotency_delete_expired(p_ids uuid[]) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_expired.sql

-- agent.idempotency_expired
--
-- The oldest claims past retention (public), for the sweeper; lease_token
-- never shown.

CREATE FUNCTION agent.idempotency_expired(p_limit integer) RETURNS SETOF agent.idempotency_rows
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
declare
  v_row agent.idempotency_rows;
begin
  if p_limit is null or p_limit not between 1 and agent.idempotency_row_cap() then
    raise exception 'p_limit must be between 1 and the plane''s row cap %, got %', agent.idempotency_row_cap(), p_limit
      using errcode = '22023';
  end if;
  for v_row in
    select k.id, k.organization_id, k.scope, k.key, k.request_hash, k.status, null::uuid,
           k.resource_type, k.resource_id, k.response, k.claimed_at, k.lease_expires_at,
           k.retain_until, k.reclaims
      from agent.idempotency_keys k
     where k.retain_until < now()
     order by k.retain_until, k.id
     limit p_limit
  loop
    return next v_row;
  end loop;
end
$$;

ALTER FUNCTION agent.idempotency_expired(p_limit integer) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_extend.sql

-- agent.idempotency_extend
--
-- The heartbeat (public): the lease's new end, p_lease_ms from now by the
-- database clock, or null when the claim is no longer this token's and its
-- holder must stop.

CREATE FUNCTION agent.idempotency_extend(p_claim_id uuid, p_lease_token uuid, p_lease_ms bigint, p_organization_id uuid DEFAULT NULL::uuid) RETURNS timestamp with time zone
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
declare
  v_lease interval;
  v_at timestamptz;
  v_end timestamptz;
begin
  if p_claim_id is null then
    raise exception 'p_claim_id is required' using errcode = '22023';
  end if;
  if p_lease_token is null then
    raise exception 'p_lease_token is required' using errcode = '22023';
  end if;
  if p_lease_ms is null or p_lease_ms not between 1000 and 86400000 then
    raise exception 'p_lease_ms must be between 1000 (one second) and 86400000 (one day), got %', p_lease_ms
      using errcode = '22023';
  end if;
  v_lease := p_lease_ms * interval '1 millisecond';
  v_at := pg_catalog.clock_timestamp();
  if p_organization_id is null then
    -- A caller that does not name the organization: found by id alone,
    -- which a partitioned table answers from every partition.
    update agent.idempotency_keys as k
       set lease_expires_at = v_at + v_lease,
           retain_until = greatest(k.retain_until, v_at + v_lease + (k.retain_until - k.lease_expires_at)),
           redrive_at = case when k.redrive_at is not null then v_at + v_lease end
     where k.id = p_claim_id
       and k.lease_token = p_lease_token
       and k.status = 'processing'
    returning k.lease_expires_at into v_end;
  else
    update agent.idempotency_keys as k
       set lease_expires_at = v_at + v_lease,
           retain_until = greatest(k.retain_until, v_at + v_lease + (k.retain_until - k.lease_expires_at)),
           redrive_at = case when k.redrive_at is not null then v_at + v_lease end
     where k.organization_id = p_organization_id
       and k.id = p_claim_id
       and k.lease_token = p_lease_token
       and k.status = 'processing'
    returning k.lease_expires_at into v_end;
  end if;
  return v_end;
end
$$;

ALTER FUNCTION agent.idempotency_extend(p_claim_id uuid, p_lease_token uuid, p_lease_ms bigint, p_organization_id uuid) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_failures.sql

-- agent.idempotency_failures
--
-- Lists journaled failures of a scope or family (public), oldest claim first.
-- Never writes.

CREATE FUNCTION agent.idempotency_failures(p_scope text, p_limit integer, p_organization_id uuid DEFAULT NULL::uuid, p_since timestamp with time zone DEFAULT NULL::timestamp with time zone, p_row_cap integer DEFAULT NULL::integer) RETURNS SETOF agent.idempotency_failure
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
declare
  v_prefix text;
begin
  v_prefix := agent.idempotency_failures_scope(p_scope, p_limit, p_row_cap);
  return query
    with failed as (
      select k.*
        from agent.idempotency_keys k
       where k.status = 'completed'
         and k.response -> 'ok' = 'false'::jsonb
         and (k.scope = p_scope or (v_prefix is not null and left(k.scope, char_length(v_prefix)) = v_prefix))
         and (p_organization_id is null or k.organization_id = p_organization_id)
         and (p_since is null or k.claimed_at >= p_since)
       order by k.claimed_at, k.id
       limit p_limit
    )
    select f.id, f.organization_id, f.scope, f.key, f.status, f.response ->> 'error', f.response,
           f.resource_type, f.resource_id, f.reclaims + 1, f.claimed_at, f.retain_until,
           f.request is not null, coalesce(jsonb_array_length(f.replaced), 0),
           (count(*) over ())::integer,
           coalesce((f.replaced -> 0 ->> 'claimed_at')::timestamptz, f.claimed_at)
      from failed f
     order by f.claimed_at, f.id;
end
$$;

ALTER FUNCTION agent.idempotency_failures(p_scope text, p_limit integer, p_organization_id uuid, p_since timestamp with time zone, p_row_cap integer) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_failures_scope.sql

-- agent.idempotency_failures_scope
--
-- Checks the scope, limit and row cap of agent.idempotency_failures and
-- agent.idempotency_redrive_failed, refusing an unknown scope (IDEM1);
-- answers a family's prefix (webhook. for webhook.*; the empty prefix for *,
-- every scope), or null for one scope. Private.

CREATE FUNCTION agent.idempotency_failures_scope(p_scope text, p_limit integer, p_row_cap integer) RETURNS text
    LANGUAGE plpgsql STABLE
    SET search_path TO ''
    AS $_$
declare
  v_prefix text;
  v_cap integer;
begin
  if p_scope is null then
    raise exception 'p_scope is required' using errcode = '22023';
  end if;
  if p_scope = '*' then
    v_prefix := '';
  elsif char_length(p_scope) > 128 or p_scope !~ '^[a-z0-9_-]+(\.[a-z0-9_-]+)*(\.\*)?$' then
    raise exception 'p_scope must be a scope (webhook.stripe), a family (webhook.*) or every scope (*), of a-z, 0-9, "_" and "-", got %',
                    pg_catalog.left(p_scope, 128)
      using errcode = '22023';
  end if;
  v_cap := agent.idempotency_row_cap(p_row_cap);
  if p_limit is null or p_limit not between 1 and v_cap then
    raise exception 'p_limit must be between 1 and the row cap %, got %', v_cap, p_limit
      using errcode = '22023',
            hint = 'every failure is answered; more than the row cap would be cut from the answer';
  end if;
  if p_scope <> '*' then
    v_prefix := case when right(p_scope, 2) = '.*' then left(p_scope, -1) end;
  end if;
  if (select p.retain from agent.idempotency_policy(p_scope) p) is null
     and not (v_prefix is not null and exists (select 1 from agent.idempotency_scopes s
                                               where left(s.scope, char_length(v_prefix)) = v_prefix)) then
    raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', p_scope
      using errcode = 'IDEM1',
            hint = 'add the scope (or its family, e.g. webhook.*) to agent.idempotency_scopes in a migration';
  end if;
  return v_prefix;
end
$_$;

ALTER FUNCTION agent.idempotency_failures_scope(p_scope text, p_limit integer, p_row_cap integer) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_get.sql

-- agent.idempotency_get
--
-- Reads one claim (public) without writing; never answers a lease token.

CREATE FUNCTION agent.idempotency_get(p_organization_id uuid, p_scope text, p_key text) RETURNS SETOF agent.idempotency_claim
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
declare
  v_claim agent.idempotency_claim;
begin
  if p_organization_id is null or p_scope is null
     or char_length(p_scope) not between 1 and 128 or p_scope ~ '[^a-z0-9._-]'
     or p_key is null or char_length(p_key) not between 1 and 512 then
    perform agent.idempotency_check_key(p_organization_id, p_scope, p_key);
  end if;
  if (select p.retain from agent.idempotency_policy(p_scope) p) is null then
    raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', p_scope
      using errcode = 'IDEM1';
  end if;
  for v_claim in
    select c.*
      from agent.idempotency_keys k
     cross join lateral agent.idempotency_claim_of(k) c
     where k.organization_id = p_organization_id
       and k.scope = p_scope
       and k.key = p_key
  loop
    v_claim.lease_token := null;
    return next v_claim;
  end loop;
end
$$;

ALTER FUNCTION agent.idempotency_get(p_organization_id uuid, p_scope text, p_key text) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_item_text.sql

-- agent.idempotency_item_text
--
-- A batch item's text field, refused (22023) when required and missing, or
-- not a string. Private.

CREATE FUNCTION agent.idempotency_item_text(p_item jsonb, p_index integer, p_field text, p_required boolean) RETURNS text
    LANGUAGE plpgsql IMMUTABLE
    SET search_path TO ''
    AS $$
declare
  v_kind text := jsonb_typeof(p_item -> p_field);
begin
  if v_kind is null or v_kind = 'null' then
    if p_required then
      raise exception 'p_items[%].% is required', p_index, p_field using errcode = '22023';
    end if;
    return null;
  end if;
  if v_kind <> 'string' then
    raise exception 'p_items[%].% must be a JSON string, got a JSON %', p_index, p_field, v_kind
      using errcode = '22023';
  end if;
  return p_item ->> p_field;
end
$$;

ALTER FUNCTION agent.idempotency_item_text(p_item jsonb, p_index integer, p_field text, p_required boolean) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_item_uuid.sql

-- agent.idempotency_item_uuid
--
-- A batch item's UUID field, refused (22023) when missing or malformed.
-- Private.

CREATE FUNCTION agent.idempotency_item_uuid(p_item jsonb, p_index integer, p_field text) RETURNS uuid
    LANGUAGE plpgsql IMMUTABLE
    SET search_path TO ''
    AS $_$
declare
  v_text text := agent.idempotency_item_text(p_item, p_index, p_field, true);
begin
  if v_text !~ '^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$' then
    raise exception 'p_items[%].% must be a UUID, got %', p_index, p_field, pg_catalog.left(v_text, 80)
      using errcode = '22023';
  end if;
  return v_text::uuid;
end
$_$;

ALTER FUNCTION agent.idempotency_item_uuid(p_item jsonb, p_index integer, p_field text) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_json_number.sql

-- agent.idempotency_json_number
--
-- The RFC 8785 (JSON Canonicalization Scheme) spelling of a JSON number (private):
-- the IEEE 754 double it denotes, written as ECMAScript's Number::toString
-- writes it (1.0 -> 1, 1e21 -> 1e+21, 1e-7 -> 1e-7). A number whose nearest
-- double is infinity (from 2^1024 - 2^970 up) is refused (22003): no client
-- could read it back.

CREATE FUNCTION agent.idempotency_json_number(p_number numeric) RETURNS text
    LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
    SET search_path TO ''
    SET extra_float_digits TO '1'
    AS $$
declare
  v_text text;
  v_parts text[];
  v_digits text;
  v_sign text := '';
  v_point integer;
  v_length integer;
begin
  -- 2^1024 - 2^970: from here on, the nearest double is infinity.
  if pg_catalog.abs(p_number) >= 179769313486231580793728971405303415079934132710037826936173778980444968292764750946649017977587207096330286416692887910946555547851940402630657488671505820681908902000708383676273854845817711531764475730270069855571366959622842914819860834936475292719074168444365510704342711559699508093042880177904174497792 then
    raise exception 'the number % is beyond every IEEE 754 double: a JSON reader reads it as infinity',
                    pg_catalog.left(p_number::text, 24) || case when pg_catalog.char_length(p_number::text) > 24 then '...' else '' end
      using errcode = '22003';
  end if;
  -- At most 2^-1075 (half the least double) rounds to zero.
  if p_number = 0 or pg_catalog.abs(p_number) * 404804506614621236704990693437834614099113299528284236713802716054860679135990693783920767402874248990374155728633623822779617474771586953734026799881477019843034848553132722728933815484186432682479535356945490137124014966849385397236206711298319112681620113024717539104666829230461005064372655017292012526615415482186989568 <= 1 then
    return '0';
  end if;
  -- PostgreSQL writes a double with the fewest digits that read back as
  -- it (extra_float_digits > 0); what follows only moves the point.
  v_text := p_number::double precision::text;
  if pg_catalog.left(v_text, 1) = '-' then
    v_sign := '-';
    v_text := pg_catalog.substr(v_text, 2);
  end if;
  v_parts := pg_catalog.regexp_match(v_text, '^([0-9]+)(?:\.([0-9]+))?(?:e([+-][0-9]+))?$');
  v_digits := v_parts[1] || coalesce(v_parts[2], '');
  -- The value is 0.<digits> * 10^v_point.
  v_point := pg_catalog.char_length(v_parts[1]) + coalesce(v_parts[3]::integer, 0);
  v_length := pg_catalog.char_length(v_digits);
  v_digits := pg_catalog.ltrim(v_digits, '0');
  v_point := v_point - (v_length - pg_catalog.char_length(v_digits));
  v_digits := pg_catalog.rtrim(v_digits, '0');
  v_length := pg_catalog.char_length(v_digits);
  -- ECMAScript's Number::toString, with k = v_length and n = v_point.
  if v_length <= v_point and v_point <= 21 then
    return v_sign || v_digits || pg_catalog.repeat('0', v_point - v_length);
  elsif 0 < v_point and v_point <= 21 then
    return v_sign || pg_catalog.left(v_digits, v_point) || '.' || pg_catalog.substr(v_digits, v_point + 1);
  elsif -6 < v_point and v_point <= 0 then
    return v_sign || '0.' || pg_catalog.repeat('0', -v_point) || v_digits;
  end if;
  return v_sign || pg_catalog.left(v_digits, 1)
         || case when v_length > 1 then '.' || pg_catalog.substr(v_digits, 2) else '' end
         || 'e' || case when v_point > 0 then '+' else '-' end || pg_catalog.abs(v_point - 1)::text;
end;
$$;

ALTER FUNCTION agent.idempotency_json_number(p_number numeric) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_json_size.sql

-- agent.idempotency_json_size
--
-- The size of a JSON value as compact JSON text, in bytes: what the store
-- limits (max_response_bytes, max_request_bytes) count. Private.

CREATE FUNCTION agent.idempotency_json_size(p_value jsonb) RETURNS bigint
    LANGUAGE plpgsql IMMUTABLE
    SET search_path TO ''
    AS $$
declare
  v_text text := p_value::text;
  v_bare text := pg_catalog.regexp_replace(v_text, '"(?:[^"\\]|\\.)*"', '', 'g');
begin
  return octet_length(v_text)
         - (octet_length(v_bare) - octet_length(pg_catalog.replace(v_bare, ', ', ','))
            + octet_length(v_bare) - octet_length(pg_catalog.replace(v_bare, ': ', ':')));
end
$$;

ALTER FUNCTION agent.idempotency_json_size(p_value jsonb) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_orphans.sql

-- agent.idempotency_orphans
--
-- Per scope, how many orphans wait and since when (public); for idem doctor.
-- Never writes.

CREATE FUNCTION agent.idempotency_orphans(p_limit integer DEFAULT 100) RETURNS SETOF agent.idempotency_orphaned_scope
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
begin
  if p_limit is null or p_limit not between 1 and least(1000, agent.idempotency_row_cap()) then
    raise exception 'p_limit must be between 1 and % scopes (1000, or the plane''s row cap when lower), got %',
                    least(1000, agent.idempotency_row_cap()), p_limit
      using errcode = '22023';
  end if;
  return query
    select k.scope, count(*), min(k.redrive_at),
           (extract(epoch from pg_catalog.clock_timestamp() - min(k.redrive_at)) * 1000)::bigint
      from agent.idempotency_keys k
     where k.redrive_at <= pg_catalog.clock_timestamp()
       and k.status = 'processing'
     group by k.scope
     order by count(*) desc, k.scope
     limit p_limit;
end
$$;

ALTER FUNCTION agent.idempotency_orphans(p_limit integer) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_policies.sql

-- agent.idempotency_policies
--
-- The policies that govern a scope or a family (public), for idem doctor
-- and operators: for one scope (webhook.stripe), the row that applies to it,
-- its own or its family's; for a family (webhook.*), that row and every row
-- under the family, so an exact scope that keeps less than its family shows
-- too. Each with its retention in milliseconds. Never writes.

CREATE FUNCTION agent.idempotency_policies(p_scope text) RETURNS TABLE(scope text, retain_ms bigint, max_response_bytes integer, max_request_bytes integer, max_attempts integer)
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $_$
declare
  v_prefix text;
  v_governs text;
begin
  if p_scope is null or char_length(p_scope) > 128 or p_scope !~ '^[a-z0-9_-]+(\.[a-z0-9_-]+)*(\.\*)?$' then
    raise exception 'p_scope must be a scope (webhook.stripe) or a family (webhook.*) of a-z, 0-9, "_" and "-", got %',
                    pg_catalog.left(p_scope, 128)
      using errcode = '22023';
  end if;
  v_prefix := case when right(p_scope, 2) = '.*' then left(p_scope, -1) end;
  select s.scope into v_governs
    from agent.idempotency_scopes s
   where s.scope = p_scope
      or (s.scope like '%.*'
          and char_length(p_scope) > char_length(s.scope) - 1
          and left(p_scope, char_length(s.scope) - 1) = left(s.scope, -1))
   order by s.scope = p_scope desc, char_length(s.scope) desc
   limit 1;
  return query
    select s.scope, (extract(epoch from s.retain) * 1000)::bigint, s.max_response_bytes, s.max_request_bytes,
           s.max_attempts
      from agent.idempotency_scopes s
     where s.scope = v_governs
        or (v_prefix is not null and left(s.scope, char_length(v_prefix)) = v_prefix)
     order by s.scope;
end
$_$;

ALTER FUNCTION agent.idempotency_policies(p_scope text) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_policy.sql

-- agent.idempotency_policy
--
-- A scope's policy: its own row, or its family's (tool.* covers tool.search).
-- Private.

CREATE FUNCTION agent.idempotency_policy(p_scope text, OUT retain interval, OUT max_response_bytes integer, OUT max_request_bytes integer, OUT max_attempts integer) RETURNS record
    LANGUAGE plpgsql STABLE
    SET search_path TO ''
    AS $$
begin
  select s.retain, s.max_response_bytes, s.max_request_bytes, s.max_attempts
    into retain, max_response_bytes, max_request_bytes, max_attempts
    from agent.idempotency_scopes s
   where s.scope = p_scope
      or (s.scope like '%.*'
          and char_length(p_scope) > char_length(s.scope) - 1
          and left(p_scope, char_length(s.scope) - 1) = left(s.scope, -1))
   order by s.scope = p_scope desc, char_length(s.scope) desc
   limit 1;
end
$$;

ALTER FUNCTION agent.idempotency_policy(p_scope text, OUT retain interval, OUT max_response_bytes integer, OUT max_request_bytes integer, OUT max_attempts integer) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_private_functions.sql

-- agent.idempotency_private_functions
--
-- The event trigger's function (80_event_trigger.sql), private: revokes
-- EXECUTE from PUBLIC, anon and authenticated on every function created in,
-- or moved into, schema agent, and on every function there that is altered or
-- replaced, so a grant to those roles does not survive a later CREATE OR
-- REPLACE. It runs as the role that ran the command, which owns the function
-- or is a superuser, so it may revoke. Owned by the role that applies the
-- schema.

CREATE FUNCTION agent.idempotency_private_functions() RETURNS event_trigger
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $$
declare
  v_routine regprocedure;
begin
  for v_routine in
    select c.objid
      from pg_catalog.pg_event_trigger_ddl_commands() c
     where c.classid = 'pg_catalog.pg_proc'::regclass
       and c.schema_name = 'agent'
  loop
    execute format('revoke execute on routine %s from public, anon, authenticated', v_routine);
  end loop;
end
$$;

-- supabase/schemas/40_function_idempotency_queue_check.sql

-- agent.idempotency_queue_check
--
-- Refuses a queue name pgmq would not have made (private): its tables are
-- named after it (q_<name>, a_<name>), so a name is 1 to 47 characters of
-- a-z, 0-9 and _.

CREATE FUNCTION agent.idempotency_queue_check(p_name text, p_argument text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
    SET search_path TO ''
    AS $$
begin
  if p_name is null or p_name !~ '^[a-z0-9_]{1,47}$' then
    raise exception '% must be a pgmq queue name (1 to 47 characters of a-z, 0-9 and _), got %',
                    p_argument, pg_catalog.left(p_name, 64)
      using errcode = '22023';
  end if;
end
$$;

ALTER FUNCTION agent.idempotency_queue_check(p_name text, p_argument text) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_queue_extend.sql

-- agent.idempotency_queue_extend
--
-- A heartbeat for a batch taken from a queue (public): extends each claim's
-- lease, fenced by its token, and keeps its messages hidden as long (the
-- lease and a second more), in one transaction; answers each item's new
-- lease end, or null for a claim that is no longer the caller's.

CREATE FUNCTION agent.idempotency_queue_extend(p_queue text, p_lease_ms bigint, p_items jsonb, p_row_cap integer DEFAULT NULL::integer) RETURNS SETOF agent.idempotency_queue_extended
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $_$
declare
  v_items agent.idempotency_queue_ending[];
  v_item agent.idempotency_queue_ending;
  v_orgs uuid[];
  v_claims uuid[];
  v_locked bigint[];
  v_end timestamptz;
  v_visible integer;
begin
  perform agent.idempotency_queue_check(p_queue, 'p_queue');
  if p_lease_ms is null or p_lease_ms not between 1000 and 86400000 then
    raise exception 'p_lease_ms must be between 1000 (one second) and 86400000 (one day), got %', p_lease_ms
      using errcode = '22023';
  end if;
  v_visible := (p_lease_ms + 999) / 1000 + 1;
  v_items := agent.idempotency_queue_items(p_items, p_row_cap, false);
  select pg_catalog.array_agg(i.organization_id order by i.item), pg_catalog.array_agg(i.claim_id order by i.item)
    into v_orgs, v_claims
    from pg_catalog.unnest(v_items) i;
  select coalesce(pg_catalog.array_agg(distinct m order by m), '{}') into v_locked
    from pg_catalog.unnest(v_items) i
   cross join lateral pg_catalog.unnest(i.msg_ids) m;
  perform agent.idempotency_queue_lock(p_queue, v_locked, v_orgs, v_claims);
  foreach v_item in array v_items loop
    v_end := agent.idempotency_extend(v_item.claim_id, v_item.lease_token, p_lease_ms, v_item.organization_id);
    if v_end is not null then
      for i in 1 .. coalesce(pg_catalog.cardinality(v_item.msg_ids), 0) loop
        perform pgmq.set_vt(p_queue, v_item.msg_ids[i], v_visible);
      end loop;
    end if;
    return next (v_item.item, v_end)::agent.idempotency_queue_extended;
  end loop;
end
$_$;

ALTER FUNCTION agent.idempotency_queue_extend(p_queue text, p_lease_ms bigint, p_items jsonb, p_row_cap integer) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_queue_items.sql

-- agent.idempotency_queue_items
--
-- The items of a queue settle or extend, checked whole before anything is
-- written (private): organization_id, claim_id, lease_token and msg_ids (the
-- message and its copies; empty for a re-driven claim), and for a settle the
-- ending (journal with a response or a resource, release, or leave). One
-- array, in input order. Every item is checked in one statement; only when
-- one is malformed are the items read again one by one, to say which and
-- what is wrong with it.

CREATE FUNCTION agent.idempotency_queue_items(p_items jsonb, p_row_cap integer, p_endings boolean) RETURNS agent.idempotency_queue_ending[]
    LANGUAGE plpgsql STABLE
    SET search_path TO ''
    AS $_$
declare
  v_item jsonb;
  v_index integer;
  v_bad integer;
  v_ending text;
  v_resource text;
  v_items agent.idempotency_queue_ending[];
  c_uuid constant text := '^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$';
  c_ids constant jsonpath := 'strict $[*] ? (@.type() != "number" || @ < 1 || @ > 9223372036854775807 || @.floor() != @)';
begin
  perform agent.idempotency_check_batch(p_items, p_row_cap);
  select (e.ordinality - 1)::integer into v_bad
    from pg_catalog.jsonb_array_elements(p_items) with ordinality e
   where not coalesce(
           pg_catalog.jsonb_typeof(e.value) = 'object'
           and pg_catalog.jsonb_typeof(e.value -> 'organization_id') = 'string'
           and (e.value ->> 'organization_id') ~ c_uuid
           and pg_catalog.jsonb_typeof(e.value -> 'claim_id') = 'string'
           and (e.value ->> 'claim_id') ~ c_uuid
           and pg_catalog.jsonb_typeof(e.value -> 'lease_token') = 'string'
           and (e.value ->> 'lease_token') ~ c_uuid
           and pg_catalog.jsonb_typeof(e.value -> 'msg_ids') = 'array'
           and not pg_catalog.jsonb_path_exists(e.value -> 'msg_ids', c_ids)
           and (not p_endings
                or (pg_catalog.jsonb_typeof(e.value -> 'ending') = 'string'
                    and (e.value ->> 'ending') in ('journal', 'release', 'leave')
                    and ((e.value ->> 'ending') <> 'journal'
                         or (coalesce(pg_catalog.jsonb_typeof(e.value -> 'resource_type'), 'null') in ('null', 'string')
                             and coalesce(pg_catalog.jsonb_typeof(e.value -> 'resource_id'), 'null') in ('null', 'string')
                             and (nullif(e.value -> 'response', 'null'::jsonb) is not null
                                  or nullif(e.value ->> 'resource_id', '') is not null))))),
           false)
   order by e.ordinality
   limit 1;
  if v_bad is not null then
    -- Say what is wrong with the first malformed item.
    for v_item, v_index in select e.value, (e.ordinality - 1)::integer
                             from pg_catalog.jsonb_array_elements(p_items) with ordinality e
                            where e.ordinality <= v_bad + 1 loop
      perform agent.idempotency_check_item(v_item, v_index);
      if pg_catalog.jsonb_typeof(v_item -> 'msg_ids') is distinct from 'array'
         or pg_catalog.jsonb_path_exists(v_item -> 'msg_ids', c_ids) then
        raise exception 'p_items[%].msg_ids must be an array of message ids (empty for a re-driven claim)', v_index
          using errcode = '22023';
      end if;
      if p_endings then
        v_ending := agent.idempotency_item_text(v_item, v_index, 'ending', true);
        if v_ending not in ('journal', 'release', 'leave') then
          raise exception 'p_items[%].ending must be journal, release or leave, got %', v_index, pg_catalog.left(v_ending, 40)
            using errcode = '22023';
        end if;
        if v_ending = 'journal' then
          perform agent.idempotency_item_text(v_item, v_index, 'resource_type', false);
          v_resource := nullif(agent.idempotency_item_text(v_item, v_index, 'resource_id', false), '');
          if nullif(v_item -> 'response', 'null'::jsonb) is null and v_resource is null then
            raise exception 'p_items[%] is journaled with neither a response nor a resource; a journal carries one', v_index
              using errcode = '22023';
          end if;
        end if;
      end if;
      perform agent.idempotency_item_uuid(v_item, v_index, 'organization_id');
      perform agent.idempotency_item_uuid(v_item, v_index, 'claim_id');
      perform agent.idempotency_item_uuid(v_item, v_index, 'lease_token');
    end loop;
    raise exception 'p_items[%] is malformed', v_bad using errcode = '22023';
  end if;
  select pg_catalog.array_agg(
           ((e.ordinality - 1)::integer, (e.value ->> 'organization_id')::uuid, (e.value ->> 'claim_id')::uuid,
            (e.value ->> 'lease_token')::uuid,
            coalesce((select pg_catalog.array_agg(m.value::text::bigint order by m.ordinality)
                        from pg_catalog.jsonb_array_elements(e.value -> 'msg_ids') with ordinality m), '{}'),
            case when p_endings then e.value ->> 'ending' end,
            case when p_endings and (e.value ->> 'ending') = 'journal' then nullif(e.value -> 'response', 'null'::jsonb) end,
            case when p_endings and (e.value ->> 'ending') = 'journal' then nullif(e.value ->> 'resource_type', '') end,
            case when p_endings and (e.value ->> 'ending') = 'journal' then nullif(e.value ->> 'resource_id', '') end
           )::agent.idempotency_queue_ending
           order by e.ordinality)
    into v_items
    from pg_catalog.jsonb_array_elements(p_items) with ordinality e;
  return v_items;
end
$_$;

ALTER FUNCTION agent.idempotency_queue_items(p_items jsonb, p_row_cap integer, p_endings boolean) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_queue_letter.sql

-- agent.idempotency_queue_letter
--
-- Sends one dead letter (private): the message's members and a dead_letter
-- member saying where it came from and how it failed (queue, msg_id, reads,
-- the message as read, the failure), as the consumers' dead letters always
-- were. A malformed message goes as its text (message_text), so the
-- dead-letter queue stays readable by every client.

CREATE FUNCTION agent.idempotency_queue_letter(p_queue text, p_dead_letter_queue text, p_msg_id bigint, p_read_ct integer, p_message jsonb, p_failure jsonb) RETURNS void
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $$
begin
  if p_failure ->> 'error' = 'malformed_message' then
    -- What no client could read goes on as text, so the dead-letter queue
    -- stays readable by every client.
    perform pgmq.send(p_dead_letter_queue,
                      pg_catalog.jsonb_build_object(
                        'dead_letter', pg_catalog.jsonb_build_object(
                          'queue', p_queue, 'msg_id', p_msg_id, 'reads', p_read_ct, 'message_text', p_message::text,
                          'failure', pg_catalog.jsonb_build_object(
                            'ok', false, 'error', p_failure -> 'error', 'output', p_failure -> 'output'))));
    return;
  end if;
  perform pgmq.send(p_dead_letter_queue,
                    case when pg_catalog.jsonb_typeof(p_message) = 'object' then p_message else '{}'::jsonb end
                    || pg_catalog.jsonb_build_object(
                         'dead_letter', pg_catalog.jsonb_build_object(
                           'queue', p_queue, 'msg_id', p_msg_id, 'reads', p_read_ct, 'message', p_message,
                           'failure', pg_catalog.jsonb_build_object(
                             'ok', false, 'error', p_failure -> 'error', 'output', p_failure -> 'output'))));
end
$$;

ALTER FUNCTION agent.idempotency_queue_letter(p_queue text, p_dead_letter_queue text, p_msg_id bigint, p_read_ct integer, p_message jsonb, p_failure jsonb) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_queue_lock.sql

-- agent.idempotency_queue_lock
--
-- Locks messages and claims in the one order every queue function takes them
-- (private): the messages by id first, then the claims in (organization,
-- scope, key) order, as a take locks them (pgmq's read, then the claims), so
-- no two queue calls wait for each other in a cycle.

CREATE FUNCTION agent.idempotency_queue_lock(p_queue text, p_msg_ids bigint[], p_organizations uuid[], p_claim_ids uuid[]) RETURNS void
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $_$
begin
  if pg_catalog.cardinality(p_msg_ids) > 0 then
    execute pg_catalog.format('select 1 from pgmq.%I q where q.msg_id = any ($1) order by q.msg_id for update',
                              'q_' || p_queue)
      using p_msg_ids;
  end if;
  perform 1
     from agent.idempotency_keys k
     join rows from (pg_catalog.unnest(p_organizations), pg_catalog.unnest(p_claim_ids)) c(organization_id, id)
       on k.organization_id = c.organization_id and k.id = c.id
    order by k.organization_id, k.scope, k.key
      for update of k;
end
$_$;

ALTER FUNCTION agent.idempotency_queue_lock(p_queue text, p_msg_ids bigint[], p_organizations uuid[], p_claim_ids uuid[]) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_queue_privileges.sql

-- agent.idempotency_queue_privileges
--
-- The privileges the queue functions need on one queue and its dead-letter
-- queue, as GRANT statements for the queues' owner to run (private; on
-- Supabase the postgres role, in the SQL editor: select ... \gexec, or
-- copied into a migration). Never runs them itself. The plane's owner gets
-- no more than its functions use: pgmq's read, archive, send and set_vt; on
-- the queue's table what read (hide and count: select, update) and archive
-- (delete) do; on its archive the rows archive inserts and the ids it reads
-- back; on the dead-letter queue's table the letters send inserts and the
-- ids it reads back. Nothing on any other queue, and nothing to an API role.

CREATE FUNCTION agent.idempotency_queue_privileges(p_queue text, p_dead_letter_queue text) RETURNS SETOF text
    LANGUAGE plpgsql STABLE
    SET search_path TO ''
    AS $$
begin
  perform agent.idempotency_queue_check(p_queue, 'p_queue');
  perform agent.idempotency_queue_check(p_dead_letter_queue, 'p_dead_letter_queue');
  return next 'grant usage on schema pgmq to idempotency_owner';
  return query
    select pg_catalog.format('grant execute on function %s to idempotency_owner', p.oid::pg_catalog.regprocedure)
      from pg_catalog.pg_proc p
     where p.pronamespace = (select n.oid from pg_catalog.pg_namespace n where n.nspname = 'pgmq')
       and p.proname in ('read', 'archive', 'send', 'set_vt')
     order by p.proname, p.oid::pg_catalog.regprocedure::text;
  return next pg_catalog.format('grant select, update, delete on pgmq.%I to idempotency_owner', 'q_' || p_queue);
  return next pg_catalog.format('grant insert, select (msg_id) on pgmq.%I to idempotency_owner', 'a_' || p_queue);
  return next pg_catalog.format('grant insert, select (msg_id) on pgmq.%I to idempotency_owner',
                                'q_' || p_dead_letter_queue);
end
$$;

ALTER FUNCTION agent.idempotency_queue_privileges(p_queue text, p_dead_letter_queue text) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_queue_settle.sql

-- agent.idempotency_queue_settle
--
-- Ends a batch taken from a queue (public), in one transaction: journals each
-- item's ending fenced by its token, and archives exactly the messages whose
-- ending it journaled (a message is archived if and only if its ending is
-- journaled); a journaled failure is sent to the dead-letter queue once per
-- command (recorded in dead_lettered_at), then archived. A release frees the
-- claim and leaves its messages to come back; leave does nothing (an effect
-- whose outcome is unknown stays under its lease). An item whose claim is no
-- longer the caller's journals nothing and archives nothing. A repeat after a
-- lost answer journals and sends nothing twice.

CREATE FUNCTION agent.idempotency_queue_settle(p_queue text, p_dead_letter_queue text, p_items jsonb, p_row_cap integer DEFAULT NULL::integer) RETURNS SETOF agent.idempotency_queue_settled
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $_$
declare
  v_items agent.idempotency_queue_ending[];
  v_item agent.idempotency_queue_ending;
  v_orgs uuid[];
  v_claims uuid[];
  v_locked bigint[];
  v_row agent.idempotency_claim;
  v_archive bigint[] := '{}'::bigint[];
  v_body jsonb;
  v_reads integer;
  v_request jsonb;
  v_key text;
  v_lettered boolean;
  v_state text;
  v_message text;
  v_hint text;
  v_index integer;
begin
  perform agent.idempotency_queue_check(p_queue, 'p_queue');
  perform agent.idempotency_queue_check(p_dead_letter_queue, 'p_dead_letter_queue');
  v_items := agent.idempotency_queue_items(p_items, p_row_cap, true);
  select pg_catalog.array_agg(i.organization_id order by i.item), pg_catalog.array_agg(i.claim_id order by i.item)
    into v_orgs, v_claims
    from pg_catalog.unnest(v_items) i;
  select coalesce(pg_catalog.array_agg(distinct m order by m), '{}') into v_locked
    from pg_catalog.unnest(v_items) i
   cross join lateral pg_catalog.unnest(i.msg_ids) m
   where i.ending = 'journal';
  perform agent.idempotency_queue_lock(p_queue, v_locked, v_orgs, v_claims);

  begin
    foreach v_item in array v_items loop
      v_index := v_item.item;
      v_lettered := false;
      if v_item.ending = 'journal' then
        select * into v_row
          from agent.idempotency_complete(v_item.claim_id, v_item.lease_token, v_item.resource_type,
                                          v_item.resource_id, v_item.response, v_item.organization_id);
        if not found then
          -- The claim is no longer this caller's: its messages stay, and
          -- come back to whoever holds it now.
          return next (v_index, false, 0, false)::agent.idempotency_queue_settled;
          continue;
        end if;
        if v_row.response -> 'ok' = 'false'::jsonb then
          update agent.idempotency_keys k
             set dead_lettered_at = pg_catalog.clock_timestamp()
           where k.organization_id = v_item.organization_id and k.id = v_item.claim_id
             and k.dead_lettered_at is null
          returning k.request, k.key into v_request, v_key;
          if found then
            v_body := null;
            v_reads := null;
            if pg_catalog.cardinality(v_item.msg_ids) > 0 then
              execute pg_catalog.format('select q.message, q.read_ct from pgmq.%I q where q.msg_id = $1',
                                        'q_' || p_queue)
                into v_body, v_reads
                using v_item.msg_ids[1];
            end if;
            perform agent.idempotency_queue_letter(
                      p_queue, p_dead_letter_queue, v_item.msg_ids[1], v_reads,
                      coalesce(v_body, pg_catalog.jsonb_build_object('idempotency_key', v_key, 'organization_id', v_item.organization_id,
                                                                 'payload', v_request)),
                      v_row.response);
            v_lettered := true;
          end if;
        end if;
        v_archive := v_archive || v_item.msg_ids;
        return next (v_index, true, pg_catalog.cardinality(v_item.msg_ids), v_lettered)::agent.idempotency_queue_settled;
      elsif v_item.ending = 'release' then
        -- Whether the fence still held changes nothing here: the message is left either way.
        perform agent.idempotency_release(v_item.claim_id, v_item.lease_token, v_item.organization_id);
        return next (v_index, false, 0, false)::agent.idempotency_queue_settled;
      else
        return next (v_index, false, 0, false)::agent.idempotency_queue_settled;
      end if;
    end loop;
  exception when others then
    get stacked diagnostics v_state = returned_sqlstate, v_message = message_text, v_hint = pg_exception_hint;
    raise exception 'p_items[%]: %', v_index, v_message using errcode = v_state, hint = v_hint;
  end;
  if pg_catalog.cardinality(v_archive) > 0 then
    perform pgmq.archive(p_queue, v_archive);
  end if;
end
$_$;

ALTER FUNCTION agent.idempotency_queue_settle(p_queue text, p_dead_letter_queue text, p_items jsonb, p_row_cap integer) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_queue_take.sql

-- agent.idempotency_queue_take
--
-- Takes a batch from a pgmq queue (public): reads up to one message per lease
-- token the caller supplies, each hidden for the lease and a second more, and
-- claims each under its idempotency key in the same transaction, storing the
-- message's payload with its claim as work. Answers per message, in message
-- order: claimed or reclaimed (run it, under the token answered), completed
-- (its answer was journaled before: archived here, never run again), a copy
-- (its key is an earlier message's of this batch, with the same payload: it
-- ends with that message), processing (held elsewhere: left to come back),
-- conflict (the key answers for another payload) or malformed (no client
-- could read or hash it); the last two are dead-lettered and archived here.
-- A claimed message read more than p_max_reads times is journaled as the
-- failure dead_lettered instead of run. A failure is sent to the dead-letter
-- queue once per command: a copy of a command whose failure was dead-lettered
-- is archived beside that letter. Slots the queue did not fill take over the
-- scope's work whose worker stopped, or that an operator sent back after a
-- fix (agent.idempotency_redrive), answered as redriven with their payload.
-- A message may name its organization_id; it must be one of p_organizations
-- (p_organization_id alone by default). The tokens are the caller's, one per
-- slot, as a claim's; a lost answer leaves what it took to its lease, as a
-- worker that stopped would. Needs the pgmq privileges that
-- agent.idempotency_queue_privileges lists.

CREATE FUNCTION agent.idempotency_queue_take(p_queue text, p_dead_letter_queue text, p_organization_id uuid, p_lease_ms bigint, p_lease_tokens uuid[], p_max_reads integer DEFAULT 5, p_scope text DEFAULT NULL::text, p_organizations uuid[] DEFAULT NULL::uuid[], p_row_cap integer DEFAULT NULL::integer) RETURNS SETOF agent.idempotency_queue_item
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $_$
declare
  v_scope text := coalesce(p_scope, 'queue.' || p_queue);
  v_cap integer;
  v_count integer;
  v_earlier integer;
  v_index integer;
  v_accepted uuid[];
  v_visible integer;
  v_max_work integer;
  v_items agent.idempotency_queue_item[] := '{}'::agent.idempotency_queue_item[];
  v_item agent.idempotency_queue_item;
  v_hashes text[] := '{}'::text[];
  v_message record;
  v_body jsonb;
  v_key text;
  v_org uuid;
  v_reason text;
  v_claims jsonb;
  v_claim record;
  v_orgs uuid[];
  v_first integer;
  v_firsts integer[];
  v_failure jsonb;
  v_archive bigint[] := '{}'::bigint[];
  v_work record;
  -- 2^1024 - 2^970: from here on the nearest IEEE 754 double is infinity,
  -- which no JSON reader of a client can hash or hand on.
  c_beyond constant jsonb := pg_catalog.jsonb_build_object('max', 179769313486231580793728971405303415079934132710037826936173778980444968292764750946649017977587207096330286416692887910946555547851940402630657488671505820681908902000708383676273854845817711531764475730270069855571366959622842914819860834936475292719074168444365510704342711559699508093042880177904174497792::numeric);
begin
  perform agent.idempotency_queue_check(p_queue, 'p_queue');
  perform agent.idempotency_queue_check(p_dead_letter_queue, 'p_dead_letter_queue');
  if p_dead_letter_queue = p_queue then
    raise exception 'p_dead_letter_queue must be another queue than p_queue %', p_queue using errcode = '22023';
  end if;
  if p_lease_ms is null or p_lease_ms not between 1000 and 86400000 then
    raise exception 'p_lease_ms must be between 1000 (one second) and 86400000 (one day), got %', p_lease_ms
      using errcode = '22023';
  end if;
  if p_max_reads is null or p_max_reads < 1 then
    raise exception 'p_max_reads must be at least 1, got %', p_max_reads using errcode = '22023';
  end if;
  if char_length(v_scope) > 128 or v_scope !~ '^[a-z0-9_-]+(\.[a-z0-9_-]+)*$' then
    raise exception 'p_scope must be a scope of a-z, 0-9, ".", "_" and "-", got %', pg_catalog.left(v_scope, 128)
      using errcode = '22023';
  end if;
  v_accepted := coalesce(p_organizations, array[p_organization_id]::uuid[]);
  if pg_catalog.array_position(v_accepted, null) is not null or pg_catalog.cardinality(v_accepted) = 0 then
    raise exception 'p_organization_id or p_organizations must name the organizations whose messages this consumer takes'
      using errcode = '22023';
  end if;
  if p_organization_id is not null and p_organization_id <> all (v_accepted) then
    raise exception 'p_organization_id % is not among p_organizations', p_organization_id using errcode = '22023';
  end if;
  v_cap := agent.idempotency_row_cap(p_row_cap);
  v_count := coalesce(pg_catalog.cardinality(p_lease_tokens), 0);
  if v_count not between 1 and v_cap then
    raise exception 'p_lease_tokens must hold between 1 and the row cap % tokens, got %', v_cap, v_count
      using errcode = '22023',
            hint = 'one fresh token per message (or re-drive) the call may take: the answer names every one';
  end if;
  if pg_catalog.array_position(p_lease_tokens, null) is not null then
    raise exception 'p_lease_tokens[%] is NULL', pg_catalog.array_position(p_lease_tokens, null) - 1
      using errcode = '22023';
  end if;
  select t.first - 1, t.i - 1 into v_earlier, v_index
    from (select i, pg_catalog.min(i) over (partition by p_lease_tokens[i]) as first
            from pg_catalog.generate_subscripts(p_lease_tokens, 1) i) t
   where t.i > t.first
   order by t.i
   limit 1;
  if v_earlier is not null then
    raise exception 'p_lease_tokens[%] repeats p_lease_tokens[%]: each message needs a token of its own', v_index, v_earlier
      using errcode = '22023';
  end if;
  select p.max_request_bytes into v_max_work from agent.idempotency_policy(v_scope) p;
  if v_max_work is null then
    raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', v_scope
      using errcode = 'IDEM1',
            hint = 'add the scope (or its family, queue.*) to agent.idempotency_scopes in a migration';
  end if;

  -- Read: each message hidden for the lease and a second more, so it comes
  -- back only once its claim may be taken over.
  v_visible := (p_lease_ms + 999) / 1000 + 1;
  for v_message in
    select r.msg_id, r.read_ct, r.enqueued_at, r.message
      from pgmq.read(p_queue, v_visible, v_count) r
     order by r.msg_id
  loop
    v_body := v_message.message;
    v_reason := null;
    v_key := null;
    v_org := null;
    if v_body is null or pg_catalog.jsonb_typeof(v_body) <> 'object' then
      v_reason := 'the message is not a JSON object';
    elsif pg_catalog.jsonb_path_exists(v_body, 'strict $.** ? (@.type() == "number" && (@ >= $max || @ <= -$max))',
                                       c_beyond) then
      v_reason := 'the message holds a number beyond every IEEE 754 double, which a client reads as infinity';
    else
      case pg_catalog.jsonb_typeof(v_body -> 'idempotency_key')
        when 'string' then
          v_key := v_body ->> 'idempotency_key';
          if char_length(v_key) not between 1 and 512 then
            v_reason := 'idempotency_key must have 1 to 512 characters';
          end if;
        when 'null' then
          v_key := 'msg-' || v_message.msg_id;
        else
          if v_body ? 'idempotency_key' then
            v_reason := 'idempotency_key is not a string';
          else
            v_key := 'msg-' || v_message.msg_id;
          end if;
      end case;
      if v_reason is null then
        case coalesce(pg_catalog.jsonb_typeof(v_body -> 'organization_id'), 'null')
          when 'null' then
            v_org := p_organization_id;
            if v_org is null then
              v_reason := 'the message names no organization_id, and this consumer has no default one';
            end if;
          when 'string' then
            if (v_body ->> 'organization_id') ~* '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$' then
              v_org := (v_body ->> 'organization_id')::uuid;
              if v_org <> all (v_accepted) then
                v_reason := 'organization_id ' || v_org || ' is not one this consumer accepts';
              end if;
            else
              v_reason := 'organization_id is not a UUID';
            end if;
          else
            v_reason := 'organization_id is not a UUID';
        end case;
      end if;
      if v_reason is null and pg_catalog.octet_length((v_body -> 'payload')::text) > v_max_work
         and agent.idempotency_json_size(v_body -> 'payload') > v_max_work then
        v_reason := 'the payload is above the ' || v_max_work || ' bytes scope ' || v_scope
                    || ' keeps, so a failure could not be run again after a fix';
      end if;
    end if;
    v_item := (v_message.msg_id, v_message.read_ct, v_message.enqueued_at,
               case when v_reason is null then v_body end, v_org, v_key,
               case when v_reason is null then 'unclaimed' else 'malformed' end,
               null, null, null, null, null, null, null,
               case when v_reason is null then coalesce(v_body -> 'payload', 'null'::jsonb) end,
               null, false, false, v_reason, null)::agent.idempotency_queue_item;
    v_items := v_items || v_item;
    v_hashes := v_hashes || case when v_reason is null
                                 then agent.idempotency_request_hash(coalesce(v_body -> 'payload', 'null'::jsonb)) end;
  end loop;

  -- A message no client can read is dead-lettered alone, at once.
  for i in 1 .. coalesce(pg_catalog.cardinality(v_items), 0) loop
    if v_items[i].outcome = 'malformed' then
      select r.message into v_body from pgmq.set_vt(p_queue, v_items[i].msg_id, v_visible) r;
      perform agent.idempotency_queue_letter(p_queue, p_dead_letter_queue, v_items[i].msg_id, v_items[i].read_ct, v_body,
                                             pg_catalog.jsonb_build_object('error', 'malformed_message',
                                                                           'output', pg_catalog.jsonb_build_object('reason', v_items[i].reason)));
      v_items[i].dead_lettered := true;
      v_items[i].archived := true;
      v_archive := v_archive || v_items[i].msg_id;
    end if;
  end loop;

  -- Claim: one batch per organization, in organization order (each batch
  -- locks its keys in key order), every message under its own token; a key
  -- twice among them is decided by its first message, the others are its
  -- copies and end with it.
  select pg_catalog.array_agg(distinct t.organization_id order by t.organization_id) into v_orgs
    from pg_catalog.unnest(v_items) t
   where t.outcome = 'unclaimed';
  -- Each message to claim, and the first message of its key.
  select pg_catalog.array_agg(f.first order by f.n) into v_firsts
    from (select n, case when v_items[n].outcome = 'unclaimed'
                         then pg_catalog.min(n) over (partition by v_items[n].outcome, v_items[n].organization_id,
                                                                   v_items[n].key) end as first
            from pg_catalog.generate_subscripts(v_items, 1) n) f;
  for v_org in select pg_catalog.unnest(coalesce(v_orgs, '{}')) loop
    select pg_catalog.jsonb_agg(pg_catalog.jsonb_build_object(
             'key', v_items[i].key, 'request_hash', v_hashes[i], 'lease_token', p_lease_tokens[i],
             'request', v_items[i].payload) order by i)
      into v_claims
      from pg_catalog.generate_subscripts(v_items, 1) i
     where v_items[i].outcome = 'unclaimed' and v_items[i].organization_id = v_org;
    for v_claim in
      select c.*, x.i
        from agent.idempotency_claim_many(v_org, v_scope, p_lease_ms, v_claims, v_cap) c
        join (select i, pg_catalog.row_number() over (order by i) - 1 as n
                from pg_catalog.generate_subscripts(v_items, 1) i
               where v_items[i].outcome = 'unclaimed' and v_items[i].organization_id = v_org) x on x.n = c.item
       order by c.item
    loop
      v_index := v_claim.i;
      v_items[v_index].id := v_claim.id;
      v_items[v_index].lease_expires_at := v_claim.lease_expires_at;
      v_items[v_index].retain_until := v_claim.retain_until;
      v_items[v_index].lease_live := v_claim.lease_live;
      v_first := nullif(v_firsts[v_index], v_index);
      if v_first is not null and v_hashes[v_first] = v_hashes[v_index] then
        v_items[v_index].outcome := 'copy';
        v_items[v_index].copy_of := v_items[v_first].msg_id;
      else
        v_items[v_index].outcome := v_claim.outcome;
        if v_claim.outcome in ('claimed', 'reclaimed') then
          v_items[v_index].lease_token := v_claim.lease_token;
        elsif v_claim.outcome = 'completed' then
          v_items[v_index].response := v_claim.response;
        end if;
      end if;
    end loop;
  end loop;

  -- What this call can end now, it ends now: a message read too often is
  -- journaled as the failure dead_lettered; a conflict is dead-lettered; a
  -- journaled answer is replayed and archived, a failure's first copy
  -- dead-lettered with it.
  for i in 1 .. coalesce(pg_catalog.cardinality(v_items), 0) loop
    if v_items[i].outcome in ('claimed', 'reclaimed') and v_items[i].read_ct > p_max_reads then
      v_failure := pg_catalog.jsonb_build_object(
                     'ok', false, 'error', 'dead_lettered',
                     'output', pg_catalog.jsonb_build_object('reads', v_items[i].read_ct, 'max_reads', p_max_reads));
      perform agent.idempotency_complete(v_items[i].id, v_items[i].lease_token, null, null, v_failure,
                                         v_items[i].organization_id);
      v_items[i].outcome := 'completed';
      v_items[i].response := v_failure;
      v_items[i].lease_token := null;
    end if;
    if v_items[i].outcome = 'conflict' then
      perform agent.idempotency_queue_letter(p_queue, p_dead_letter_queue, v_items[i].msg_id, v_items[i].read_ct,
                                             v_items[i].message,
                                             pg_catalog.jsonb_build_object('error', 'conflict', 'output',
                                               pg_catalog.jsonb_build_object('key', v_items[i].key)));
      v_items[i].dead_lettered := true;
      v_items[i].archived := true;
      v_archive := v_archive || v_items[i].msg_id;
    elsif v_items[i].outcome = 'completed' then
      if v_items[i].response -> 'ok' = 'false'::jsonb then
        update agent.idempotency_keys k
           set dead_lettered_at = pg_catalog.clock_timestamp()
         where k.organization_id = v_items[i].organization_id and k.id = v_items[i].id
           and k.dead_lettered_at is null;
        if found then
          perform agent.idempotency_queue_letter(p_queue, p_dead_letter_queue, v_items[i].msg_id, v_items[i].read_ct,
                                                 v_items[i].message, v_items[i].response);
          v_items[i].dead_lettered := true;
        end if;
      end if;
      v_items[i].archived := true;
      v_archive := v_archive || v_items[i].msg_id;
    end if;
  end loop;
  -- Copies follow their first message: archived with an answer it found.
  for i in 1 .. coalesce(pg_catalog.cardinality(v_items), 0) loop
    if v_items[i].outcome = 'copy' then
      v_first := v_firsts[i];
      if v_items[v_first].archived then
        v_items[i].response := v_items[v_first].response;
        v_items[i].archived := true;
        v_archive := v_archive || v_items[i].msg_id;
      elsif v_items[v_first].outcome = 'processing' then
        v_items[i].outcome := 'processing';
        v_items[i].copy_of := null;
      end if;
    end if;
  end loop;
  if pg_catalog.cardinality(v_archive) > 0 then
    perform pgmq.archive(p_queue, v_archive);
  end if;

  -- Slots the queue did not fill take over this scope's work whose worker
  -- stopped, or that an operator sent back after a fix: each runs again
  -- under a token of the caller's, with the payload its claim keeps.
  if coalesce(pg_catalog.cardinality(v_items), 0) < v_count then
    for v_org in select o from pg_catalog.unnest(v_accepted) o order by o loop
      exit when coalesce(pg_catalog.cardinality(v_items), 0) >= v_count;
      for v_work in
        select w.*
          from agent.idempotency_redrive(
                 v_scope,
                 (select pg_catalog.array_agg(t order by n)
                    from pg_catalog.unnest(p_lease_tokens) with ordinality u(t, n)
                   where n > coalesce(pg_catalog.cardinality(v_items), 0)),
                 p_lease_ms, v_org, v_cap) w
      loop
        v_items := v_items || (null, null, null, null, v_work.organization_id, v_work.key,
                               case when v_work.status = 'processing' then 'redriven' else 'completed' end,
                               null, v_work.id, v_work.lease_token, v_work.lease_expires_at, v_work.retain_until,
                               v_work.status = 'processing', v_work.attempt, v_work.request, v_work.response,
                               false, false, null, null)::agent.idempotency_queue_item;
        if v_work.status = 'completed' and v_work.response -> 'ok' = 'false'::jsonb then
          -- Re-driven as often as its scope allows: journaled as dead_lettered.
          update agent.idempotency_keys k
             set dead_lettered_at = pg_catalog.clock_timestamp()
           where k.organization_id = v_work.organization_id and k.id = v_work.id
             and k.dead_lettered_at is null
          returning k.request into v_body;
          if found then
            perform agent.idempotency_queue_letter(
                      p_queue, p_dead_letter_queue, null, null,
                      pg_catalog.jsonb_build_object('idempotency_key', v_work.key, 'organization_id', v_work.organization_id,
                                                    'payload', v_body),
                      v_work.response);
            v_items[pg_catalog.cardinality(v_items)].dead_lettered := true;
          end if;
        end if;
      end loop;
    end loop;
  end if;

  -- The answer carries what its reader needs: the message of a message to
  -- run (its payload inside), the payload of re-driven work, the
  -- answer of one replayed; and how many rows it holds, so a cut answer is
  -- told from a whole one.
  for i in 1 .. coalesce(pg_catalog.cardinality(v_items), 0) loop
    if v_items[i].outcome not in ('claimed', 'reclaimed') then
      v_items[i].message := null;
    end if;
    if v_items[i].outcome <> 'redriven' then
      v_items[i].payload := null;
    end if;
    v_items[i].taken := pg_catalog.cardinality(v_items);
  end loop;
  return query select t.* from pg_catalog.unnest(v_items) t;
end
$_$;

ALTER FUNCTION agent.idempotency_queue_take(p_queue text, p_dead_letter_queue text, p_organization_id uuid, p_lease_ms bigint, p_lease_tokens uuid[], p_max_reads integer, p_scope text, p_organizations uuid[], p_row_cap integer) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_reclaim.sql

-- agent.idempotency_reclaim
--
-- Takes over a claim (public) that is still processing, whose lease passed
-- and whose request hash matches: the row with the new token and lease; the
-- row again to the same lease token while the lease it took is live (a repeat
-- after a lost answer); otherwise nothing.

CREATE FUNCTION agent.idempotency_reclaim(p_organization_id uuid, p_scope text, p_key text, p_request_hash text, p_lease_token uuid, p_lease_ms bigint, p_retain_ms bigint) RETURNS SETOF agent.idempotency_claim
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
begin
  if p_retain_ms is null then
    raise exception 'p_retain_ms is required' using errcode = '22023';
  end if;
  return query
    select d.id, d.organization_id, d.scope, d.key, d.request_hash, d.status, d.lease_token, d.resource_type,
           d.resource_id, d.response, d.claimed_at, d.lease_expires_at, d.retain_until, d.lease_live
      from agent.idempotency_decide(p_organization_id, p_scope, p_key, p_request_hash, p_lease_token,
                                    p_lease_ms, p_retain_ms, false, true) d
     where d.outcome in ('claimed', 'reclaimed');
end
$$;

ALTER FUNCTION agent.idempotency_reclaim(p_organization_id uuid, p_scope text, p_key text, p_request_hash text, p_lease_token uuid, p_lease_ms bigint, p_retain_ms bigint) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_redrivable.sql

-- agent.idempotency_redrivable
--
-- Whether each named claim can be sent back to re-drive, and why not
-- (public), for operators: the answer to "I sent it back and nothing
-- happened". One row per id of p_claim_ids, in their order, with the
-- claim's scope, key, status, error and attempts when it exists, and
-- `reason`: redrivable (idempotency_redrive_failed would send it back), or
-- absent (no claim has this id: never made, released, or swept),
-- other_organization / other_scope / before_since (outside the filters
-- given, as idempotency_redrive_failed would read them), in_flight (a
-- worker holds a live lease), orphaned (processing with its lease passed:
-- waiting for a re-drive, which takes it as it is, a failure sent back
-- included), succeeded (journaled a success: nothing to run again),
-- no_work (a failure whose work is not kept: nothing can run it again),
-- single_attempt (its scope's max_attempts is 1, or it lost its policy).
-- At most the row cap of ids. Never writes.

CREATE FUNCTION agent.idempotency_redrivable(p_claim_ids uuid[], p_scope text DEFAULT NULL::text, p_organization_id uuid DEFAULT NULL::uuid, p_since timestamp with time zone DEFAULT NULL::timestamp with time zone, p_row_cap integer DEFAULT NULL::integer) RETURNS TABLE(claim_id uuid, organization_id uuid, scope text, key text, status text, error text, attempts integer, claimed_at timestamp with time zone, reason text)
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
declare
  v_prefix text;
  v_cap integer := agent.idempotency_row_cap(p_row_cap);
begin
  if p_claim_ids is null or cardinality(p_claim_ids) = 0 or array_position(p_claim_ids, null) is not null then
    raise exception 'p_claim_ids must name at least one claim, and no NULL' using errcode = '22023';
  end if;
  if cardinality(p_claim_ids) > v_cap then
    raise exception 'p_claim_ids may name at most the row cap %, got %', v_cap, cardinality(p_claim_ids)
      using errcode = '22023';
  end if;
  if p_scope is not null then
    v_prefix := agent.idempotency_failures_scope(p_scope, 1, p_row_cap);
  end if;
  return query
    select c.id, k.organization_id, k.scope, k.key, k.status, k.response ->> 'error', k.reclaims + 1, k.claimed_at,
           case
             when k.id is null then 'absent'
             when p_organization_id is not null and k.organization_id <> p_organization_id then 'other_organization'
             when p_scope is not null and k.scope <> p_scope
                  and (v_prefix is null or left(k.scope, char_length(v_prefix)) <> v_prefix) then 'other_scope'
             when k.status = 'processing' and k.lease_expires_at > pg_catalog.clock_timestamp() then 'in_flight'
             when k.status = 'processing' then 'orphaned'
             when k.response -> 'ok' is distinct from 'false'::jsonb then 'succeeded'
             when k.request is null then 'no_work'
             when p.retain is null or p.max_attempts <= 1 then 'single_attempt'
             when p_since is not null and k.claimed_at < p_since then 'before_since'
             else 'redrivable'
           end
      from unnest(p_claim_ids) with ordinality c(id, n)
      left join agent.idempotency_keys k on k.id = c.id
      left join lateral agent.idempotency_policy(k.scope) p on true
     order by c.n;
end
$$;

ALTER FUNCTION agent.idempotency_redrivable(p_claim_ids uuid[], p_scope text, p_organization_id uuid, p_since timestamp with time zone, p_row_cap integer) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_redrive.sql

-- agent.idempotency_redrive
--
-- Takes over orphans of a scope or family (public): claims still processing
-- whose lease passed and that carry their work, with FOR UPDATE SKIP LOCKED
-- so concurrent re-drivers split them, one per lease token the caller
-- supplies (at most the row cap). A repeat with the same tokens after a
-- lost answer answers again what the tokens still hold, at the same
-- attempt, and takes over more only with tokens that hold nothing. With
-- p_max_bytes, the work it hands out (with what the tokens already hold)
-- stays within that many bytes, and never less than one orphan: a caller
-- that can read answers of so many bytes is never handed more. One whose
-- work was handed out max_attempts times is journaled as dead-lettered
-- instead.

CREATE FUNCTION agent.idempotency_redrive(p_scope text, p_lease_tokens uuid[], p_lease_ms bigint, p_organization_id uuid DEFAULT NULL::uuid, p_row_cap integer DEFAULT NULL::integer, p_max_bytes bigint DEFAULT NULL::bigint) RETURNS SETOF agent.idempotency_work
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $_$
declare
  v_family boolean;
  v_prefix text;
  v_lease interval;
  v_at timestamptz;
  v_cap integer;
  v_count integer;
  v_earlier integer;
  v_index integer;
begin
  if p_scope is null then
    raise exception 'p_scope is required' using errcode = '22023';
  end if;
  if char_length(p_scope) > 128 or p_scope !~ '^[a-z0-9_-]+(\.[a-z0-9_-]+)*(\.\*)?$' then
    raise exception 'p_scope must be a scope (webhook.stripe) or a family (webhook.*) of a-z, 0-9, "_" and "-", got %',
                    pg_catalog.left(p_scope, 128)
      using errcode = '22023';
  end if;
  if p_lease_ms is null or p_lease_ms not between 1000 and 86400000 then
    raise exception 'p_lease_ms must be between 1000 (one second) and 86400000 (one day), got %', p_lease_ms
      using errcode = '22023';
  end if;
  v_cap := agent.idempotency_row_cap(p_row_cap);
  if p_lease_tokens is null then
    raise exception 'p_lease_tokens is required: one fresh lease token per orphan the call may take over'
      using errcode = '22023',
            hint = 'mint them as for claims; a repeat with the same tokens after a lost answer answers the same claims';
  end if;
  v_count := coalesce(pg_catalog.cardinality(p_lease_tokens), 0);
  if v_count not between 1 and v_cap then
    raise exception 'p_lease_tokens must hold between 1 and the row cap % tokens, got %', v_cap, v_count
      using errcode = '22023',
            hint = 'a re-drive answers every claim it takes over; more than the row cap would be cut from the answer';
  end if;
  if p_max_bytes is not null and p_max_bytes < 1 then
    raise exception 'p_max_bytes must be at least 1, got %', p_max_bytes using errcode = '22023';
  end if;
  if pg_catalog.array_position(p_lease_tokens, null) is not null then
    raise exception 'p_lease_tokens[%] is NULL', pg_catalog.array_position(p_lease_tokens, null) - 1
      using errcode = '22023';
  end if;
  select t.first - 1, t.i - 1 into v_earlier, v_index
    from (select i, pg_catalog.min(i) over (partition by p_lease_tokens[i]) as first
            from pg_catalog.generate_subscripts(p_lease_tokens, 1) i) t
   where t.i > t.first
   order by t.i
   limit 1;
  if v_earlier is not null then
    raise exception 'p_lease_tokens[%] repeats p_lease_tokens[%]: each orphan needs a token of its own', v_index, v_earlier
      using errcode = '22023';
  end if;

  v_family := right(p_scope, 2) = '.*';
  v_prefix := case when v_family then left(p_scope, -1) end;
  if (select p.retain from agent.idempotency_policy(p_scope) p) is null
     and not (v_family and exists (select 1 from agent.idempotency_scopes s
                                    where left(s.scope, char_length(v_prefix)) = v_prefix)) then
    raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', p_scope
      using errcode = 'IDEM1',
            hint = 'add the scope (or its family, e.g. webhook.*) to agent.idempotency_scopes in a migration';
  end if;

  v_lease := p_lease_ms * interval '1 millisecond';
  v_at := pg_catalog.clock_timestamp();
  return query
    with mine as (
      -- What an earlier call with these tokens took over and still holds:
      -- its answer was lost, so it is answered again, at the same attempt.
      select k.*
        from agent.idempotency_keys k
       where k.redrive_at is not null
         and k.lease_token = any (p_lease_tokens)
         and k.status = 'processing'
         and (k.scope = p_scope or (v_family and left(k.scope, char_length(v_prefix)) = v_prefix))
         and (p_organization_id is null or k.organization_id = p_organization_id)
         for update of k skip locked
    ), unused as (
      select t.token, pg_catalog.row_number() over (order by t.n) as n
        from pg_catalog.unnest(p_lease_tokens) with ordinality t(token, n)
       where not exists (select 1 from mine m where m.lease_token = t.token)
    ), orphans as (
      select k.id, k.organization_id, k.scope, k.redrive_at, pg_catalog.octet_length(k.request::text) as size
        from agent.idempotency_keys k
       where k.redrive_at <= v_at
         and k.status = 'processing'
         and k.lease_expires_at <= v_at
         and k.lease_token <> all (p_lease_tokens)
         and (k.scope = p_scope or (v_family and left(k.scope, char_length(v_prefix)) = v_prefix))
         and (p_organization_id is null or k.organization_id = p_organization_id)
       order by k.redrive_at, k.id
       limit (select pg_catalog.count(*) from unused)
         for update of k skip locked
    ), numbered as (
      select o.id, o.organization_id, o.scope, pg_catalog.row_number() over (order by o.redrive_at, o.id) as n,
             pg_catalog.sum(o.size) over (order by o.redrive_at, o.id)
               + (select coalesce(pg_catalog.sum(pg_catalog.octet_length(m.request::text)), 0) from mine m) as bytes
        from orphans o
    ), decided as (
      -- Orphans locked beyond the byte budget stay orphans, for the next call.
      select o.id, o.organization_id, p.max_attempts, u.token
        from numbered o
        join unused u on u.n = o.n
       cross join lateral agent.idempotency_policy(o.scope) p
       where p_max_bytes is null or o.bytes <= p_max_bytes or (o.n = 1 and not exists (select 1 from mine))
    ), taken as (
      update agent.idempotency_keys as k
         set status = case when k.reclaims + 1 >= d.max_attempts then 'completed' else 'processing' end,
             response = case when k.reclaims + 1 >= d.max_attempts
                             then jsonb_build_object('ok', false, 'error', 'dead_lettered',
                                                     'output', jsonb_build_object('attempts', k.reclaims + 1))
                             else k.response end,
             lease_token = case when k.reclaims + 1 >= d.max_attempts then k.lease_token else d.token end,
             claimed_at = case when k.reclaims + 1 >= d.max_attempts then k.claimed_at else v_at end,
             lease_expires_at = case when k.reclaims + 1 >= d.max_attempts then k.lease_expires_at
                                     else v_at + v_lease end,
             retain_until = case when k.reclaims + 1 >= d.max_attempts
                                 then greatest(k.retain_until, v_at + (k.retain_until - k.lease_expires_at))
                                 else greatest(k.retain_until, v_at + v_lease + (k.retain_until - k.lease_expires_at))
                            end,
             reclaims = case when k.reclaims + 1 >= d.max_attempts then k.reclaims else k.reclaims + 1 end,
             redrive_at = case when k.reclaims + 1 >= d.max_attempts then null else v_at + v_lease end
        from decided d
       where k.id = d.id and k.organization_id = d.organization_id
      returning k.*
    ), answered as (
      select * from taken
      union all
      select * from mine
    )
    select t.id, t.organization_id, t.scope, t.key, t.request_hash, t.status,
           case when t.status = 'processing' then t.lease_token end,
           case when t.status = 'processing' then t.request end,
           t.reclaims + 1, t.claimed_at, t.lease_expires_at, t.retain_until,
           case when t.status = 'completed' then t.response end,
           (count(*) over ())::integer
      from answered t
     order by t.lease_expires_at, t.id;
end
$_$;

ALTER FUNCTION agent.idempotency_redrive(p_scope text, p_lease_tokens uuid[], p_lease_ms bigint, p_organization_id uuid, p_row_cap integer, p_max_bytes bigint) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_redrive_failed.sql

-- agent.idempotency_redrive_failed
--
-- Sends journaled failures that carry their work back to re-drive (public):
-- the chosen claim ids, or every failure claimed since p_since. Each becomes
-- an orphan again with a fresh fence and attempts from one; none of a scope
-- whose max_attempts is 1. What each replaced is kept in the row for the
-- audit: the first (the first failure, whose claim is first_claimed_at)
-- and the last 19.

CREATE FUNCTION agent.idempotency_redrive_failed(p_scope text, p_limit integer, p_organization_id uuid DEFAULT NULL::uuid, p_since timestamp with time zone DEFAULT NULL::timestamp with time zone, p_claim_ids uuid[] DEFAULT NULL::uuid[], p_row_cap integer DEFAULT NULL::integer) RETURNS SETOF agent.idempotency_failure
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
declare
  v_prefix text;
  v_at timestamptz;
begin
  v_prefix := agent.idempotency_failures_scope(p_scope, p_limit, p_row_cap);
  if p_claim_ids is not null
     and (cardinality(p_claim_ids) = 0 or array_position(p_claim_ids, null) is not null) then
    raise exception 'p_claim_ids must name at least one claim, and no NULL; omit it to send back every failure'
      using errcode = '22023';
  end if;
  if p_claim_ids is null and p_since is null then
    raise exception 'name what to send back: p_claim_ids (the chosen failures), p_since (every failure claimed since), or both'
      using errcode = '22023';
  end if;

  v_at := pg_catalog.clock_timestamp();
  return query
    with chosen as (
      select k.id, k.organization_id, k.scope, p.retain
        from agent.idempotency_keys k
       cross join lateral agent.idempotency_policy(k.scope) p
       where k.status = 'completed'
         and k.response -> 'ok' = 'false'::jsonb
         and k.request is not null
         and p.retain is not null
         and p.max_attempts > 1
         and (k.scope = p_scope or (v_prefix is not null and left(k.scope, char_length(v_prefix)) = v_prefix))
         and (p_organization_id is null or k.organization_id = p_organization_id)
         and (p_since is null or k.claimed_at >= p_since)
         and (p_claim_ids is null or k.id = any (p_claim_ids))
       order by k.claimed_at, k.id
       limit p_limit
         for update of k skip locked
    ), sent as (
      update agent.idempotency_keys as k
         set status = 'processing',
             response = null,
             resource_type = null,
             resource_id = null,
             lease_token = gen_random_uuid(),
             claimed_at = v_at,
             lease_expires_at = v_at,
             redrive_at = v_at,
             reclaims = 0,
             retain_until = greatest(k.retain_until, v_at + c.retain),
             replaced = (
               select coalesce(jsonb_agg(e.entry order by e.n), '[]'::jsonb)
                 from jsonb_array_elements(
                        coalesce(k.replaced, '[]'::jsonb)
                        || jsonb_build_array(jsonb_build_object(
                             'response', k.response,
                             'resource_type', k.resource_type,
                             'resource_id', k.resource_id,
                             'attempts', k.reclaims + 1,
                             'claimed_at', k.claimed_at,
                             'sent_back_at', v_at))
                      ) with ordinality as e(entry, n)
                where e.n = 1 or e.n > jsonb_array_length(coalesce(k.replaced, '[]'::jsonb)) + 1 - 19
             )
        from chosen c
       where k.id = c.id and k.organization_id = c.organization_id
      returning k.*
    )
    select s.id, s.organization_id, s.scope, s.key, s.status,
           s.replaced -> -1 -> 'response' ->> 'error', s.replaced -> -1 -> 'response',
           s.replaced -> -1 ->> 'resource_type', s.replaced -> -1 ->> 'resource_id',
           (s.replaced -> -1 ->> 'attempts')::integer, s.claimed_at, s.retain_until,
           true, jsonb_array_length(s.replaced),
           (count(*) over ())::integer,
           (s.replaced -> 0 ->> 'claimed_at')::timestamptz
      from sent s
     order by s.id;
end
$$;

ALTER FUNCTION agent.idempotency_redrive_failed(p_scope text, p_limit integer, p_organization_id uuid, p_since timestamp with time zone, p_claim_ids uuid[], p_row_cap integer) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_release.sql

-- agent.idempotency_release
--
-- Gives a claim back (public) so the next caller runs it: true when
-- p_lease_token was still its fence. Only for an effect known not to have
-- happened.

CREATE FUNCTION agent.idempotency_release(p_claim_id uuid, p_lease_token uuid, p_organization_id uuid DEFAULT NULL::uuid) RETURNS boolean
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
begin
  if p_claim_id is null then
    raise exception 'p_claim_id is required' using errcode = '22023';
  end if;
  if p_lease_token is null then
    raise exception 'p_lease_token is required' using errcode = '22023';
  end if;
  if p_organization_id is null then
    -- A caller that does not name the organization: found by id alone,
    -- which a partitioned table answers from every partition.
    delete from agent.idempotency_keys k
     where k.id = p_claim_id
       and k.lease_token = p_lease_token
       and k.status = 'processing';
  else
    delete from agent.idempotency_keys k
     where k.organization_id = p_organization_id
       and k.id = p_claim_id
       and k.lease_token = p_lease_token
       and k.status = 'processing';
  end if;
  return found;
end
$$;

ALTER FUNCTION agent.idempotency_release(p_claim_id uuid, p_lease_token uuid, p_organization_id uuid) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_release_many.sql

-- agent.idempotency_release_many
--
-- Releases a batch (public): one row per item, in order.

CREATE FUNCTION agent.idempotency_release_many(p_organization_id uuid, p_items jsonb, p_row_cap integer DEFAULT NULL::integer) RETURNS SETOF agent.idempotency_release_item
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
declare
  v_ids uuid[] := '{}'::uuid[];
  v_tokens uuid[] := '{}'::uuid[];
  v_item jsonb;
  v_index integer;
begin
  if p_organization_id is null then
    raise exception 'p_organization_id is required' using errcode = '22023';
  end if;
  perform agent.idempotency_check_batch(p_items, p_row_cap);

  for v_item, v_index in select e.value, (e.ordinality - 1)::integer
                           from jsonb_array_elements(p_items) with ordinality e loop
    perform agent.idempotency_check_item(v_item, v_index);
    v_ids := pg_catalog.array_append(v_ids, agent.idempotency_item_uuid(v_item, v_index, 'claim_id'));
    v_tokens := pg_catalog.array_append(v_tokens, agent.idempotency_item_uuid(v_item, v_index, 'lease_token'));
  end loop;

  -- The rows are locked in (organization, scope, key) order before any is
  -- written, as every batch of the plane locks them, so that batches over
  -- the same keys never wait for each other in a cycle.
  perform 1
     from agent.idempotency_keys k
    where k.organization_id = p_organization_id and k.id = any (v_ids)
    order by k.scope, k.key
      for update of k;

  for i in 1 .. pg_catalog.cardinality(v_ids) loop
    return next (i - 1, agent.idempotency_release(v_ids[i], v_tokens[i], p_organization_id))
      ::agent.idempotency_release_item;
  end loop;
end
$$;

ALTER FUNCTION agent.idempotency_release_many(p_organization_id uuid, p_items jsonb, p_row_cap integer) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_request_hash.sql

-- agent.idempotency_request_hash
--
-- The request hash of a JSON value (public): lowercase hex SHA-256 of its
-- canonical form, the hash every client computes for a JSON request. The
-- queue functions hash each message's payload with it; a SQL caller may too.
-- Never writes.

CREATE FUNCTION agent.idempotency_request_hash(p_value jsonb) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    SET search_path TO ''
    AS $$
  select pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(agent.idempotency_canonical_json(p_value), 'UTF8')), 'hex')
$$;

ALTER FUNCTION agent.idempotency_request_hash(p_value jsonb) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_retire_expired.sql

-- agent.idempotency_retire_expired
--
-- Retires the given claims (public) that are still past retention, for the
-- sweeper: deletes them, except unfinished work (processing, carrying its
-- request) that nobody re-drove, which is journaled as a dead letter
-- (swept_unredriven) and kept for its scope's retention from now. Rows
-- another transaction holds are left for the next pass. Answers one row:
-- deleted, dead_lettered.

CREATE FUNCTION agent.idempotency_retire_expired(p_ids uuid[]) RETURNS SETOF agent.idempotency_retired
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
declare
  v_deleted integer;
  v_dead integer;
begin
  if p_ids is null then
    raise exception 'p_ids is required' using errcode = '22023';
  end if;
  if pg_catalog.cardinality(p_ids) > agent.idempotency_row_cap() then
    raise exception 'p_ids holds % ids; at most the plane''s row cap % per call',
                    pg_catalog.cardinality(p_ids), agent.idempotency_row_cap()
      using errcode = '22023';
  end if;
  if pg_catalog.array_position(p_ids, null) is not null then
    raise exception 'p_ids holds a NULL at position %', pg_catalog.array_position(p_ids, null) using errcode = '22023';
  end if;
  -- A row another transaction holds is left for the next pass: the sweep
  -- never waits on a claim, so it never takes part in a cycle of waits.
  -- Unfinished work (still processing, carrying its request: acknowledged,
  -- and nobody re-drove it) is never deleted: it is journaled as a dead
  -- letter, kept for its scope's retention from now, and listed among the
  -- failures, which an operator can send back after a fix.
  with expired as (
    select x.id, x.organization_id, x.scope, x.status = 'processing' and x.request is not null as unfinished
      from agent.idempotency_keys x
     where x.id = any (p_ids)
       and x.retain_until < pg_catalog.now()
       for update of x skip locked
  ), dead as (
    update agent.idempotency_keys as k
       set status = 'completed',
           response = pg_catalog.jsonb_build_object('ok', false, 'error', 'swept_unredriven',
                                                    'output', pg_catalog.jsonb_build_object('attempts', k.reclaims + 1)),
           lease_expires_at = least(k.lease_expires_at, pg_catalog.now()),
           retain_until = pg_catalog.now() + coalesce((select p.retain from agent.idempotency_policy(k.scope) p),
                                                      interval '1 day'),
           redrive_at = null
      from expired e
     where e.unfinished and k.id = e.id and k.organization_id = e.organization_id
    returning k.id
  ), deleted as (
    delete from agent.idempotency_keys k
     using expired e
     where not e.unfinished and k.id = e.id and k.organization_id = e.organization_id
    returning k.id
  )
  select (select pg_catalog.count(*) from deleted), (select pg_catalog.count(*) from dead) into v_deleted, v_dead;
  if v_dead > 0 then
    raise warning 'idempotency sweep: % unfinished claims carrying work passed their retention unredriven; journaled as dead letters (swept_unredriven)', v_dead
      using hint = 'schedule a re-drive for their scopes (idem redrive), then send them back: idem redrive --failed';
  end if;
  return next (v_deleted, v_dead)::agent.idempotency_retired;
end
$$;

ALTER FUNCTION agent.idempotency_retire_expired(p_ids uuid[]) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_row_cap.sql

-- agent.idempotency_row_cap
--
-- The plane's row cap (public): without an argument, the cap every answer
-- is held to (agent.idempotency_settings.max_rows); with one, that cap
-- checked (22023 outside 1 to the plane's) and answered. Every function
-- that answers rows asks it.

CREATE FUNCTION agent.idempotency_row_cap(p_row_cap integer DEFAULT NULL::integer) RETURNS integer
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
declare
  v_cap integer;
begin
  select s.max_rows into v_cap from agent.idempotency_settings s;
  v_cap := coalesce(v_cap, 1000);
  if p_row_cap is null then
    return v_cap;
  end if;
  if p_row_cap not between 1 and v_cap then
    raise exception 'p_row_cap % is outside 1 to the plane''s row cap %', p_row_cap, v_cap
      using errcode = '22023',
            hint = 'the plane''s row cap (agent.idempotency_settings.max_rows) is the server''s db-max-rows '
                   '(Supabase api.max_rows): omit p_row_cap, or pass that cap or a lower one';
  end if;
  return p_row_cap;
end
$$;

ALTER FUNCTION agent.idempotency_row_cap(p_row_cap integer) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_scheduled_call.sql

-- agent.idempotency_scheduled_call
--
-- Records one call a scheduled job made (public): p_request_id, the id
-- pg_net's net.http_post answered, under p_job; and the answers pg_net holds
-- for earlier calls (p_answers: a JSON array of {"request_id", "status_code",
-- "error"} read from net._http_response), each written to its call once. A
-- call answered with a status outside 200-299, or an error, is a failure
-- (a WARNING names how many this run found); calls older than 7 days are
-- forgotten, at most 1000 a run. Answers the number of answers recorded.

CREATE FUNCTION agent.idempotency_scheduled_call(p_job text, p_request_id bigint, p_answers jsonb DEFAULT '[]'::jsonb) RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    AS $$
declare
  v_recorded integer;
  v_failed integer;
begin
  if p_job is null or char_length(p_job) not between 1 and 200 then
    raise exception 'p_job must name the job: 1 to 200 characters' using errcode = '22023';
  end if;
  if p_request_id is null then
    raise exception 'p_request_id must be the id net.http_post answered' using errcode = '22023';
  end if;
  if p_answers is null or jsonb_typeof(p_answers) <> 'array' or jsonb_array_length(p_answers) > 10000 then
    raise exception 'p_answers must be a JSON array of at most 10000 {"request_id", "status_code", "error"}'
      using errcode = '22023';
  end if;

  -- A request id seen before is pg_net's counter starting again (the
  -- extension reinstalled): the new call replaces the old record.
  insert into agent.idempotency_scheduled_calls (request_id, job)
  values (p_request_id, p_job)
  on conflict (request_id) do update
     set job = excluded.job, called_at = pg_catalog.clock_timestamp(),
         answered_at = null, status_code = null, error = null;

  with answers as (
    select distinct on ((a ->> 'request_id')::bigint)
           (a ->> 'request_id')::bigint as request_id,
           case when jsonb_typeof(a -> 'status_code') = 'number'
                then (a ->> 'status_code')::numeric end as status_code,
           left(nullif(a ->> 'error', ''), 2000) as error
      from jsonb_array_elements(p_answers) as e(a)
     where jsonb_typeof(a) = 'object'
       and jsonb_typeof(a -> 'request_id') = 'number'
       and (a ->> 'request_id') ~ '^[0-9]{1,18}$'
  ), answered as (
    update agent.idempotency_scheduled_calls as c
       set answered_at = pg_catalog.clock_timestamp(),
           status_code = case when a.status_code between 0 and 999 then a.status_code::integer end,
           error = coalesce(a.error, case when a.status_code is null then 'no status' end)
      from answers a
     where c.request_id = a.request_id
       and c.answered_at is null
    returning c.status_code, c.error
  )
  select count(*)::integer,
         (count(*) filter (where status_code is null or status_code not between 200 and 299
                              or error is not null))::integer
    into v_recorded, v_failed
    from answered;

  delete from agent.idempotency_scheduled_calls
   where request_id in (select o.request_id
                          from agent.idempotency_scheduled_calls o
                         where o.called_at < pg_catalog.clock_timestamp() - interval '7 days'
                         order by o.called_at
                         limit 1000);

  if v_failed > 0 then
    raise warning '% scheduled call(s) failed (an HTTP status outside 200-299, or no answer)', v_failed
      using hint = 'select * from agent.idempotency_scheduled_failures(); idem doctor names them too';
  end if;
  return v_recorded;
end
$$;

ALTER FUNCTION agent.idempotency_scheduled_call(p_job text, p_request_id bigint, p_answers jsonb) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_scheduled_failures.sql

-- agent.idempotency_scheduled_failures
--
-- The scheduled calls that failed since p_since (default: the last hour),
-- newest first, at most the row cap (public): answered with a status
-- outside 200-299 or an error, or never answered although a later call of
-- the same job ran more than 10 minutes after it (pg_net lost or purged
-- the answer). failed_calls counts every such call since p_since, whatever
-- the cap cut. Never writes.

CREATE FUNCTION agent.idempotency_scheduled_failures(p_since timestamp with time zone DEFAULT NULL::timestamp with time zone, p_row_cap integer DEFAULT NULL::integer) RETURNS TABLE(job text, request_id bigint, called_at timestamp with time zone, answered_at timestamp with time zone, status_code integer, error text, failed_calls integer)
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
declare
  v_cap integer;
  v_since timestamptz;
begin
  v_cap := agent.idempotency_row_cap(p_row_cap);
  v_since := coalesce(p_since, pg_catalog.clock_timestamp() - interval '1 hour');
  return query
    with failed as (
      select c.*
        from agent.idempotency_scheduled_calls c
       where c.called_at >= v_since
         and ((c.answered_at is not null
               and (c.status_code is null or c.status_code not between 200 and 299 or c.error is not null))
              or (c.answered_at is null
                  and exists (select 1
                                from agent.idempotency_scheduled_calls l
                               where l.job = c.job
                                 and l.called_at > c.called_at + interval '10 minutes')))
    )
    select f.job, f.request_id, f.called_at, f.answered_at, f.status_code,
           coalesce(f.error, case when f.answered_at is null then 'no answer recorded' end),
           (count(*) over ())::integer
      from failed f
     order by f.called_at desc, f.request_id desc
     limit v_cap;
end
$$;

ALTER FUNCTION agent.idempotency_scheduled_failures(p_since timestamp with time zone, p_row_cap integer) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_scheduled_pending.sql

-- agent.idempotency_scheduled_pending
--
-- The request ids of p_job's calls whose answer is not recorded yet, oldest
-- first, at most 1000 (public): what a recipe looks up in pg_net's
-- net._http_response, by id, so its answers are found however many other
-- requests pg_net made meanwhile. Never writes.

CREATE FUNCTION agent.idempotency_scheduled_pending(p_job text) RETURNS bigint[]
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
begin
  if p_job is null or char_length(p_job) not between 1 and 200 then
    raise exception 'p_job must name the job: 1 to 200 characters' using errcode = '22023';
  end if;
  return coalesce((select array_agg(p.request_id order by p.request_id)
                     from (select c.request_id
                             from agent.idempotency_scheduled_calls c
                            where c.job = p_job
                              and c.answered_at is null
                            order by c.request_id
                            limit 1000) as p), '{}'::bigint[]);
end
$$;

ALTER FUNCTION agent.idempotency_scheduled_pending(p_job text) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_surface.sql

-- agent.idempotency_surface
--
-- Every function of schema agent, from the catalog (public), for idem doctor:
-- its identity arguments, whether the caller may execute it, its owner, and
-- whether PUBLIC, anon or authenticated may execute it. Every function, not
-- only the plane's: a function someone else created there is what the doctor
-- looks for. The one function that runs as its caller, because it reports the
-- caller's privileges. A function those roles may execute is one the event
-- trigger did not make private (on Supabase, a superuser's: supautils runs no
-- user event trigger for superusers), or one granted to them since.

CREATE FUNCTION agent.idempotency_surface() RETURNS TABLE(name text, arguments text, executable boolean, owner text, public_executable boolean, anon_executable boolean, authenticated_executable boolean)
    LANGUAGE sql STABLE
    SET search_path TO ''
    AS $$
  select p.proname::text,
         pg_catalog.pg_get_function_identity_arguments(p.oid),
         pg_catalog.has_function_privilege(p.oid, 'execute'),
         pg_catalog.pg_get_userbyid(p.proowner)::text,
         pg_catalog.has_function_privilege('public', p.oid, 'execute'),
         pg_catalog.has_function_privilege('anon', p.oid, 'execute'),
         pg_catalog.has_function_privilege('authenticated', p.oid, 'execute')
    from pg_catalog.pg_proc p
   where p.pronamespace = 'agent'::regnamespace
   order by 1, 2;
$$;

-- supabase/schemas/40_function_idempotency_sweep.sql

-- agent.idempotency_sweep
--
-- One sweep pass inside the database (public), for Supabase Cron: reads with
-- agent.idempotency_expired and retires with
-- agent.idempotency_retire_expired (deleted, or journaled as a dead letter
-- when it is unfinished work nobody re-drove), bounded by the row cap.

CREATE FUNCTION agent.idempotency_sweep(p_bound integer, p_row_cap integer DEFAULT NULL::integer) RETURNS SETOF agent.idempotency_sweep_report
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
declare
  v_ids uuid[];
  v_read integer;
  v_retired agent.idempotency_retired;
  v_cap integer;
begin
  if p_bound is null then
    raise exception 'p_bound is required: the most expired claims one sweep reads' using errcode = '22023';
  end if;
  v_cap := agent.idempotency_row_cap(p_row_cap);
  if p_bound < 1 then
    raise exception 'p_bound must be at least 1, got %', p_bound using errcode = '22023';
  end if;
  if p_bound > v_cap then
    raise exception 'p_bound % is above the row cap %: a sweep reads at most the row cap',
                    p_bound, v_cap
      using errcode = '22023',
            hint = 'lower p_bound to the row cap or below; a larger backlog is swept by sweeping more often';
  end if;

  select coalesce(pg_catalog.array_agg(e.id), '{}') into v_ids
    from agent.idempotency_expired(p_bound) e;
  v_read := pg_catalog.cardinality(v_ids);
  select * into v_retired from agent.idempotency_retire_expired(v_ids);

  if v_read >= p_bound then
    raise warning 'idempotency sweep read % expired claims, its whole bound: the backlog may be larger', v_read
      using hint = 'sweep more often or raise the bound (up to the row cap)';
  end if;
  return next (v_read, v_retired.deleted, p_bound, v_read >= p_bound, v_retired.dead_lettered)
    ::agent.idempotency_sweep_report;
end
$$;

ALTER FUNCTION agent.idempotency_sweep(p_bound integer, p_row_cap integer) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_try_claim.sql

-- agent.idempotency_try_claim
--
-- Claims a key that has no row (public): the new row; the row again to the
-- same lease token while its lease is live (a repeat after a lost answer);
-- otherwise nothing. Never takes over.

CREATE FUNCTION agent.idempotency_try_claim(p_organization_id uuid, p_scope text, p_key text, p_request_hash text, p_lease_token uuid, p_lease_ms bigint, p_retain_ms bigint) RETURNS SETOF agent.idempotency_claim
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
begin
  if p_retain_ms is null then
    raise exception 'p_retain_ms is required' using errcode = '22023';
  end if;
  return query
    select d.id, d.organization_id, d.scope, d.key, d.request_hash, d.status, d.lease_token, d.resource_type,
           d.resource_id, d.response, d.claimed_at, d.lease_expires_at, d.retain_until, d.lease_live
      from agent.idempotency_decide(p_organization_id, p_scope, p_key, p_request_hash, p_lease_token,
                                    p_lease_ms, p_retain_ms, true, false) d
     where d.outcome in ('claimed', 'reclaimed');
end
$$;

ALTER FUNCTION agent.idempotency_try_claim(p_organization_id uuid, p_scope text, p_key text, p_request_hash text, p_lease_token uuid, p_lease_ms bigint, p_retain_ms bigint) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_idempotency_utf16_order.sql

-- agent.idempotency_utf16_order
--
-- A key's UTF-8 bytes, re-ordered as its UTF-16 code units order (private):
-- the lead bytes of U+E000..U+FFFF (EE, EF) move above every supplementary
-- character's (F0..F4), so comparing the bytes compares the UTF-16 code
-- units, as RFC 8785 sorts object members. Only keys holding such a
-- character need it; for every other key it answers the UTF-8 bytes.

CREATE FUNCTION agent.idempotency_utf16_order(p_key text) RETURNS bytea
    LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
    SET search_path TO ''
    AS $$
declare
  v_bytes bytea := pg_catalog.convert_to(p_key, 'UTF8');
begin
  for i in 0 .. pg_catalog.length(v_bytes) - 1 loop
    case pg_catalog.get_byte(v_bytes, i)
      when 238 then v_bytes := pg_catalog.set_byte(v_bytes, i, 245);
      when 239 then v_bytes := pg_catalog.set_byte(v_bytes, i, 246);
      else null;
    end case;
  end loop;
  return v_bytes;
end;
$$;

ALTER FUNCTION agent.idempotency_utf16_order(p_key text) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_provider_job_lookup.sql

-- agent.provider_job_lookup
--
-- Finds the organization of a provider's job (public), for a callback.

CREATE FUNCTION agent.provider_job_lookup(p_provider text, p_job_id text) RETURNS SETOF agent.provider_jobs
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
begin
  if p_provider is null or char_length(p_provider) not between 1 and 64 or p_provider ~ '[^a-z0-9_-]' then
    raise exception 'p_provider must be 1 to 64 characters of a-z, 0-9, "_" and "-"' using errcode = '22023';
  end if;
  if p_job_id is null or char_length(p_job_id) not between 1 and 512 then
    raise exception 'p_job_id must be 1 to 512 characters' using errcode = '22023';
  end if;
  return query
    select j.* from agent.provider_jobs j
     where j.provider = p_provider and j.job_id = p_job_id;
end
$$;

ALTER FUNCTION agent.provider_job_lookup(p_provider text, p_job_id text) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_provider_job_register.sql

-- agent.provider_job_register
--
-- Records which organization started a provider's job (public), so its
-- callback finds the claim. A repeat by the same organization answers the
-- same row; another organization's is refused (23505).

CREATE FUNCTION agent.provider_job_register(p_organization_id uuid, p_provider text, p_job_id text) RETURNS SETOF agent.provider_jobs
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
declare
  r agent.provider_jobs;
begin
  if p_organization_id is null then
    raise exception 'p_organization_id is required' using errcode = '22023';
  end if;
  if p_provider is null or char_length(p_provider) not between 1 and 64 or p_provider ~ '[^a-z0-9_-]' then
    raise exception 'p_provider must be 1 to 64 characters of a-z, 0-9, "_" and "-"' using errcode = '22023';
  end if;
  if p_job_id is null or char_length(p_job_id) not between 1 and 512 then
    raise exception 'p_job_id must be 1 to 512 characters' using errcode = '22023';
  end if;
  insert into agent.provider_jobs as j (organization_id, provider, job_id)
  values (p_organization_id, p_provider, p_job_id)
  on conflict (provider, job_id) do nothing
  returning j.* into r;
  if not found then
    select j.* into r from agent.provider_jobs j
     where j.provider = p_provider and j.job_id = p_job_id;
    if r.organization_id is distinct from p_organization_id then
      raise exception 'provider job %/% belongs to another organization', p_provider, p_job_id
        using errcode = '23505';
    end if;
  end if;
  return next r;
end
$$;

ALTER FUNCTION agent.provider_job_register(p_organization_id uuid, p_provider text, p_job_id text) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_run_admit.sql

-- agent.run_admit
--
-- Admits a Run once per (organization_id, start_key) (public); a repeat
-- answers the Run admitted first. Given p_claim_id and p_lease_token, it
-- admits only while that claim's lease is live and the token is its fence.

CREATE FUNCTION agent.run_admit(p_organization_id uuid, p_start_key text, p_input jsonb, p_admission_token uuid DEFAULT NULL::uuid, p_claim_id uuid DEFAULT NULL::uuid, p_lease_token uuid DEFAULT NULL::uuid, p_max_run_duration_ms bigint DEFAULT NULL::bigint) RETURNS SETOF agent.run_admission
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $_$
declare
  v_size bigint;
  v_held boolean;
begin
  if p_organization_id is null then
    raise exception 'p_organization_id is required' using errcode = '22023';
  end if;
  if p_start_key is null or char_length(p_start_key) not between 1 and 512 then
    raise exception 'p_start_key must be 1 to 512 characters' using errcode = '22023';
  end if;
  if p_input is null or p_input = 'null'::jsonb then
    raise exception 'p_input is required' using errcode = '22023';
  end if;
  if p_max_run_duration_ms is not null
     and (p_max_run_duration_ms <= 0 or p_max_run_duration_ms > 2592000000) then
    raise exception 'p_max_run_duration_ms must be above zero and at most 2592000000 (30 days, the tool retention); got %',
      p_max_run_duration_ms
      using errcode = '22023';
  end if;
  if p_claim_id is null and p_lease_token is not null then
    raise exception 'p_claim_id is required with p_lease_token: a fence names the claim and its token'
      using errcode = '22023';
  end if;
  if p_lease_token is null and p_claim_id is not null then
    raise exception 'p_lease_token is required with p_claim_id: a fence names the claim and its token'
      using errcode = '22023';
  end if;
  v_size := octet_length(p_input::text);
  if v_size >= 130
     and jsonb_path_exists(p_input, 'strict $.**{64} ? (@.type() == "array" || @.type() == "object")') then
    raise exception 'p_input nests arrays and objects deeper than 64 levels, more than every client reads back'
      using errcode = 'IDEM3';
  end if;
  if v_size > 4194304 and agent.idempotency_json_size(p_input) > 4194304 then
    raise exception 'p_input is above the 4194304 bytes of compact JSON a Run input may hold'
      using errcode = 'IDEM2';
  end if;

  if p_claim_id is not null then
    -- FOR SHARE: a reclaim or a completion of the claim (an UPDATE) waits
    -- until this admission commits or rolls back.
    select k.status = 'processing'
           and k.lease_token = p_lease_token
           and k.organization_id = p_organization_id
           and k.lease_expires_at > pg_catalog.clock_timestamp()
      into v_held
      from agent.idempotency_keys k
     where k.id = p_claim_id
       for share;
    if v_held is not true then
      raise exception 'claim % is not held by this lease token (completed, released, another organization''s, '
                      'or its lease passed); no Run admitted', p_claim_id
        using errcode = 'IDEM4',
              hint = 'the preparation lost its fence: start again, and the holder''s Run is answered';
    end if;
  end if;

  return query
    insert into agent.runs as r (organization_id, start_key, input, admission_token, max_run_duration)
    values (p_organization_id, p_start_key, p_input, p_admission_token,
            p_max_run_duration_ms * interval '1 millisecond')
    on conflict (organization_id, start_key) do nothing
    returning r.id, r.organization_id, r.start_key, r.input, r.status,
              r.admitted_at, r.retain_until, true;
  if found then
    return;
  end if;

  -- The conflicting insert has committed (ON CONFLICT waited for it), and
  -- this statement's fresh snapshot sees it.
  return query
    select r.id, r.organization_id, r.start_key, r.input, r.status,
           r.admitted_at, r.retain_until,
           coalesce(r.admission_token = p_admission_token, false)
      from agent.runs r
     where r.organization_id = p_organization_id
       and r.start_key = p_start_key;
end
$_$;

ALTER FUNCTION agent.run_admit(p_organization_id uuid, p_start_key text, p_input jsonb, p_admission_token uuid, p_claim_id uuid, p_lease_token uuid, p_max_run_duration_ms bigint) OWNER TO idempotency_owner;

-- supabase/schemas/40_function_run_get.sql

-- agent.run_get
--
-- Reads an admitted Run (public) without writing.

CREATE FUNCTION agent.run_get(p_organization_id uuid, p_start_key text, p_admission_token uuid DEFAULT NULL::uuid) RETURNS SETOF agent.run_admission
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
begin
  if p_organization_id is null then
    raise exception 'p_organization_id is required' using errcode = '22023';
  end if;
  if p_start_key is null or char_length(p_start_key) not between 1 and 512 then
    raise exception 'p_start_key must be 1 to 512 characters' using errcode = '22023';
  end if;
  return query
    select r.id, r.organization_id, r.start_key, r.input, r.status,
           r.admitted_at, r.retain_until,
           coalesce(r.admission_token = p_admission_token, false)
      from agent.runs r
     where r.organization_id = p_organization_id
       and r.start_key = p_start_key;
end
$$;

ALTER FUNCTION agent.run_get(p_organization_id uuid, p_start_key text, p_admission_token uuid) OWNER TO idempotency_owner;

-- supabase/schemas/80_event_trigger.sql

-- Functions created in schema agent later, by anyone, are not executable by
-- PUBLIC, anon or authenticated: this event trigger revokes EXECUTE from
-- them on every function, procedure or aggregate created in, moved into,
-- altered in or replaced in the schema (the function it runs is
-- agent.idempotency_private_functions). A grant to those roles therefore
-- lasts only until the function is next altered or replaced.
--
-- Creating an event trigger takes a superuser, or Supabase's postgres
-- (supautils). Elsewhere the schema applies without it, and says so: the
-- missing USAGE on schema agent still keeps anon and authenticated out.
-- On Supabase, supautils runs user event triggers for every role except
-- superusers: a function a superuser creates in agent is not covered, and
-- `idem doctor` reports such a function when PUBLIC may execute it.

do $trigger$
begin
  create event trigger idempotency_private_functions on ddl_command_end
    when tag in ('CREATE FUNCTION', 'CREATE PROCEDURE', 'CREATE AGGREGATE',
                 'ALTER FUNCTION', 'ALTER PROCEDURE', 'ALTER ROUTINE', 'ALTER AGGREGATE')
    execute function agent.idempotency_private_functions();
exception when insufficient_privilege then
  raise warning 'idempotency plane: % may not create event triggers; functions created later in schema agent '
                'stay executable by PUBLIC until revoked (anon and authenticated still lack USAGE on the schema)',
                current_user;
end
$trigger$;

-- supabase/schemas/90_grants.sql

-- Who may do what, on the types, tables, view and functions (the schema's
-- own grants are in 01_schema.sql). Every function is private unless
-- granted here: the API role service_role calls the public surface. No API
-- role holds any privilege on a table; the functions that write are owned
-- by idempotency_owner and run as it (SECURITY DEFINER).

REVOKE ALL ON TABLE agent.idempotency_keys FROM PUBLIC, anon, authenticated, service_role;
REVOKE ALL ON TABLE agent.idempotency_scopes FROM PUBLIC, anon, authenticated, service_role;
REVOKE ALL ON TABLE agent.idempotency_scheduled_calls FROM PUBLIC, anon, authenticated, service_role;
REVOKE ALL ON TABLE agent.idempotency_settings FROM PUBLIC, anon, authenticated, service_role;
REVOKE ALL ON TABLE agent.provider_jobs FROM PUBLIC, anon, authenticated, service_role;
REVOKE ALL ON TABLE agent.runs FROM PUBLIC, anon, authenticated, service_role;

GRANT USAGE ON SCHEMA agent TO service_role;
GRANT ALL ON SCHEMA agent TO idempotency_owner;

REVOKE ALL ON TYPE agent.idempotency_claim FROM PUBLIC;
GRANT ALL ON TYPE agent.idempotency_claim TO service_role;

REVOKE ALL ON TYPE agent.idempotency_claim_item FROM PUBLIC;
GRANT ALL ON TYPE agent.idempotency_claim_item TO service_role;

REVOKE ALL ON TYPE agent.idempotency_claim_outcome FROM PUBLIC;
GRANT ALL ON TYPE agent.idempotency_claim_outcome TO service_role;

REVOKE ALL ON TYPE agent.idempotency_completion_item FROM PUBLIC;
GRANT ALL ON TYPE agent.idempotency_completion_item TO service_role;

REVOKE ALL ON TYPE agent.idempotency_queue_ending FROM PUBLIC;

REVOKE ALL ON TYPE agent.idempotency_queue_extended FROM PUBLIC;
GRANT ALL ON TYPE agent.idempotency_queue_extended TO service_role;

REVOKE ALL ON TYPE agent.idempotency_queue_item FROM PUBLIC;
GRANT ALL ON TYPE agent.idempotency_queue_item TO service_role;

REVOKE ALL ON TYPE agent.idempotency_queue_settled FROM PUBLIC;
GRANT ALL ON TYPE agent.idempotency_queue_settled TO service_role;

REVOKE ALL ON TYPE agent.idempotency_release_item FROM PUBLIC;
GRANT ALL ON TYPE agent.idempotency_release_item TO service_role;

REVOKE ALL ON TYPE agent.run_admission FROM PUBLIC;
GRANT ALL ON TYPE agent.run_admission TO service_role;

GRANT SELECT ON TABLE agent.idempotency_rows TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_canonical_json(p_value jsonb) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_cap_probe(p_rows integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_cap_probe(p_rows integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_check_batch(p_items jsonb, p_row_cap integer) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_check_item(p_item jsonb, p_index integer) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_check_key(p_organization_id uuid, p_scope text, p_key text) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_check_work(p_scope text, p_request jsonb) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_claim(p_organization_id uuid, p_scope text, p_key text, p_request_hash text, p_lease_token uuid, p_lease_ms bigint, p_request jsonb) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_claim(p_organization_id uuid, p_scope text, p_key text, p_request_hash text, p_lease_token uuid, p_lease_ms bigint, p_request jsonb) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_claim_many(p_organization_id uuid, p_scope text, p_lease_ms bigint, p_items jsonb, p_row_cap integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_claim_many(p_organization_id uuid, p_scope text, p_lease_ms bigint, p_items jsonb, p_row_cap integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_claim_of(k agent.idempotency_keys) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_complete(p_claim_id uuid, p_lease_token uuid, p_resource_type text, p_resource_id text, p_response jsonb, p_organization_id uuid) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_complete(p_claim_id uuid, p_lease_token uuid, p_resource_type text, p_resource_id text, p_response jsonb, p_organization_id uuid) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_complete_many(p_organization_id uuid, p_items jsonb, p_row_cap integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_complete_many(p_organization_id uuid, p_items jsonb, p_row_cap integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_decide(p_organization_id uuid, p_scope text, p_key text, p_request_hash text, p_lease_token uuid, p_lease_ms bigint, p_retain_ms bigint, p_may_insert boolean, p_may_take_over boolean, p_request jsonb) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_delete_expired(p_ids uuid[]) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_delete_expired(p_ids uuid[]) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_expired(p_limit integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_expired(p_limit integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_extend(p_claim_id uuid, p_lease_token uuid, p_lease_ms bigint, p_organization_id uuid) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_extend(p_claim_id uuid, p_lease_token uuid, p_lease_ms bigint, p_organization_id uuid) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_failures(p_scope text, p_limit integer, p_organization_id uuid, p_since timestamp with time zone, p_row_cap integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_failures(p_scope text, p_limit integer, p_organization_id uuid, p_since timestamp with time zone, p_row_cap integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_failures_scope(p_scope text, p_limit integer, p_row_cap integer) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_get(p_organization_id uuid, p_scope text, p_key text) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_get(p_organization_id uuid, p_scope text, p_key text) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_item_text(p_item jsonb, p_index integer, p_field text, p_required boolean) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_item_uuid(p_item jsonb, p_index integer, p_field text) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_json_number(p_number numeric) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_json_size(p_value jsonb) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_orphans(p_limit integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_orphans(p_limit integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_policies(p_scope text) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_policies(p_scope text) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_policy(p_scope text, OUT retain interval, OUT max_response_bytes integer, OUT max_request_bytes integer, OUT max_attempts integer) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_private_functions() FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_queue_check(p_name text, p_argument text) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_queue_extend(p_queue text, p_lease_ms bigint, p_items jsonb, p_row_cap integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_queue_extend(p_queue text, p_lease_ms bigint, p_items jsonb, p_row_cap integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_queue_items(p_items jsonb, p_row_cap integer, p_endings boolean) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_queue_letter(p_queue text, p_dead_letter_queue text, p_msg_id bigint, p_read_ct integer, p_message jsonb, p_failure jsonb) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_queue_lock(p_queue text, p_msg_ids bigint[], p_organizations uuid[], p_claim_ids uuid[]) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_queue_privileges(p_queue text, p_dead_letter_queue text) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_queue_settle(p_queue text, p_dead_letter_queue text, p_items jsonb, p_row_cap integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_queue_settle(p_queue text, p_dead_letter_queue text, p_items jsonb, p_row_cap integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_queue_take(p_queue text, p_dead_letter_queue text, p_organization_id uuid, p_lease_ms bigint, p_lease_tokens uuid[], p_max_reads integer, p_scope text, p_organizations uuid[], p_row_cap integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_queue_take(p_queue text, p_dead_letter_queue text, p_organization_id uuid, p_lease_ms bigint, p_lease_tokens uuid[], p_max_reads integer, p_scope text, p_organizations uuid[], p_row_cap integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_reclaim(p_organization_id uuid, p_scope text, p_key text, p_request_hash text, p_lease_token uuid, p_lease_ms bigint, p_retain_ms bigint) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_reclaim(p_organization_id uuid, p_scope text, p_key text, p_request_hash text, p_lease_token uuid, p_lease_ms bigint, p_retain_ms bigint) TO service_role;

GRANT SELECT ON TABLE agent.idempotency_work TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_redrive(p_scope text, p_lease_tokens uuid[], p_lease_ms bigint, p_organization_id uuid, p_row_cap integer, p_max_bytes bigint) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_redrive(p_scope text, p_lease_tokens uuid[], p_lease_ms bigint, p_organization_id uuid, p_row_cap integer, p_max_bytes bigint) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_redrivable(p_claim_ids uuid[], p_scope text, p_organization_id uuid, p_since timestamp with time zone, p_row_cap integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_redrivable(p_claim_ids uuid[], p_scope text, p_organization_id uuid, p_since timestamp with time zone, p_row_cap integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_redrive_failed(p_scope text, p_limit integer, p_organization_id uuid, p_since timestamp with time zone, p_claim_ids uuid[], p_row_cap integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_redrive_failed(p_scope text, p_limit integer, p_organization_id uuid, p_since timestamp with time zone, p_claim_ids uuid[], p_row_cap integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_release(p_claim_id uuid, p_lease_token uuid, p_organization_id uuid) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_release(p_claim_id uuid, p_lease_token uuid, p_organization_id uuid) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_release_many(p_organization_id uuid, p_items jsonb, p_row_cap integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_release_many(p_organization_id uuid, p_items jsonb, p_row_cap integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_request_hash(p_value jsonb) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_request_hash(p_value jsonb) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_surface() FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_surface() TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_retire_expired(p_ids uuid[]) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_retire_expired(p_ids uuid[]) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_row_cap(p_row_cap integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_row_cap(p_row_cap integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_scheduled_call(p_job text, p_request_id bigint, p_answers jsonb) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_scheduled_call(p_job text, p_request_id bigint, p_answers jsonb) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_scheduled_pending(p_job text) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_scheduled_pending(p_job text) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_scheduled_failures(p_since timestamp with time zone, p_row_cap integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_scheduled_failures(p_since timestamp with time zone, p_row_cap integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_sweep(p_bound integer, p_row_cap integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_sweep(p_bound integer, p_row_cap integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_try_claim(p_organization_id uuid, p_scope text, p_key text, p_request_hash text, p_lease_token uuid, p_lease_ms bigint, p_retain_ms bigint) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_try_claim(p_organization_id uuid, p_scope text, p_key text, p_request_hash text, p_lease_token uuid, p_lease_ms bigint, p_retain_ms bigint) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_utf16_order(p_key text) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.provider_job_lookup(p_provider text, p_job_id text) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.provider_job_lookup(p_provider text, p_job_id text) TO service_role;

REVOKE ALL ON FUNCTION agent.provider_job_register(p_organization_id uuid, p_provider text, p_job_id text) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.provider_job_register(p_organization_id uuid, p_provider text, p_job_id text) TO service_role;

REVOKE ALL ON FUNCTION agent.run_admit(p_organization_id uuid, p_start_key text, p_input jsonb, p_admission_token uuid, p_claim_id uuid, p_lease_token uuid, p_max_run_duration_ms bigint) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.run_admit(p_organization_id uuid, p_start_key text, p_input jsonb, p_admission_token uuid, p_claim_id uuid, p_lease_token uuid, p_max_run_duration_ms bigint) TO service_role;

REVOKE ALL ON FUNCTION agent.run_get(p_organization_id uuid, p_start_key text, p_admission_token uuid) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.run_get(p_organization_id uuid, p_start_key text, p_admission_token uuid) TO service_role;
