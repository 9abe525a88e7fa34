-- Operators told why a failure is not sent back, and failures of every scope.
--
-- `idem redrive --failed --id X` on a failure it could not send back
-- answered "0 sent back" and exit 0, with no reason, and `idem get` called a
-- failure "completed". agent.idempotency_redrivable (new, service_role
-- only, never writes) answers for each named claim whether
-- idempotency_redrive_failed would send it back, and if not why (absent,
-- succeeded, no work kept, in flight, orphaned, single attempt, outside the
-- filters), read as the send-back reads them. idempotency_failures and
-- idempotency_redrive_failed take `*` for every scope (through
-- idempotency_failures_scope), so `idem failures` lists every family when
-- no --scope is given.

SET local check_function_bodies = off;

CREATE OR REPLACE FUNCTION agent.idempotency_failures_scope (
  p_scope   text,
  p_limit   integer,
  p_row_cap integer
)
  RETURNS text
  LANGUAGE plpgsql
  STABLE
  SET search_path TO ''
  AS $function$
declare
  v_prefix text;
  v_cap integer;
begin
  if p_scope is null then
    raise exception 'p_scope is required' using errcode = '22023';
  end if;
  if p_scope = '*' then
    v_prefix := '';
  elsif char_length(p_scope) > 128 or p_scope !~ '^[a-z0-9_-]+(\.[a-z0-9_-]+)*(\.\*)?$' then
    raise exception 'p_scope must be a scope (webhook.stripe), a family (webhook.*) or every scope (*), of a-z, 0-9, "_" and "-", got %',
                    pg_catalog.left(p_scope, 128)
      using errcode = '22023';
  end if;
  v_cap := agent.idempotency_row_cap(p_row_cap);
  if p_limit is null or p_limit not between 1 and v_cap then
    raise exception 'p_limit must be between 1 and the row cap %, got %', v_cap, p_limit
      using errcode = '22023',
            hint = 'every failure is answered; more than the row cap would be cut from the answer';
  end if;
  if p_scope <> '*' then
    v_prefix := case when right(p_scope, 2) = '.*' then left(p_scope, -1) end;
  end if;
  if (select p.retain from agent.idempotency_policy(p_scope) p) is null
     and not (v_prefix is not null and exists (select 1 from agent.idempotency_scopes s
                                               where left(s.scope, char_length(v_prefix)) = v_prefix)) then
    raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', p_scope
      using errcode = 'IDEM1',
            hint = 'add the scope (or its family, e.g. webhook.*) to agent.idempotency_scopes in a migration';
  end if;
  return v_prefix;
end
$function$;

CREATE OR REPLACE FUNCTION agent.idempotency_redrivable (
  p_claim_ids       uuid[],
  p_scope           text                     DEFAULT NULL::text,
  p_organization_id uuid                     DEFAULT NULL::uuid,
  p_since           timestamp with time zone DEFAULT NULL::timestamp WITH time zone,
  p_row_cap         integer                  DEFAULT NULL::integer
)
  RETURNS TABLE (
    claim_id        uuid,
    organization_id uuid,
    scope           text,
    key             text,
    status          text,
    error           text,
    attempts        integer,
    claimed_at      timestamp with time zone,
    reason          text
  )
  LANGUAGE plpgsql
  STABLE
  SECURITY DEFINER
  SET search_path TO ''
  AS $function$
declare
  v_prefix text;
  v_cap integer := agent.idempotency_row_cap(p_row_cap);
begin
  if p_claim_ids is null or cardinality(p_claim_ids) = 0 or array_position(p_claim_ids, null) is not null then
    raise exception 'p_claim_ids must name at least one claim, and no NULL' using errcode = '22023';
  end if;
  if cardinality(p_claim_ids) > v_cap then
    raise exception 'p_claim_ids may name at most the row cap %, got %', v_cap, cardinality(p_claim_ids)
      using errcode = '22023';
  end if;
  if p_scope is not null then
    v_prefix := agent.idempotency_failures_scope(p_scope, 1, p_row_cap);
  end if;
  return query
    select c.id, k.organization_id, k.scope, k.key, k.status, k.response ->> 'error', k.reclaims + 1, k.claimed_at,
           case
             when k.id is null then 'absent'
             when p_organization_id is not null and k.organization_id <> p_organization_id then 'other_organization'
             when p_scope is not null and k.scope <> p_scope
                  and (v_prefix is null or left(k.scope, char_length(v_prefix)) <> v_prefix) then 'other_scope'
             when k.status = 'processing' and k.lease_expires_at > pg_catalog.clock_timestamp() then 'in_flight'
             when k.status = 'processing' then 'orphaned'
             when k.response -> 'ok' is distinct from 'false'::jsonb then 'succeeded'
             when k.request is null then 'no_work'
             when p.retain is null or p.max_attempts <= 1 then 'single_attempt'
             when p_since is not null and k.claimed_at < p_since then 'before_since'
             else 'redrivable'
           end
      from unnest(p_claim_ids) with ordinality c(id, n)
      left join agent.idempotency_keys k on k.id = c.id
      left join lateral agent.idempotency_policy(k.scope) p on true
     order by c.n;
end
$function$;

ALTER FUNCTION "agent"."idempotency_redrivable"(uuid[], text, uuid, timestamp WITH time zone, integer) OWNER TO "idempotency_owner";

REVOKE ALL ON FUNCTION "agent"."idempotency_redrivable"(uuid[], text, uuid, timestamp WITH time zone, integer) FROM PUBLIC;

GRANT EXECUTE ON FUNCTION "agent"."idempotency_redrivable"(uuid[], text, uuid, timestamp WITH time zone, integer) TO "service_role";
