-- The queue consumer as a Supabase Cron (pg_cron) job: every 10 seconds,
-- pg_net POSTs to the example queue-consumer function, which drains one batch
-- of its queue (read, claim in one round trip, run, journal in one round
-- trip, archive what ended). This is how Supabase documents scheduling an
-- Edge Function. Not a migration: run it once, as postgres, in the SQL editor
-- or with psql. Running it again updates the job.
--
-- The job does not send the service key. pg_net keeps every request it
-- has not yet sent, headers included, in net.http_request_queue, which
-- Supabase lets any database role read: a service key there would be
-- readable by every role. The job sends a route secret instead, a random
-- credential that can do nothing but call this function's scheduled
-- routes, which the function compares in constant time with its
-- IDEM_ROUTE_SECRET. Nor is the secret written into the job's text (anyone
-- who can read cron.job could read it there): the job reads it, and the
-- project URL, from Supabase Vault each time it runs. Make one and store
-- both once, first (the re-drive and queue recipes share them):
--
--   openssl rand -hex 32          # the route secret
--   supabase secrets set IDEM_ROUTE_SECRET=<that secret>
--   select vault.create_secret('https://<project-ref>.supabase.co', 'project_url');
--   select vault.create_secret('<that secret>', 'idempotency_route_secret');
--
-- The function answers `{"read", "ran", "replayed", "failed", "archived",
-- "dead_lettered", "left"}`. pg_cron reports every run `succeeded`
-- whatever the HTTP status, and pg_net keeps answers 6 hours: so each run
-- records its call, and the answers pg_net holds for the earlier ones
-- (looked up by request id: agent.idempotency_scheduled_pending), with
-- agent.idempotency_scheduled_call. A call answered outside 2xx, or not at
-- all, stays listed (7 days) where `idem doctor` reads it:
--
--   select * from agent.idempotency_scheduled_failures();
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
  select agent.idempotency_scheduled_call(
    'idempotency-queue-consumer',
    net.http_post(
      url := (select decrypted_secret from vault.decrypted_secrets where name = 'project_url')
             || '/functions/v1/queue-consumer',
      headers := jsonb_build_object(
        'Content-Type', 'application/json',
        'Authorization', 'Bearer ' || (select decrypted_secret from vault.decrypted_secrets
                                        where name = 'idempotency_route_secret')
      ),
      body := '{}'::jsonb,
      timeout_milliseconds := 60000
    ),
    (select coalesce(jsonb_agg(jsonb_build_object(
              'request_id', r.id,
              'status_code', r.status_code,
              'error', coalesce(r.error_msg, case when r.timed_out then 'timed out' end))), '[]'::jsonb)
       from net._http_response as r
      where r.id = any (agent.idempotency_scheduled_pending('idempotency-queue-consumer')))
  );
  $$
);
