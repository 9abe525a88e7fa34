-- agent.idempotency_abandon
--
-- Ends a stuck claim as a journaled failure (public), for an operator: the
-- claim p_id, still processing and still at p_version (what
-- agent.idempotency_processing showed), is completed with the failure
-- abandoned_by_operator, its lease ended and its token replaced, so the
-- worker that held it is fenced: its heartbeat, completion or release
-- changes nothing. The work it carries is kept, so the failure can be sent
-- back after a fix (agent.idempotency_redrive_failed). Compare and set: a
-- claim taken over, extended, ended or released since it was shown is
-- left as it is, and no row is answered. Never deletes.

CREATE FUNCTION agent.idempotency_abandon(p_id uuid, p_version text) RETURNS SETOF agent.idempotency_failure
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $_$
declare
  v_at timestamptz := pg_catalog.clock_timestamp();
begin
  if p_id is null then
    raise exception 'p_id is required: the claim agent.idempotency_processing showed' using errcode = '22023';
  end if;
  if p_version is null or p_version !~ '^[0-9a-f]{64}$' then
    raise exception 'p_version must be the 64 hex digits agent.idempotency_processing showed, got %',
                    pg_catalog.left(p_version, 80)
      using errcode = '22023';
  end if;
  return query
    with ended as (
      update agent.idempotency_keys as k
         set status = 'completed',
             response = pg_catalog.jsonb_build_object(
                          'ok', false, 'error', 'abandoned_by_operator',
                          'output', pg_catalog.jsonb_build_object(
                                      'attempts', k.reclaims + 1,
                                      'claimed_at', k.claimed_at,
                                      'lease_expires_at', k.lease_expires_at)),
             resource_type = null,
             resource_id = null,
             lease_token = pg_catalog.gen_random_uuid(),
             lease_expires_at = least(k.lease_expires_at, v_at),
             retain_until = greatest(k.retain_until, v_at + (k.retain_until - k.lease_expires_at)),
             redrive_at = null
       where k.id = p_id
         and k.status = 'processing'
         and agent.idempotency_version(k.lease_token, k.lease_expires_at, k.reclaims) = p_version
      returning k.*
    )
    select f.id, f.organization_id, f.scope, f.key, f.status, f.response ->> 'error', f.response,
           f.resource_type, f.resource_id, f.reclaims + 1, f.claimed_at, f.retain_until,
           f.request is not null, coalesce(pg_catalog.jsonb_array_length(f.replaced), 0), 1,
           coalesce((f.replaced -> 0 ->> 'claimed_at')::timestamptz, f.claimed_at), f.traceparent
      from ended f;
end
$_$;

ALTER FUNCTION agent.idempotency_abandon(p_id uuid, p_version text) OWNER TO idempotency_owner;
