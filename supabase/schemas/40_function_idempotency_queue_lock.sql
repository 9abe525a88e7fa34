-- agent.idempotency_queue_lock
--
-- Locks messages and claims in the one order every queue function takes them
-- (private): the messages by id first, then the claims in (organization,
-- scope, key) order, as a take locks them (pgmq's read, then the claims), so
-- no two queue calls wait for each other in a cycle.

CREATE FUNCTION agent.idempotency_queue_lock(p_queue text, p_msg_ids bigint[], p_organizations uuid[], p_claim_ids uuid[]) RETURNS void
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $_$
begin
  if pg_catalog.cardinality(p_msg_ids) > 0 then
    execute pg_catalog.format('select 1 from pgmq.%I q where q.msg_id = any ($1) order by q.msg_id for update',
                              'q_' || p_queue)
      using p_msg_ids;
  end if;
  perform 1
     from agent.idempotency_keys k
     join rows from (pg_catalog.unnest(p_organizations), pg_catalog.unnest(p_claim_ids)) c(organization_id, id)
       on k.organization_id = c.organization_id and k.id = c.id
    order by k.organization_id, k.scope, k.key
      for update of k;
end
$_$;

ALTER FUNCTION agent.idempotency_queue_lock(p_queue text, p_msg_ids bigint[], p_organizations uuid[], p_claim_ids uuid[]) OWNER TO idempotency_owner;
