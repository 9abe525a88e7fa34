-- agent.idempotency_complete
--
-- Journals the answer (public): completes the claim when p_lease_token is
-- still its fence, and answers the completed row; nothing when the fence
-- moved on. The work the claim carries is kept with a failure (an operator
-- may send it back to run again after a fix) and dropped with a success.

CREATE FUNCTION agent.idempotency_complete(p_claim_id uuid, p_lease_token uuid, p_resource_type text DEFAULT NULL::text, p_resource_id text DEFAULT NULL::text, p_response jsonb DEFAULT NULL::jsonb, p_organization_id uuid DEFAULT NULL::uuid) RETURNS SETOF agent.idempotency_claim
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $_$
declare
  v_resource_type text := nullif(p_resource_type, '');
  v_resource_id   text := nullif(p_resource_id, '');
  v_response      jsonb := nullif(p_response, 'null'::jsonb);
  r agent.idempotency_keys;
  v_organization_id uuid := p_organization_id;
  v_scope text;
  v_limit integer;
  v_size bigint;
begin
  if p_claim_id is null then
    raise exception 'p_claim_id is required' using errcode = '22023';
  end if;
  if p_lease_token is null then
    raise exception 'p_lease_token is required' using errcode = '22023';
  end if;
  if v_response is null and v_resource_id is null then
    raise exception 'a completion carries a response or a resource; this one carries neither'
      using errcode = '22023';
  end if;
  if v_resource_id is not null and v_resource_type is null then
    raise exception 'p_resource_id needs p_resource_type, so a reader can tell what it names'
      using errcode = '22023';
  end if;
  if char_length(v_resource_type) > 128 or char_length(v_resource_id) > 512 then
    raise exception 'p_resource_type may have at most 128 characters and p_resource_id at most 512'
      using errcode = '22023';
  end if;

  if v_organization_id is null then
    select k.organization_id into v_organization_id from agent.idempotency_keys k where k.id = p_claim_id;
    if not found then
      return;
    end if;
  end if;

  if v_response is not null then
    v_size := octet_length(v_response::text);
    if v_size >= 130
       and jsonb_path_exists(v_response, 'strict $.**{64} ? (@.type() == "array" || @.type() == "object")') then
      raise exception 'the response nests arrays and objects deeper than 64 levels, more than every client reads back'
        using errcode = 'IDEM3',
              hint = 'flatten the response, or store it elsewhere and complete with its resource';
    end if;
    if v_size > 1024 then
      select k.scope into v_scope
        from agent.idempotency_keys k
       where k.organization_id = v_organization_id and k.id = p_claim_id;
      if not found then
        return;
      end if;
      select p.max_response_bytes into v_limit from agent.idempotency_policy(v_scope) p;
      if v_limit is null then
        raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', v_scope
          using errcode = 'IDEM1';
      end if;
      if v_size > v_limit then
        v_size := agent.idempotency_json_size(v_response);
        if v_size > v_limit then
          raise exception 'the response is % bytes as compact JSON, above the % bytes scope % keeps',
                          v_size, v_limit, v_scope
            using errcode = 'IDEM2',
                  hint = 'store the response elsewhere and complete with its resource (and a reference to it)';
        end if;
      end if;
    end if;
  end if;

  update agent.idempotency_keys as k
     set status = 'completed',
         resource_type = v_resource_type,
         resource_id = v_resource_id,
         response = v_response,
         -- The work a claim carries is kept for a failure, which a fix may
         -- send back to run again; a success needs it no more.
         request = case when v_response -> 'ok' = 'false'::jsonb then k.request end,
         retain_until = greatest(k.retain_until,
                                 pg_catalog.clock_timestamp() + (k.retain_until - k.lease_expires_at)),
         redrive_at = null
   where k.organization_id = v_organization_id
     and k.id = p_claim_id
     and k.lease_token = p_lease_token
     and k.status = 'processing'
  returning k.* into r;

  if not found then
    -- Completed already by this very token: an earlier attempt of this call.
    select k.* into r
      from agent.idempotency_keys k
     where k.organization_id = v_organization_id
       and k.id = p_claim_id
       and k.lease_token = p_lease_token
       and k.status = 'completed'
       and k.resource_type is not distinct from v_resource_type
       and k.resource_id is not distinct from v_resource_id
       and k.response is not distinct from v_response;
  end if;
  if found then
    return next (r.id, r.organization_id, r.scope, r.key, r.request_hash, r.status,
                 r.lease_token, r.resource_type, r.resource_id, r.response, r.claimed_at,
                 r.lease_expires_at, r.retain_until,
                 r.status = 'processing' and r.lease_expires_at > pg_catalog.clock_timestamp())::agent.idempotency_claim;
  end if;
end
$_$;

ALTER FUNCTION agent.idempotency_complete(p_claim_id uuid, p_lease_token uuid, p_resource_type text, p_resource_id text, p_response jsonb, p_organization_id uuid) OWNER TO idempotency_owner;
