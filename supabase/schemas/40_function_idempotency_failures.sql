-- agent.idempotency_failures
--
-- Lists journaled failures of a scope or family (public), oldest claim first.
-- Never writes.

CREATE FUNCTION agent.idempotency_failures(p_scope text, p_limit integer, p_organization_id uuid DEFAULT NULL::uuid, p_since timestamp with time zone DEFAULT NULL::timestamp with time zone, p_row_cap integer DEFAULT NULL::integer) RETURNS SETOF agent.idempotency_failure
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
declare
  v_prefix text;
begin
  v_prefix := agent.idempotency_failures_scope(p_scope, p_limit, p_row_cap);
  return query
    with failed as (
      select k.*
        from agent.idempotency_keys k
       where k.status = 'completed'
         and k.response -> 'ok' = 'false'::jsonb
         and (k.scope = p_scope or (v_prefix is not null and left(k.scope, char_length(v_prefix)) = v_prefix))
         and (p_organization_id is null or k.organization_id = p_organization_id)
         and (p_since is null or k.claimed_at >= p_since)
       order by k.claimed_at, k.id
       limit p_limit
    )
    select f.id, f.organization_id, f.scope, f.key, f.status, f.response ->> 'error', f.response,
           f.resource_type, f.resource_id, f.reclaims + 1, f.claimed_at, f.retain_until,
           f.request is not null, coalesce(jsonb_array_length(f.replaced), 0),
           (count(*) over ())::integer,
           coalesce((f.replaced -> 0 ->> 'claimed_at')::timestamptz, f.claimed_at), f.traceparent
      from failed f
     order by f.claimed_at, f.id;
end
$$;

ALTER FUNCTION agent.idempotency_failures(p_scope text, p_limit integer, p_organization_id uuid, p_since timestamp with time zone, p_row_cap integer) OWNER TO idempotency_owner;
