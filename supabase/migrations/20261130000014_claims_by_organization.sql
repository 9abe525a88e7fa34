-- A claim is addressed by its organization and its id.
--
-- agent.idempotency_complete and agent.idempotency_release take a last
-- argument, p_organization_id uuid DEFAULT NULL: the organization the claim
-- was made for, which every claim row answers. Given, the completion or
-- release finds the row by (organization_id, id). That is what lets the
-- claim table be partitioned by organization (sql/layouts/): the statement
-- then touches the one partition that holds the claim instead of probing
-- every partition's index for the id. Omitted (a client written before
-- this migration), the organization is looked up by id first, so an old
-- call works as before, at the cost of that lookup.
--
-- A claim of another organization is not this caller's: given the wrong
-- organization, a completion answers no row and a release false, as when
-- the fence moved on. Everything else is 0011's: the argument checks, the
-- response's depth (IDEM3) and size (IDEM2) measured before the row is
-- locked, the fence on the lease token, and a repeat with the same token
-- and answer after a lost response answering the completed row again.
--
-- A new argument is a new signature: the old functions are dropped (a
-- second overload would make PostgREST's choice by argument names
-- ambiguous) and made again, owned, private and granted as in 0011.

drop function agent.idempotency_complete(uuid, uuid, text, text, jsonb);
drop function agent.idempotency_release(uuid, uuid);

-- Completes a claim the caller still holds.
create function agent.idempotency_complete(
  p_claim_id uuid,
  p_lease_token uuid,
  p_resource_type text default null,
  p_resource_id text default null,
  p_response jsonb default null,
  p_organization_id uuid default null
) returns setof agent.idempotency_claim
language plpgsql volatile security definer
set search_path = '' set lock_timeout = '5s'
as $$
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
    -- A caller that does not name the organization: the claim's own. Found
    -- by id alone, which a partitioned table answers from every partition.
    select k.organization_id into v_organization_id from agent.idempotency_keys k where k.id = p_claim_id;
    if not found then
      -- No such claim: nothing to complete, as the fence below would say.
      return;
    end if;
  end if;

  if v_response is not null then
    -- PostgreSQL's text form of a jsonb is the compact form plus a space
    -- after every ',' and ':' between tokens. 65 nested containers take
    -- at least 130 bytes of it; no text shorter than the smallest limit a
    -- policy may set (1024) can be above one, and only a text longer than
    -- the scope's limit is measured exactly.
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
        -- No such claim: nothing to complete, as the fence below would say.
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
         retain_until = greatest(k.retain_until,
                                 pg_catalog.clock_timestamp() + (k.retain_until - k.lease_expires_at))
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
$$;

-- Deletes an unfinished claim the caller still holds; false when the fence
-- moved on. A completed claim is the journal and is never released.
create function agent.idempotency_release(
  p_claim_id uuid,
  p_lease_token uuid,
  p_organization_id uuid default null
) returns boolean
language plpgsql volatile security definer
set search_path = '' set lock_timeout = '5s'
as $$
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

alter function agent.idempotency_complete(uuid, uuid, text, text, jsonb, uuid) owner to idempotency_owner;
alter function agent.idempotency_release(uuid, uuid, uuid) owner to idempotency_owner;

revoke all on function
  agent.idempotency_complete(uuid, uuid, text, text, jsonb, uuid),
  agent.idempotency_release(uuid, uuid, uuid)
from public, anon, authenticated;
grant execute on function
  agent.idempotency_complete(uuid, uuid, text, text, jsonb, uuid),
  agent.idempotency_release(uuid, uuid, uuid)
to service_role;
