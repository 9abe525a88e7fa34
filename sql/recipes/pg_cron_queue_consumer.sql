-- The queue consumer as a Supabase Cron (pg_cron) job: every 10 seconds,
-- pg_net POSTs to the example queue-consumer function, which drains one batch
-- of its queue (read, claim in one round trip, run, journal in one round
-- trip, archive what ended). This is how Supabase documents scheduling an
-- Edge Function. Not a migration: run it once, as postgres, in the SQL editor
-- or with psql. Running it again updates the job.
--
-- The service key is never written into the job's text (anyone who can read
-- cron.job could read it there): the job reads it, and the project URL, from
-- Supabase Vault each time it runs. Store both once, first (the re-drive
-- recipe uses the same two secrets):
--
--   select vault.create_secret('https://<project-ref>.supabase.co', 'project_url');
--   select vault.create_secret('<the service key: sb_secret_…>', 'idempotency_service_key');
--
-- The function answers `{"read", "ran", "replayed", "failed", "archived",
-- "dead_lettered", "left"}`; see the last answers with
--
--   select status_code, content, created from net._http_response order by created desc limit 5;
--
-- A job drains one batch (BATCH, default 10) per run: for a busier queue,
-- raise BATCH (at most the plane's row cap) or schedule more often. Two runs
-- that overlap are safe: pgmq hides what one read from the other, and the
-- plane runs each message's effect once whatever pgmq delivers. Stop it with:
--
--   select cron.unschedule('idempotency-queue-consumer');

create extension if not exists pg_cron;
create extension if not exists pg_net;

select cron.schedule(
  'idempotency-queue-consumer',
  '10 seconds',
  $$
  select net.http_post(
    url := (select decrypted_secret from vault.decrypted_secrets where name = 'project_url')
           || '/functions/v1/queue-consumer',
    headers := jsonb_build_object(
      'Content-Type', 'application/json',
      'Authorization', 'Bearer ' || (select decrypted_secret from vault.decrypted_secrets
                                      where name = 'idempotency_service_key')
    ),
    body := '{}'::jsonb,
    timeout_milliseconds := 60000
  ) as request_id;
  $$
);
