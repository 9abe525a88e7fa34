-- Re-drive as a Supabase Cron (pg_cron) job: every minute, pg_net POSTs to
-- the example webhook function's re-drive route, which takes over the events
-- whose worker was stopped (lease passed, still processing) and runs them
-- through the function's own processing. This is how Supabase documents
-- scheduling an Edge Function. Not a migration: run it once, as postgres, in
-- the SQL editor or with psql. Running it again updates the job.
--
-- The service key is never written into the job's text (anyone who can read
-- cron.job could read it there): the job reads it, and the project URL, from
-- Supabase Vault each time it runs. Store both once, first:
--
--   select vault.create_secret('https://<project-ref>.supabase.co', 'project_url');
--   select vault.create_secret('<the service key: sb_secret_…>', 'idempotency_service_key');
--
-- The route answers `{"redriven", "journaled", "dead_lettered", "left"}`.
-- pg_net sends the request after the job's transaction commits and keeps the
-- answer for a while (6 hours by default): see the last ones with
--
--   select status_code, content, created from net._http_response order by created desc limit 5;
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
  select net.http_post(
    url := (select decrypted_secret from vault.decrypted_secrets where name = 'project_url')
           || '/functions/v1/webhooks/redrive',
    headers := jsonb_build_object(
      'Content-Type', 'application/json',
      'Authorization', 'Bearer ' || (select decrypted_secret from vault.decrypted_secrets
                                      where name = 'idempotency_service_key')
    ),
    body := '{"limit": 50}'::jsonb,
    timeout_milliseconds := 60000
  ) as request_id;
  $$
);
