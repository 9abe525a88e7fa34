-- A claim's lease token is its holder's alone.
--
-- The lease token is the fence: whoever presents it may complete the claim
-- with any answer, or release it so that a second worker runs the effect
-- beside the first. Only the claimant receives it, from the claim call (and
-- from a repeat of that call with the same token, after a lost answer), and
-- from its own completion. Until now idempotency_get, and the sweeper's
-- bounded read, answered it to every service-role caller.
--
-- 1. agent.idempotency_get answers lease_token NULL, always. Whether a
--    worker holds the claim is lease_live (database clock) and status.
-- 2. agent.idempotency_expired answers lease_token NULL too: a row past
--    retention may still be processing, and its token would let anyone
--    complete it before the sweep deletes it.
--
-- Signatures, owners, grants and every other column are unchanged.

create or replace function agent.idempotency_get(
  p_organization_id uuid,
  p_scope text,
  p_key text
) returns setof agent.idempotency_claim
language plpgsql stable security definer set search_path = ''
as $$
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

create or replace function agent.idempotency_expired(p_limit integer)
returns setof agent.idempotency_rows
language plpgsql stable security definer set search_path = ''
as $$
declare
  v_row agent.idempotency_rows;
begin
  if p_limit is null or p_limit < 1 or p_limit > 100000 then
    raise exception 'p_limit must be between 1 and 100000, got %', p_limit using errcode = '22023';
  end if;
  for v_row in
    select k.*
      from agent.idempotency_keys k
     where k.retain_until < now()
     order by k.retain_until, k.id
     limit p_limit
  loop
    v_row.lease_token := null;
    return next v_row;
  end loop;
end
$$;
