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
