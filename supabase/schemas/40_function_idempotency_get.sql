-- agent.idempotency_get
--
-- Reads one claim (public) without writing; never answers a lease token.

CREATE FUNCTION agent.idempotency_get(p_organization_id uuid, p_scope text, p_key text) RETURNS SETOF agent.idempotency_claim
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
declare
  v_claim agent.idempotency_claim;
begin
  if p_organization_id is null or p_scope is null
     or char_length(p_scope) not between 1 and 128 or p_scope ~ '[^a-z0-9._-]'
     or p_key is null or char_length(p_key) not between 1 and 512 then
    perform agent.idempotency_check_key(p_organization_id, p_scope, p_key);
  end if;
  if (select p.retain from agent.idempotency_policy(p_scope) p) is null then
    raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', p_scope
      using errcode = 'IDEM1';
  end if;
  for v_claim in
    select c.*
      from agent.idempotency_keys k
     cross join lateral agent.idempotency_claim_of(k) c
     where k.organization_id = p_organization_id
       and k.scope = p_scope
       and k.key = p_key
  loop
    v_claim.lease_token := null;
    return next v_claim;
  end loop;
end
$$;

ALTER FUNCTION agent.idempotency_get(p_organization_id uuid, p_scope text, p_key text) OWNER TO idempotency_owner;
