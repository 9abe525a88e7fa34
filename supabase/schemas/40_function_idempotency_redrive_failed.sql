-- agent.idempotency_redrive_failed
--
-- Sends journaled failures that carry their work back to re-drive (public):
-- the chosen claim ids, or every failure claimed since p_since. Each becomes
-- an orphan again with a fresh fence and attempts from one; none of a scope
-- whose max_attempts is 1. What each replaced is kept in the row for the
-- audit: the first (the first failure, whose claim is first_claimed_at)
-- and the last 19.

CREATE FUNCTION agent.idempotency_redrive_failed(p_scope text, p_limit integer, p_organization_id uuid DEFAULT NULL::uuid, p_since timestamp with time zone DEFAULT NULL::timestamp with time zone, p_claim_ids uuid[] DEFAULT NULL::uuid[], p_row_cap integer DEFAULT NULL::integer) RETURNS SETOF agent.idempotency_failure
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
declare
  v_prefix text;
  v_at timestamptz;
begin
  v_prefix := agent.idempotency_failures_scope(p_scope, p_limit, p_row_cap);
  if p_claim_ids is not null
     and (cardinality(p_claim_ids) = 0 or array_position(p_claim_ids, null) is not null) then
    raise exception 'p_claim_ids must name at least one claim, and no NULL; omit it to send back every failure'
      using errcode = '22023';
  end if;
  if p_claim_ids is null and p_since is null then
    raise exception 'name what to send back: p_claim_ids (the chosen failures), p_since (every failure claimed since), or both'
      using errcode = '22023';
  end if;

  v_at := pg_catalog.clock_timestamp();
  return query
    with chosen as (
      select k.id, k.organization_id, k.scope, p.retain
        from agent.idempotency_keys k
       cross join lateral agent.idempotency_policy(k.scope) p
       where k.status = 'completed'
         and k.response -> 'ok' = 'false'::jsonb
         and k.request is not null
         and p.retain is not null
         and p.max_attempts > 1
         and (k.scope = p_scope or (v_prefix is not null and left(k.scope, char_length(v_prefix)) = v_prefix))
         and (p_organization_id is null or k.organization_id = p_organization_id)
         and (p_since is null or k.claimed_at >= p_since)
         and (p_claim_ids is null or k.id = any (p_claim_ids))
       order by k.claimed_at, k.id
       limit p_limit
         for update of k skip locked
    ), sent as (
      update agent.idempotency_keys as k
         set status = 'processing',
             response = null,
             resource_type = null,
             resource_id = null,
             lease_token = gen_random_uuid(),
             claimed_at = v_at,
             lease_expires_at = v_at,
             redrive_at = v_at,
             reclaims = 0,
             retain_until = greatest(k.retain_until, v_at + c.retain),
             replaced = (
               select coalesce(jsonb_agg(e.entry order by e.n), '[]'::jsonb)
                 from jsonb_array_elements(
                        coalesce(k.replaced, '[]'::jsonb)
                        || jsonb_build_array(jsonb_build_object(
                             'response', k.response,
                             'resource_type', k.resource_type,
                             'resource_id', k.resource_id,
                             'attempts', k.reclaims + 1,
                             'claimed_at', k.claimed_at,
                             'sent_back_at', v_at))
                      ) with ordinality as e(entry, n)
                where e.n = 1 or e.n > jsonb_array_length(coalesce(k.replaced, '[]'::jsonb)) + 1 - 19
             )
        from chosen c
       where k.id = c.id and k.organization_id = c.organization_id
      returning k.*
    )
    select s.id, s.organization_id, s.scope, s.key, s.status,
           s.replaced -> -1 -> 'response' ->> 'error', s.replaced -> -1 -> 'response',
           s.replaced -> -1 ->> 'resource_type', s.replaced -> -1 ->> 'resource_id',
           (s.replaced -> -1 ->> 'attempts')::integer, s.claimed_at, s.retain_until,
           true, jsonb_array_length(s.replaced),
           (count(*) over ())::integer,
           (s.replaced -> 0 ->> 'claimed_at')::timestamptz, s.traceparent
      from sent s
     order by s.id;
end
$$;

ALTER FUNCTION agent.idempotency_redrive_failed(p_scope text, p_limit integer, p_organization_id uuid, p_since timestamp with time zone, p_claim_ids uuid[], p_row_cap integer) OWNER TO idempotency_owner;
