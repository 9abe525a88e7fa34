-- The retention sweep as a Supabase Cron (pg_cron) job: one bounded pass of
-- agent.idempotency_sweep every hour, at minute 17 (UTC),
-- reading at most 1000 expired claims, the default row cap. Not a migration:
-- run it once, as postgres, in the SQL editor or with psql. Running it again
-- updates the job. See docs/deploying.md, "Sweeping with Supabase Cron".
--
-- The job runs as the role that scheduled it. Only service_role may execute
-- the sweep, so the job's command switches to it first; postgres is a member
-- of service_role on Supabase. pg_cron runs each job in a session of its own,
-- so the switch ends with the job.

create extension if not exists pg_cron;

select cron.schedule(
  'idempotency-sweep',
  '17 * * * *',
  $$set role service_role; select * from agent.idempotency_sweep(1000)$$
);
