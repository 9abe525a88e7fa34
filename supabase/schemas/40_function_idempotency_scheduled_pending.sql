-- agent.idempotency_scheduled_pending
--
-- The request ids of p_job's calls whose answer is not recorded yet, oldest
-- first, at most 1000 (public): what a recipe looks up in pg_net's
-- net._http_response, by id, so its answers are found however many other
-- requests pg_net made meanwhile. Never writes.

CREATE FUNCTION agent.idempotency_scheduled_pending(p_job text) RETURNS bigint[]
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
begin
  if p_job is null or char_length(p_job) not between 1 and 200 then
    raise exception 'p_job must name the job: 1 to 200 characters' using errcode = '22023';
  end if;
  return coalesce((select array_agg(p.request_id order by p.request_id)
                     from (select c.request_id
                             from agent.idempotency_scheduled_calls c
                            where c.job = p_job
                              and c.answered_at is null
                            order by c.request_id
                            limit 1000) as p), '{}'::bigint[]);
end
$$;

ALTER FUNCTION agent.idempotency_scheduled_pending(p_job text) OWNER TO idempotency_owner;
