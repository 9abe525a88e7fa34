-- agent.idempotency_count_replays
--
-- Counts p_replays claims of p_scope answered from the journal, in this
-- minute's row of this backend (agent.idempotency_replays). Private: the
-- claim functions call it. Claims a Rust client answers from its own replay
-- cache never reach the plane, so they are not counted.

CREATE FUNCTION agent.idempotency_count_replays(p_scope text, p_replays bigint) RETURNS void
    LANGUAGE sql
    SET search_path TO ''
    AS $$
  insert into agent.idempotency_replays as r (minute, scope, backend, replays)
  values (pg_catalog.date_trunc('minute', pg_catalog.clock_timestamp()), p_scope, pg_catalog.pg_backend_pid(),
          p_replays)
  on conflict (minute, scope, backend) do update set replays = r.replays + excluded.replays
$$;

ALTER FUNCTION agent.idempotency_count_replays(p_scope text, p_replays bigint) OWNER TO idempotency_owner;
