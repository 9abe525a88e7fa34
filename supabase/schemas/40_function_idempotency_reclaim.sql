-- agent.idempotency_reclaim
--
-- Takes over a claim (public) that is still processing, whose lease passed
-- and whose request hash matches: the row with the new token and lease; the
-- row again to the same lease token while the lease it took is live (a repeat
-- after a lost answer); otherwise nothing.

CREATE FUNCTION agent.idempotency_reclaim(p_organization_id uuid, p_scope text, p_key text, p_request_hash text, p_lease_token uuid, p_lease_ms bigint, p_retain_ms bigint) RETURNS SETOF agent.idempotency_claim
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
begin
  if p_retain_ms is null then
    raise exception 'p_retain_ms is required' using errcode = '22023';
  end if;
  return query
    select d.id, d.organization_id, d.scope, d.key, d.request_hash, d.status, d.lease_token, d.resource_type,
           d.resource_id, d.response, d.claimed_at, d.lease_expires_at, d.retain_until, d.lease_live
      from agent.idempotency_decide(p_organization_id, p_scope, p_key, p_request_hash, p_lease_token,
                                    p_lease_ms, p_retain_ms, false, true) d
     where d.outcome in ('claimed', 'reclaimed');
end
$$;

ALTER FUNCTION agent.idempotency_reclaim(p_organization_id uuid, p_scope text, p_key text, p_request_hash text, p_lease_token uuid, p_lease_ms bigint, p_retain_ms bigint) OWNER TO idempotency_owner;
