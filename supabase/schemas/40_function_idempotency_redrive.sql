-- agent.idempotency_redrive
--
-- Takes over orphans of a scope or family (public): claims still processing
-- whose lease passed and that carry their work, with FOR UPDATE SKIP LOCKED
-- so concurrent re-drivers split them. One whose work was handed out
-- max_attempts times is journaled as dead-lettered instead.

CREATE FUNCTION agent.idempotency_redrive(p_scope text, p_limit integer, p_lease_ms bigint, p_organization_id uuid DEFAULT NULL::uuid, p_row_cap integer DEFAULT 1000) RETURNS SETOF agent.idempotency_work
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $_$
declare
  v_family boolean;
  v_prefix text;
  v_lease interval;
  v_at timestamptz;
begin
  if p_scope is null then
    raise exception 'p_scope is required' using errcode = '22023';
  end if;
  if char_length(p_scope) > 128 or p_scope !~ '^[a-z0-9_-]+(\.[a-z0-9_-]+)*(\.\*)?$' then
    raise exception 'p_scope must be a scope (webhook.stripe) or a family (webhook.*) of a-z, 0-9, "_" and "-", got %',
                    pg_catalog.left(p_scope, 128)
      using errcode = '22023';
  end if;
  if p_limit is null then
    raise exception 'p_limit is required: the most orphans one call takes over' using errcode = '22023';
  end if;
  if p_lease_ms is null or p_lease_ms not between 1000 and 86400000 then
    raise exception 'p_lease_ms must be between 1000 (one second) and 86400000 (one day), got %', p_lease_ms
      using errcode = '22023';
  end if;
  if p_row_cap is null or p_row_cap not between 1 and 100000 then
    raise exception 'p_row_cap must be between 1 and 100000, got %', p_row_cap
      using errcode = '22023',
            hint = 'the row cap the caller is held to: PostgREST db-max-rows, Supabase api.max_rows (default 1000)';
  end if;
  if p_limit not between 1 and p_row_cap then
    raise exception 'p_limit must be between 1 and the row cap p_row_cap %, got %', p_row_cap, p_limit
      using errcode = '22023',
            hint = 'a re-drive answers every claim it takes over; more than the row cap would be cut from the answer';
  end if;

  v_family := right(p_scope, 2) = '.*';
  v_prefix := case when v_family then left(p_scope, -1) end;
  if (select p.retain from agent.idempotency_policy(p_scope) p) is null
     and not (v_family and exists (select 1 from agent.idempotency_scopes s
                                    where left(s.scope, char_length(v_prefix)) = v_prefix)) then
    raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', p_scope
      using errcode = 'IDEM1',
            hint = 'add the scope (or its family, e.g. webhook.*) to agent.idempotency_scopes in a migration';
  end if;

  v_lease := p_lease_ms * interval '1 millisecond';
  v_at := pg_catalog.clock_timestamp();
  return query
    with orphans as (
      select k.id, k.organization_id, k.scope
        from agent.idempotency_keys k
       where k.redrive_at <= v_at
         and k.status = 'processing'
         and k.lease_expires_at <= v_at
         and (k.scope = p_scope or (v_family and left(k.scope, char_length(v_prefix)) = v_prefix))
         and (p_organization_id is null or k.organization_id = p_organization_id)
       order by k.redrive_at, k.id
       limit p_limit
         for update of k skip locked
    ), decided as (
      select o.id, o.organization_id, p.max_attempts
        from orphans o
       cross join lateral agent.idempotency_policy(o.scope) p
    ), taken as (
      update agent.idempotency_keys as k
         set status = case when k.reclaims + 1 >= d.max_attempts then 'completed' else 'processing' end,
             response = case when k.reclaims + 1 >= d.max_attempts
                             then jsonb_build_object('ok', false, 'error', 'dead_lettered',
                                                     'output', jsonb_build_object('attempts', k.reclaims + 1))
                             else k.response end,
             lease_token = case when k.reclaims + 1 >= d.max_attempts then k.lease_token
                                else gen_random_uuid() end,
             claimed_at = case when k.reclaims + 1 >= d.max_attempts then k.claimed_at else v_at end,
             lease_expires_at = case when k.reclaims + 1 >= d.max_attempts then k.lease_expires_at
                                     else v_at + v_lease end,
             retain_until = case when k.reclaims + 1 >= d.max_attempts
                                 then greatest(k.retain_until, v_at + (k.retain_until - k.lease_expires_at))
                                 else greatest(k.retain_until, v_at + v_lease + (k.retain_until - k.lease_expires_at))
                            end,
             reclaims = case when k.reclaims + 1 >= d.max_attempts then k.reclaims else k.reclaims + 1 end,
             redrive_at = case when k.reclaims + 1 >= d.max_attempts then null else v_at + v_lease end
        from decided d
       where k.id = d.id and k.organization_id = d.organization_id
      returning k.*
    )
    select t.id, t.organization_id, t.scope, t.key, t.request_hash, t.status,
           case when t.status = 'processing' then t.lease_token end,
           case when t.status = 'processing' then t.request end,
           t.reclaims + 1, t.claimed_at, t.lease_expires_at, t.retain_until,
           case when t.status = 'completed' then t.response end,
           (count(*) over ())::integer
      from taken t
     order by t.lease_expires_at, t.id;
end
$_$;

ALTER FUNCTION agent.idempotency_redrive(p_scope text, p_limit integer, p_lease_ms bigint, p_organization_id uuid, p_row_cap integer) OWNER TO idempotency_owner;
