-- agent.idempotency_failures_scope
--
-- Checks the scope, limit and row cap of agent.idempotency_failures and
-- agent.idempotency_redrive_failed, refusing an unknown scope (IDEM1);
-- answers a family's prefix (webhook. for webhook.*; the empty prefix for *,
-- every scope), or null for one scope. Private.

CREATE FUNCTION agent.idempotency_failures_scope(p_scope text, p_limit integer, p_row_cap integer) RETURNS text
    LANGUAGE plpgsql STABLE
    SET search_path TO ''
    AS $_$
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
$_$;

ALTER FUNCTION agent.idempotency_failures_scope(p_scope text, p_limit integer, p_row_cap integer) OWNER TO idempotency_owner;
