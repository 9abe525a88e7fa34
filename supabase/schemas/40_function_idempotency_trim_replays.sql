-- agent.idempotency_trim_replays
--
-- Deletes the replay counts (agent.idempotency_replays) older than 7 days,
-- at most the oldest day of them per call, through the table's key: a sweep
-- that was stopped for weeks catches up a day a pass, never in one long
-- statement. Answers how many rows it deleted. Private: every sweep pass
-- calls it (agent.idempotency_retire_expired).

CREATE FUNCTION agent.idempotency_trim_replays() RETURNS integer
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $$
declare
  v_deleted integer;
begin
  delete from agent.idempotency_replays r
   where r.minute < least(pg_catalog.clock_timestamp() - interval '7 days',
                          (select pg_catalog.min(o.minute) from agent.idempotency_replays o) + interval '1 day');
  get diagnostics v_deleted = row_count;
  return v_deleted;
end
$$;

ALTER FUNCTION agent.idempotency_trim_replays() OWNER TO idempotency_owner;
