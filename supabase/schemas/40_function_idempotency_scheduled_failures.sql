-- agent.idempotency_scheduled_failures
--
-- The scheduled calls that failed since p_since (default: the last hour),
-- newest first, at most the row cap (public): answered with a status
-- outside 200-299 or an error, or never answered although a later call of
-- the same job ran more than 10 minutes after it (pg_net lost or purged
-- the answer). failed_calls counts every such call since p_since, whatever
-- the cap cut. Never writes.

CREATE FUNCTION agent.idempotency_scheduled_failures(p_since timestamp with time zone DEFAULT NULL::timestamp with time zone, p_row_cap integer DEFAULT NULL::integer) RETURNS TABLE(job text, request_id bigint, called_at timestamp with time zone, answered_at timestamp with time zone, status_code integer, error text, failed_calls integer)
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
declare
  v_cap integer;
  v_since timestamptz;
begin
  v_cap := agent.idempotency_row_cap(p_row_cap);
  v_since := coalesce(p_since, pg_catalog.clock_timestamp() - interval '1 hour');
  return query
    with failed as (
      select c.*
        from agent.idempotency_scheduled_calls c
       where c.called_at >= v_since
         and ((c.answered_at is not null
               and (c.status_code is null or c.status_code not between 200 and 299 or c.error is not null))
              or (c.answered_at is null
                  and exists (select 1
                                from agent.idempotency_scheduled_calls l
                               where l.job = c.job
                                 and l.called_at > c.called_at + interval '10 minutes')))
    )
    select f.job, f.request_id, f.called_at, f.answered_at, f.status_code,
           coalesce(f.error, case when f.answered_at is null then 'no answer recorded' end),
           (count(*) over ())::integer
      from failed f
     order by f.called_at desc, f.request_id desc
     limit v_cap;
end
$$;

ALTER FUNCTION agent.idempotency_scheduled_failures(p_since timestamp with time zone, p_row_cap integer) OWNER TO idempotency_owner;
