-- agent.idempotency_policies
--
-- The policies that govern a scope or a family (public), for idem doctor
-- and operators: for one scope (webhook.stripe), the row that applies to it,
-- its own or its family's; for a family (webhook.*), that row and every row
-- under the family, so an exact scope that keeps less than its family shows
-- too. Each with its retention in milliseconds. Never writes.

CREATE FUNCTION agent.idempotency_policies(p_scope text) RETURNS TABLE(scope text, retain_ms bigint, max_response_bytes integer, max_request_bytes integer, max_attempts integer)
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $_$
declare
  v_prefix text;
  v_governs text;
begin
  if p_scope is null or char_length(p_scope) > 128 or p_scope !~ '^[a-z0-9_-]+(\.[a-z0-9_-]+)*(\.\*)?$' then
    raise exception 'p_scope must be a scope (webhook.stripe) or a family (webhook.*) of a-z, 0-9, "_" and "-", got %',
                    pg_catalog.left(p_scope, 128)
      using errcode = '22023';
  end if;
  v_prefix := case when right(p_scope, 2) = '.*' then left(p_scope, -1) end;
  select s.scope into v_governs
    from agent.idempotency_scopes s
   where s.scope = p_scope
      or (s.scope like '%.*'
          and char_length(p_scope) > char_length(s.scope) - 1
          and left(p_scope, char_length(s.scope) - 1) = left(s.scope, -1))
   order by s.scope = p_scope desc, char_length(s.scope) desc
   limit 1;
  return query
    select s.scope, (extract(epoch from s.retain) * 1000)::bigint, s.max_response_bytes, s.max_request_bytes,
           s.max_attempts
      from agent.idempotency_scopes s
     where s.scope = v_governs
        or (v_prefix is not null and left(s.scope, char_length(v_prefix)) = v_prefix)
     order by s.scope;
end
$_$;

ALTER FUNCTION agent.idempotency_policies(p_scope text) OWNER TO idempotency_owner;
