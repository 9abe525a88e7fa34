-- agent.idempotency_queue_check
--
-- Refuses a queue name pgmq would not have made (private): its tables are
-- named after it (q_<name>, a_<name>), so a name is 1 to 47 characters of
-- a-z, 0-9 and _.

CREATE FUNCTION agent.idempotency_queue_check(p_name text, p_argument text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
    SET search_path TO ''
    AS $$
begin
  if p_name is null or p_name !~ '^[a-z0-9_]{1,47}$' then
    raise exception '% must be a pgmq queue name (1 to 47 characters of a-z, 0-9 and _), got %',
                    p_argument, pg_catalog.left(p_name, 64)
      using errcode = '22023';
  end if;
end
$$;

ALTER FUNCTION agent.idempotency_queue_check(p_name text, p_argument text) OWNER TO idempotency_owner;
