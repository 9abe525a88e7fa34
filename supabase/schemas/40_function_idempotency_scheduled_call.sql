-- agent.idempotency_scheduled_call
--
-- Records one call a scheduled job made (public): p_request_id, the id
-- pg_net's net.http_post answered, under p_job; and the answers pg_net holds
-- for earlier calls (p_answers: a JSON array of {"request_id", "status_code",
-- "error"} read from net._http_response), each written to its call once. A
-- call answered with a status outside 200-299, or an error, is a failure
-- (a WARNING names how many this run found); calls older than 7 days are
-- forgotten, at most 1000 a run. Answers the number of answers recorded.

CREATE FUNCTION agent.idempotency_scheduled_call(p_job text, p_request_id bigint, p_answers jsonb DEFAULT '[]'::jsonb) RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    AS $$
declare
  v_recorded integer;
  v_failed integer;
begin
  if p_job is null or char_length(p_job) not between 1 and 200 then
    raise exception 'p_job must name the job: 1 to 200 characters' using errcode = '22023';
  end if;
  if p_request_id is null then
    raise exception 'p_request_id must be the id net.http_post answered' using errcode = '22023';
  end if;
  if p_answers is null or jsonb_typeof(p_answers) <> 'array' or jsonb_array_length(p_answers) > 10000 then
    raise exception 'p_answers must be a JSON array of at most 10000 {"request_id", "status_code", "error"}'
      using errcode = '22023';
  end if;

  -- A request id seen before is pg_net's counter starting again (the
  -- extension reinstalled): the new call replaces the old record.
  insert into agent.idempotency_scheduled_calls (request_id, job)
  values (p_request_id, p_job)
  on conflict (request_id) do update
     set job = excluded.job, called_at = pg_catalog.clock_timestamp(),
         answered_at = null, status_code = null, error = null;

  with answers as (
    select distinct on ((a ->> 'request_id')::bigint)
           (a ->> 'request_id')::bigint as request_id,
           case when jsonb_typeof(a -> 'status_code') = 'number'
                then (a ->> 'status_code')::numeric end as status_code,
           left(nullif(a ->> 'error', ''), 2000) as error
      from jsonb_array_elements(p_answers) as e(a)
     where jsonb_typeof(a) = 'object'
       and jsonb_typeof(a -> 'request_id') = 'number'
       and (a ->> 'request_id') ~ '^[0-9]{1,18}$'
  ), answered as (
    update agent.idempotency_scheduled_calls as c
       set answered_at = pg_catalog.clock_timestamp(),
           status_code = case when a.status_code between 0 and 999 then a.status_code::integer end,
           error = coalesce(a.error, case when a.status_code is null then 'no status' end)
      from answers a
     where c.request_id = a.request_id
       and c.answered_at is null
    returning c.status_code, c.error
  )
  select count(*)::integer,
         (count(*) filter (where status_code is null or status_code not between 200 and 299
                              or error is not null))::integer
    into v_recorded, v_failed
    from answered;

  delete from agent.idempotency_scheduled_calls
   where request_id in (select o.request_id
                          from agent.idempotency_scheduled_calls o
                         where o.called_at < pg_catalog.clock_timestamp() - interval '7 days'
                         order by o.called_at
                         limit 1000);

  if v_failed > 0 then
    raise warning '% scheduled call(s) failed (an HTTP status outside 200-299, or no answer)', v_failed
      using hint = 'select * from agent.idempotency_scheduled_failures(); idem doctor names them too';
  end if;
  return v_recorded;
end
$$;

ALTER FUNCTION agent.idempotency_scheduled_call(p_job text, p_request_id bigint, p_answers jsonb) OWNER TO idempotency_owner;
