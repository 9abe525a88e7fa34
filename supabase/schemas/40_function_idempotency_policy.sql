-- agent.idempotency_policy
--
-- A scope's policy: its own row, or its family's (tool.* covers tool.search).
-- Private.

CREATE FUNCTION agent.idempotency_policy(p_scope text, OUT retain interval, OUT max_response_bytes integer, OUT max_request_bytes integer, OUT max_attempts integer) RETURNS record
    LANGUAGE plpgsql STABLE
    SET search_path TO ''
    AS $$
begin
  select s.retain, s.max_response_bytes, s.max_request_bytes, s.max_attempts
    into retain, max_response_bytes, max_request_bytes, max_attempts
    from agent.idempotency_scopes s
   where s.scope = p_scope
      or (s.scope like '%.*'
          and char_length(p_scope) > char_length(s.scope) - 1
          and left(p_scope, char_length(s.scope) - 1) = left(s.scope, -1))
   order by s.scope = p_scope desc, char_length(s.scope) desc
   limit 1;
end
$$;

ALTER FUNCTION agent.idempotency_policy(p_scope text, OUT retain interval, OUT max_response_bytes integer, OUT max_request_bytes integer, OUT max_attempts integer) OWNER TO idempotency_owner;
