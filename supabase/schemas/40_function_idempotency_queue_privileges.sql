-- agent.idempotency_queue_privileges
--
-- The privileges the queue functions need on one queue and its dead-letter
-- queue, as GRANT statements for the queues' owner to run (private; on
-- Supabase the postgres role, in the SQL editor: select ... \gexec, or
-- copied into a migration). Never runs them itself. The plane's owner gets
-- no more than its functions use: pgmq's read, archive, send and set_vt; on
-- the queue's table what read (hide and count: select, update) and archive
-- (delete) do; on its archive the rows archive inserts and the ids it reads
-- back; on the dead-letter queue's table the letters send inserts and the
-- ids it reads back. Nothing on any other queue, and nothing to an API role.

CREATE FUNCTION agent.idempotency_queue_privileges(p_queue text, p_dead_letter_queue text) RETURNS SETOF text
    LANGUAGE plpgsql STABLE
    SET search_path TO ''
    AS $$
begin
  perform agent.idempotency_queue_check(p_queue, 'p_queue');
  perform agent.idempotency_queue_check(p_dead_letter_queue, 'p_dead_letter_queue');
  return next 'grant usage on schema pgmq to idempotency_owner';
  return query
    select pg_catalog.format('grant execute on function %s to idempotency_owner', p.oid::pg_catalog.regprocedure)
      from pg_catalog.pg_proc p
     where p.pronamespace = (select n.oid from pg_catalog.pg_namespace n where n.nspname = 'pgmq')
       and p.proname in ('read', 'archive', 'send', 'set_vt')
     order by p.proname, p.oid::pg_catalog.regprocedure::text;
  return next pg_catalog.format('grant select, update, delete on pgmq.%I to idempotency_owner', 'q_' || p_queue);
  return next pg_catalog.format('grant insert, select (msg_id) on pgmq.%I to idempotency_owner', 'a_' || p_queue);
  return next pg_catalog.format('grant insert, select (msg_id) on pgmq.%I to idempotency_owner',
                                'q_' || p_dead_letter_queue);
end
$$;

ALTER FUNCTION agent.idempotency_queue_privileges(p_queue text, p_dead_letter_queue text) OWNER TO idempotency_owner;
