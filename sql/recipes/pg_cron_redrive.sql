-- Re-drive as a Supabase Cron (pg_cron) job: every minute, pg_net POSTs to
-- the example webhook function's re-drive route, which takes over the events
-- whose worker was stopped (lease passed, still processing) and runs them
-- through the function's own processing. This is how Supabase documents
-- scheduling an Edge Function. Not a migration: run it once, as postgres, in
-- the SQL editor or with psql. Running it again updates the job.
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
-- The route answers `{"redriven", "journaled", "dead_lettered", "left"}`.
-- pg_cron reports every run `succeeded` whatever the HTTP status, and
-- pg_net keeps answers 6 hours: so each run records its call, and the
-- answers pg_net holds for the earlier ones (looked up by request id:
-- agent.idempotency_scheduled_pending), with
-- agent.idempotency_scheduled_call. A call answered outside 2xx, or not at
-- all, stays listed (7 days) where `idem doctor` reads it:
--
--   select * from agent.idempotency_scheduled_failures();
--
-- A function that re-drives another route or batch: change the path or the
-- body's limit (at most the plane's row cap; the example's default is 50).
-- Every minute suits a lease of seconds (heartbeats); pg_cron 1.5 and later
-- also take '30 seconds'. Stop it with:
--
--   select cron.unschedule('idempotency-redrive-webhooks');

create extension if not exists pg_cron;
create extension if not exists pg_net;

select cron.schedule(
  'idempotency-redrive-webhooks',
  '* * * * *',
  $$
  select agent.idempotency_scheduled_call(
    'idempotency-redrive-webhooks',
    net.http_post(
      url := (select decrypted_secret from vault.decrypted_secrets where name = 'project_url')
             || '/functions/v1/webhooks/redrive',
      headers := jsonb_build_object(
        'Content-Type', 'application/json',
        'Authorization', 'Bearer ' || (select decrypted_secret from vault.decrypted_secrets
                                        where name = 'idempotency_route_secret')
      ),
      body := '{"limit": 50}'::jsonb,
      timeout_milliseconds := 60000
    ),
    (select coalesce(jsonb_agg(jsonb_build_object(
              'request_id', r.id,
              'status_code', r.status_code,
              'error', coalesce(r.error_msg, case when r.timed_out then 'timed out' end))), '[]'::jsonb)
       from net._http_response as r
      where r.id = any (agent.idempotency_scheduled_pending('idempotency-redrive-webhooks')))
  );
  $$
);
