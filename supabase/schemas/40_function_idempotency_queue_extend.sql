-- agent.idempotency_queue_extend
--
-- A heartbeat for a batch taken from a queue (public): extends each claim's
-- lease, fenced by its token, and keeps its messages hidden as long (the
-- lease and a second more), in one transaction; answers each item's new
-- lease end, or null for a claim that is no longer the caller's.

CREATE FUNCTION agent.idempotency_queue_extend(p_queue text, p_lease_ms bigint, p_items jsonb, p_row_cap integer DEFAULT NULL::integer) RETURNS SETOF agent.idempotency_queue_extended
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $_$
declare
  v_items agent.idempotency_queue_ending[];
  v_item agent.idempotency_queue_ending;
  v_orgs uuid[];
  v_claims uuid[];
  v_locked bigint[];
  v_end timestamptz;
  v_visible integer;
begin
  perform agent.idempotency_queue_check(p_queue, 'p_queue');
  if p_lease_ms is null or p_lease_ms not between 1000 and 86400000 then
    raise exception 'p_lease_ms must be between 1000 (one second) and 86400000 (one day), got %', p_lease_ms
      using errcode = '22023';
  end if;
  v_visible := (p_lease_ms + 999) / 1000 + 1;
  v_items := agent.idempotency_queue_items(p_items, p_row_cap, false);
  select pg_catalog.array_agg(i.organization_id order by i.item), pg_catalog.array_agg(i.claim_id order by i.item)
    into v_orgs, v_claims
    from pg_catalog.unnest(v_items) i;
  select coalesce(pg_catalog.array_agg(distinct m order by m), '{}') into v_locked
    from pg_catalog.unnest(v_items) i
   cross join lateral pg_catalog.unnest(i.msg_ids) m;
  perform agent.idempotency_queue_lock(p_queue, v_locked, v_orgs, v_claims);
  foreach v_item in array v_items loop
    v_end := agent.idempotency_extend(v_item.claim_id, v_item.lease_token, p_lease_ms, v_item.organization_id);
    if v_end is not null then
      for i in 1 .. coalesce(pg_catalog.cardinality(v_item.msg_ids), 0) loop
        perform pgmq.set_vt(p_queue, v_item.msg_ids[i], v_visible);
      end loop;
    end if;
    return next (v_item.item, v_end)::agent.idempotency_queue_extended;
  end loop;
end
$_$;

ALTER FUNCTION agent.idempotency_queue_extend(p_queue text, p_lease_ms bigint, p_items jsonb, p_row_cap integer) OWNER TO idempotency_owner;
