-- agent.idempotency_extend
--
-- The heartbeat (public): the lease's new end, p_lease_ms from now by the
-- database clock, or null when the claim is no longer this token's and its
-- holder must stop.

CREATE FUNCTION agent.idempotency_extend(p_claim_id uuid, p_lease_token uuid, p_lease_ms bigint, p_organization_id uuid DEFAULT NULL::uuid) RETURNS timestamp with time zone
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
declare
  v_lease interval;
  v_at timestamptz;
  v_end timestamptz;
begin
  if p_claim_id is null then
    raise exception 'p_claim_id is required' using errcode = '22023';
  end if;
  if p_lease_token is null then
    raise exception 'p_lease_token is required' using errcode = '22023';
  end if;
  if p_lease_ms is null or p_lease_ms not between 1000 and 86400000 then
    raise exception 'p_lease_ms must be between 1000 (one second) and 86400000 (one day), got %', p_lease_ms
      using errcode = '22023';
  end if;
  v_lease := p_lease_ms * interval '1 millisecond';
  v_at := pg_catalog.clock_timestamp();
  if p_organization_id is null then
    -- A caller that does not name the organization: found by id alone,
    -- which a partitioned table answers from every partition.
    update agent.idempotency_keys as k
       set lease_expires_at = v_at + v_lease,
           retain_until = greatest(k.retain_until, v_at + v_lease + (k.retain_until - k.lease_expires_at)),
           redrive_at = case when k.redrive_at is not null then v_at + v_lease end
     where k.id = p_claim_id
       and k.lease_token = p_lease_token
       and k.status = 'processing'
    returning k.lease_expires_at into v_end;
  else
    update agent.idempotency_keys as k
       set lease_expires_at = v_at + v_lease,
           retain_until = greatest(k.retain_until, v_at + v_lease + (k.retain_until - k.lease_expires_at)),
           redrive_at = case when k.redrive_at is not null then v_at + v_lease end
     where k.organization_id = p_organization_id
       and k.id = p_claim_id
       and k.lease_token = p_lease_token
       and k.status = 'processing'
    returning k.lease_expires_at into v_end;
  end if;
  return v_end;
end
$$;

ALTER FUNCTION agent.idempotency_extend(p_claim_id uuid, p_lease_token uuid, p_lease_ms bigint, p_organization_id uuid) OWNER TO idempotency_owner;
