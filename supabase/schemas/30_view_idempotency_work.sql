-- agent.idempotency_work
--
-- The row shape of agent.idempotency_redrive: a claim taken over for re-
-- drive, with its fresh lease token, its request and its attempt, and the
-- traceparent of the trace that first claimed it.

CREATE VIEW agent.idempotency_work WITH (security_invoker='true') AS
 SELECT k.id,
    k.organization_id,
    k.scope,
    k.key,
    k.request_hash,
    k.status,
    k.lease_token,
    k.request,
    (k.reclaims + 1) AS attempt,
    k.claimed_at,
    k.lease_expires_at,
    k.retain_until,
    k.response,
    NULL::integer AS taken,
    k.traceparent
   FROM agent.idempotency_keys k;

ALTER TABLE agent.idempotency_work OWNER TO idempotency_owner;
