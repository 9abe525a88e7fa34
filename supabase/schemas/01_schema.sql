-- Schema agent holds the whole plane. Its owner is the role that applies
-- the schema (postgres on Supabase). Only service_role may use it: anon,
-- authenticated and PUBLIC hold no USAGE, so they cannot call anything in
-- it even where the event trigger (80_event_trigger.sql) does not fire.
-- PostgREST must expose it (supabase/config.toml, [api] schemas).

CREATE SCHEMA agent;

GRANT USAGE ON SCHEMA agent TO service_role;
GRANT ALL ON SCHEMA agent TO idempotency_owner;
