-- agent.idempotency_request_hash
--
-- The request hash of a JSON value (public): lowercase hex SHA-256 of its
-- canonical form, the hash every client computes for a JSON request. The
-- queue functions hash each message's payload with it; a SQL caller may too.
-- Never writes.

CREATE FUNCTION agent.idempotency_request_hash(p_value jsonb) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    SET search_path TO ''
    AS $$
  select pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(agent.idempotency_canonical_json(p_value), 'UTF8')), 'hex')
$$;

ALTER FUNCTION agent.idempotency_request_hash(p_value jsonb) OWNER TO idempotency_owner;
