-- agent.idempotency_activity
--
-- Claims, replays and failures over time (public), for an operator's
-- console: one row per p_bucket_s seconds (whole minutes, up to a day) from
-- the minute of p_since to now, oldest first, every bucket answered (zeros
-- included). The buckets must
-- fit p_limit (1 to the row cap), else 22023. Claims are counted by their
-- latest claim time and failures by the claim time of the attempt that
-- failed, among claims the sweep has not retired; replays from
-- agent.idempotency_replays (7 days). Never writes.

CREATE FUNCTION agent.idempotency_activity(p_since timestamp with time zone, p_bucket_s integer, p_limit integer) RETURNS SETOF agent.idempotency_activity_bucket
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
declare
  v_at timestamptz := pg_catalog.clock_timestamp();
  v_start timestamptz;
  v_buckets bigint;
begin
  if p_limit is null or p_limit not between 1 and agent.idempotency_row_cap() then
    raise exception 'p_limit must be between 1 and the row cap % buckets, got %', agent.idempotency_row_cap(), p_limit
      using errcode = '22023';
  end if;
  if p_bucket_s is null or p_bucket_s not between 60 and 86400 or p_bucket_s % 60 <> 0 then
    raise exception 'p_bucket_s must be whole minutes, 60 to 86400 seconds, got %', p_bucket_s using errcode = '22023';
  end if;
  if p_since is null or not pg_catalog.isfinite(p_since) or p_since >= v_at then
    raise exception 'p_since must be a time in the past, got %', p_since using errcode = '22023';
  end if;
  v_start := pg_catalog.date_trunc('minute', p_since);
  v_buckets := pg_catalog.ceil(extract(epoch from v_at - v_start) / p_bucket_s)::bigint;
  if v_buckets > p_limit then
    raise exception 'from % to now is % buckets of % s, more than p_limit %', v_start, v_buckets, p_bucket_s, p_limit
      using errcode = '22023',
            hint = 'start later, or take longer buckets';
  end if;
  return query
    with buckets as (
      select n, v_start + n * p_bucket_s * interval '1 second' as bucket
        from pg_catalog.generate_series(0::bigint, v_buckets - 1) n
    ), claims as (
      select pg_catalog.floor(extract(epoch from k.claimed_at - v_start) / p_bucket_s)::bigint as n,
             pg_catalog.count(*) as claims,
             pg_catalog.count(*) filter (where k.status = 'completed' and k.response -> 'ok' = 'false'::jsonb)
               as failures
        from agent.idempotency_keys k
       where k.claimed_at >= v_start
       group by 1
    ), replays as (
      select pg_catalog.floor(extract(epoch from r.minute - v_start) / p_bucket_s)::bigint as n,
             pg_catalog.sum(r.replays)::bigint as replays
        from agent.idempotency_replays r
       where r.minute >= v_start
       group by 1
    )
    select b.bucket, coalesce(c.claims, 0), coalesce(r.replays, 0), coalesce(c.failures, 0)
      from buckets b
      left join claims c on c.n = b.n
      left join replays r on r.n = b.n
     order by b.bucket;
end
$$;

ALTER FUNCTION agent.idempotency_activity(p_since timestamp with time zone, p_bucket_s integer, p_limit integer) OWNER TO idempotency_owner;
