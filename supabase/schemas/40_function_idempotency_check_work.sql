-- agent.idempotency_check_work
--
-- Refuses work a claim would store that its scope does not keep: above the
-- scope's max_request_bytes as compact JSON (IDEM5), nested deeper than 64
-- levels (IDEM6), or of a scope with no policy (IDEM1). Private: called by
-- the claim functions before anything is written.

CREATE FUNCTION agent.idempotency_check_work(p_scope text, p_request jsonb) RETURNS void
    LANGUAGE plpgsql STABLE
    SET search_path TO ''
    AS $$
declare
  v_size bigint := octet_length(p_request::text);
  v_limit integer;
begin
  -- No text under the smallest limit a policy may set (1024) can be above
  -- one, or 64 levels deep under 130 bytes.
  if v_size >= 130
     and jsonb_path_exists(p_request, 'strict $.**{64} ? (@.type() == "array" || @.type() == "object")') then
    raise exception 'the request nests arrays and objects deeper than 64 levels, more than every client reads back'
      using errcode = 'IDEM6',
            hint = 'flatten the request, or store it as its JSON text ({"$json": "<text>"})';
  end if;
  if v_size > 1024 then
    select p.max_request_bytes into v_limit from agent.idempotency_policy(p_scope) p;
    if v_limit is null then
      raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', p_scope
        using errcode = 'IDEM1',
              hint = 'add the scope (or its family, e.g. tool.*) to agent.idempotency_scopes in a migration';
    end if;
    if v_size > v_limit then
      v_size := agent.idempotency_json_size(p_request);
      if v_size > v_limit then
        raise exception 'the request is % bytes as compact JSON, above the % bytes scope % keeps',
                        v_size, v_limit, p_scope
          using errcode = 'IDEM5',
                hint = 'store the work elsewhere and claim with a reference to it, '
                       'or raise max_request_bytes for the scope';
      end if;
    end if;
  end if;
end
$$;

ALTER FUNCTION agent.idempotency_check_work(p_scope text, p_request jsonb) OWNER TO idempotency_owner;
