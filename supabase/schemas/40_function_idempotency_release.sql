-- agent.idempotency_release
--
-- Gives a claim back (public) so the next caller runs it: true when
-- p_lease_token was still its fence. Only for an effect known not to have
-- happened.

CREATE FUNCTION agent.idempotency_release(p_claim_id uuid, p_lease_token uuid, p_organization_id uuid DEFAULT NULL::uuid) RETURNS boolean
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
begin
  if p_claim_id is null then
    raise exception 'p_claim_id is required' using errcode = '22023';
  end if;
  if p_lease_token is null then
    raise exception 'p_lease_token is required' using errcode = '22023';
  end if;
  if p_organization_id is null then
    -- A caller that does not name the organization: found by id alone,
    -- which a partitioned table answers from every partition.
    delete from agent.idempotency_keys k
     where k.id = p_claim_id
       and k.lease_token = p_lease_token
       and k.status = 'processing';
  else
    delete from agent.idempotency_keys k
     where k.organization_id = p_organization_id
       and k.id = p_claim_id
       and k.lease_token = p_lease_token
       and k.status = 'processing';
  end if;
  return found;
end
$$;

ALTER FUNCTION agent.idempotency_release(p_claim_id uuid, p_lease_token uuid, p_organization_id uuid) OWNER TO idempotency_owner;
