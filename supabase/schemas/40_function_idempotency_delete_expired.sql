-- agent.idempotency_delete_expired
--
-- Retires the given claims (public) that are still past retention, as
-- agent.idempotency_retire_expired does (unfinished work is journaled as a
-- dead letter, never deleted); answers how many it deleted.

CREATE FUNCTION agent.idempotency_delete_expired(p_ids uuid[]) RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
begin
  return (select r.deleted from agent.idempotency_retire_expired(p_ids) r);
end
$$;

ALTER FUNCTION agent.idempotency_delete_expired(p_ids uuid[]) OWNER TO idempotency_owner;
