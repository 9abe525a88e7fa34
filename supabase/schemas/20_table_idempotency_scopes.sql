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
