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
    traceparent text,
    CONSTRAINT idempotency_keys_completed_has_answer CHECK (((status <> 'completed'::text) OR (NULLIF(response, 'null'::jsonb) IS NOT NULL) OR (resource_id IS NOT NULL))),
    CONSTRAINT idempotency_keys_key_length CHECK (((char_length(key) >= 1) AND (char_length(key) <= 512))),
    CONSTRAINT idempotency_keys_redrive_carries_work CHECK (((redrive_at IS NULL) OR ((status = 'processing'::text) AND (request IS NOT NULL)))),
    CONSTRAINT idempotency_keys_request_hash_hex CHECK (((octet_length(request_hash) = 64) AND (request_hash !~ '[^0-9a-f]'::text))),
    CONSTRAINT idempotency_keys_resource_id_length CHECK (((char_length(resource_id) >= 1) AND (char_length(resource_id) <= 512))),
    CONSTRAINT idempotency_keys_resource_is_typed CHECK (((resource_id IS NULL) OR (resource_type IS NOT NULL))),
    CONSTRAINT idempotency_keys_resource_type_length CHECK (((char_length(resource_type) >= 1) AND (char_length(resource_type) <= 128))),
    CONSTRAINT idempotency_keys_retention_covers_lease CHECK ((retain_until >= lease_expires_at)),
    CONSTRAINT idempotency_keys_scope_length CHECK (((char_length(scope) >= 1) AND (char_length(scope) <= 128))),
    CONSTRAINT idempotency_keys_traceparent_w3c CHECK (((traceparent IS NULL) OR (traceparent ~ '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'::text))),
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

COMMENT ON COLUMN agent.idempotency_keys.traceparent IS 'The W3C traceparent of the worker that first claimed the key, when it sent one: a re-drive, a redelivery or a send-back links its span to that trace. Kept by takeovers and send-backs.';

COMMENT ON COLUMN agent.idempotency_keys.replaced IS 'What agent.idempotency_redrive_failed replaced, oldest first (at most 20: the first and the last 19): the audit of failures sent back.';

ALTER TABLE ONLY agent.idempotency_keys
    ADD CONSTRAINT idempotency_keys_org_scope_key_key UNIQUE (organization_id, scope, key);

ALTER TABLE ONLY agent.idempotency_keys
    ADD CONSTRAINT idempotency_keys_pkey PRIMARY KEY (id);

CREATE INDEX idempotency_keys_redrive_idx ON agent.idempotency_keys USING btree (scope, redrive_at) WHERE (redrive_at IS NOT NULL);

CREATE INDEX idempotency_keys_retain_until_idx ON agent.idempotency_keys USING btree (retain_until, id);

ALTER TABLE agent.idempotency_keys ENABLE ROW LEVEL SECURITY;
