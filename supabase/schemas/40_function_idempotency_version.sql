-- agent.idempotency_version
--
-- A processing claim's version, as agent.idempotency_processing shows it and
-- agent.idempotency_abandon compares it: hex SHA-256 of its lease token, lease
-- end (microseconds since the epoch) and takeover count. Any claim, takeover
-- or heartbeat changes it; the token cannot be read back from it. Private.

CREATE FUNCTION agent.idempotency_version(p_lease_token uuid, p_lease_expires_at timestamp with time zone, p_reclaims integer) RETURNS text
    LANGUAGE sql IMMUTABLE
    SET search_path TO ''
    AS $$
  select pg_catalog.encode(
           pg_catalog.sha256(pg_catalog.convert_to(
             p_lease_token::text || '/'
               || (extract(epoch from p_lease_expires_at) * 1000000)::bigint::text || '/'
               || p_reclaims::text, 'UTF8')),
           'hex')
$$;

ALTER FUNCTION agent.idempotency_version(p_lease_token uuid, p_lease_expires_at timestamp with time zone, p_reclaims integer) OWNER TO idempotency_owner;
