-- agent.idempotency_json_size
--
-- The size of a JSON value as compact JSON text, in bytes: what the store
-- limits (max_response_bytes, max_request_bytes) count. Private.

CREATE FUNCTION agent.idempotency_json_size(p_value jsonb) RETURNS bigint
    LANGUAGE plpgsql IMMUTABLE
    SET search_path TO ''
    AS $$
declare
  v_text text := p_value::text;
  v_bare text := pg_catalog.regexp_replace(v_text, '"(?:[^"\\]|\\.)*"', '', 'g');
begin
  return octet_length(v_text)
         - (octet_length(v_bare) - octet_length(pg_catalog.replace(v_bare, ', ', ','))
            + octet_length(v_bare) - octet_length(pg_catalog.replace(v_bare, ': ', ':')));
end
$$;

ALTER FUNCTION agent.idempotency_json_size(p_value jsonb) OWNER TO idempotency_owner;
