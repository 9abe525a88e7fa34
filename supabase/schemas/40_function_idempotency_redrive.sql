-- agent.idempotency_redrive
--
-- Takes over orphans of a scope or family (public): claims still processing
-- whose lease passed and that carry their work, with FOR UPDATE SKIP LOCKED
-- so concurrent re-drivers split them, one per lease token the caller
-- supplies (at most the row cap). A repeat with the same tokens after a
-- lost answer answers again what the tokens still hold, at the same
-- attempt, and takes over more only with tokens that hold nothing. With
-- p_max_bytes, the work it hands out (with what the tokens already hold)
-- stays within that many bytes, and never less than one orphan: a caller
-- that can read answers of so many bytes is never handed more. One whose
-- work was handed out max_attempts times is journaled as dead-lettered
-- instead.

CREATE FUNCTION agent.idempotency_redrive(p_scope text, p_lease_tokens uuid[], p_lease_ms bigint, p_organization_id uuid DEFAULT NULL::uuid, p_row_cap integer DEFAULT NULL::integer, p_max_bytes bigint DEFAULT NULL::bigint) RETURNS SETOF agent.idempotency_work
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $_$
declare
  v_family boolean;
  v_prefix text;
  v_lease interval;
  v_at timestamptz;
  v_cap integer;
  v_count integer;
  v_earlier integer;
  v_index integer;
begin
  if p_scope is null then
    raise exception 'p_scope is required' using errcode = '22023';
  end if;
  if char_length(p_scope) > 128 or p_scope !~ '^[a-z0-9_-]+(\.[a-z0-9_-]+)*(\.\*)?$' then
    raise exception 'p_scope must be a scope (webhook.stripe) or a family (webhook.*) of a-z, 0-9, "_" and "-", got %',
                    pg_catalog.left(p_scope, 128)
      using errcode = '22023';
  end if;
  if p_lease_ms is null or p_lease_ms not between 1000 and 86400000 then
    raise exception 'p_lease_ms must be between 1000 (one second) and 86400000 (one day), got %', p_lease_ms
      using errcode = '22023';
  end if;
  v_cap := agent.idempotency_row_cap(p_row_cap);
  if p_lease_tokens is null then
    raise exception 'p_lease_tokens is required: one fresh lease token per orphan the call may take over'
      using errcode = '22023',
            hint = 'mint them as for claims; a repeat with the same tokens after a lost answer answers the same claims';
  end if;
  v_count := coalesce(pg_catalog.cardinality(p_lease_tokens), 0);
  if v_count not between 1 and v_cap then
    raise exception 'p_lease_tokens must hold between 1 and the row cap % tokens, got %', v_cap, v_count
      using errcode = '22023',
            hint = 'a re-drive answers every claim it takes over; more than the row cap would be cut from the answer';
  end if;
  if p_max_bytes is not null and p_max_bytes < 1 then
    raise exception 'p_max_bytes must be at least 1, got %', p_max_bytes using errcode = '22023';
  end if;
  if pg_catalog.array_position(p_lease_tokens, null) is not null then
    raise exception 'p_lease_tokens[%] is NULL', pg_catalog.array_position(p_lease_tokens, null) - 1
      using errcode = '22023';
  end if;
  select t.first - 1, t.i - 1 into v_earlier, v_index
    from (select i, pg_catalog.min(i) over (partition by p_lease_tokens[i]) as first
            from pg_catalog.generate_subscripts(p_lease_tokens, 1) i) t
   where t.i > t.first
   order by t.i
   limit 1;
  if v_earlier is not null then
    raise exception 'p_lease_tokens[%] repeats p_lease_tokens[%]: each orphan needs a token of its own', v_index, v_earlier
      using errcode = '22023';
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
    with mine as (
      -- What an earlier call with these tokens took over and still holds:
      -- its answer was lost, so it is answered again, at the same attempt.
      select k.*
        from agent.idempotency_keys k
       where k.redrive_at is not null
         and k.lease_token = any (p_lease_tokens)
         and k.status = 'processing'
         and (k.scope = p_scope or (v_family and left(k.scope, char_length(v_prefix)) = v_prefix))
         and (p_organization_id is null or k.organization_id = p_organization_id)
         for update of k skip locked
    ), unused as (
      select t.token, pg_catalog.row_number() over (order by t.n) as n
        from pg_catalog.unnest(p_lease_tokens) with ordinality t(token, n)
       where not exists (select 1 from mine m where m.lease_token = t.token)
    ), orphans as (
      select k.id, k.organization_id, k.scope, k.redrive_at, pg_catalog.octet_length(k.request::text) as size
        from agent.idempotency_keys k
       where k.redrive_at <= v_at
         and k.status = 'processing'
         and k.lease_expires_at <= v_at
         and k.lease_token <> all (p_lease_tokens)
         and (k.scope = p_scope or (v_family and left(k.scope, char_length(v_prefix)) = v_prefix))
         and (p_organization_id is null or k.organization_id = p_organization_id)
       order by k.redrive_at, k.id
       limit (select pg_catalog.count(*) from unused)
         for update of k skip locked
    ), numbered as (
      select o.id, o.organization_id, o.scope, pg_catalog.row_number() over (order by o.redrive_at, o.id) as n,
             pg_catalog.sum(o.size) over (order by o.redrive_at, o.id)
               + (select coalesce(pg_catalog.sum(pg_catalog.octet_length(m.request::text)), 0) from mine m) as bytes
        from orphans o
    ), decided as (
      -- Orphans locked beyond the byte budget stay orphans, for the next call.
      select o.id, o.organization_id, p.max_attempts, u.token
        from numbered o
        join unused u on u.n = o.n
       cross join lateral agent.idempotency_policy(o.scope) p
       where p_max_bytes is null or o.bytes <= p_max_bytes or (o.n = 1 and not exists (select 1 from mine))
    ), taken as (
      update agent.idempotency_keys as k
         set status = case when k.reclaims + 1 >= d.max_attempts then 'completed' else 'processing' end,
             response = case when k.reclaims + 1 >= d.max_attempts
                             then jsonb_build_object('ok', false, 'error', 'dead_lettered',
                                                     'output', jsonb_build_object('attempts', k.reclaims + 1))
                             else k.response end,
             lease_token = case when k.reclaims + 1 >= d.max_attempts then k.lease_token else d.token end,
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
    ), answered as (
      select * from taken
      union all
      select * from mine
    )
    select t.id, t.organization_id, t.scope, t.key, t.request_hash, t.status,
           case when t.status = 'processing' then t.lease_token end,
           case when t.status = 'processing' then t.request end,
           t.reclaims + 1, t.claimed_at, t.lease_expires_at, t.retain_until,
           case when t.status = 'completed' then t.response end,
           (count(*) over ())::integer,
           t.traceparent
      from answered t
     order by t.lease_expires_at, t.id;
end
$_$;

ALTER FUNCTION agent.idempotency_redrive(p_scope text, p_lease_tokens uuid[], p_lease_ms bigint, p_organization_id uuid, p_row_cap integer, p_max_bytes bigint) OWNER TO idempotency_owner;
