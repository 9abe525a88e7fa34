-- agent.idempotency_expired
--
-- The oldest claims past retention (public), for the sweeper; lease_token
-- never shown.

CREATE FUNCTION agent.idempotency_expired(p_limit integer) RETURNS SETOF agent.idempotency_rows
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
declare
  v_row agent.idempotency_rows;
begin
  if p_limit is null or p_limit not between 1 and agent.idempotency_row_cap() then
    raise exception 'p_limit must be between 1 and the plane''s row cap %, got %', agent.idempotency_row_cap(), p_limit
      using errcode = '22023';
  end if;
  for v_row in
    select k.id, k.organization_id, k.scope, k.key, k.request_hash, k.status, null::uuid,
           k.resource_type, k.resource_id, k.response, k.claimed_at, k.lease_expires_at,
           k.retain_until, k.reclaims
      from agent.idempotency_keys k
     where k.retain_until < now()
     order by k.retain_until, k.id
     limit p_limit
  loop
    return next v_row;
  end loop;
end
$$;

ALTER FUNCTION agent.idempotency_expired(p_limit integer) OWNER TO idempotency_owner;
