-- agent.idempotency_private_functions
--
-- The event trigger's function (80_event_trigger.sql): revokes EXECUTE from
-- PUBLIC, anon and authenticated on every function created in, or moved into,
-- schema agent. It runs as the role that ran the command, which owns the new
-- function or is a superuser, so it may revoke.

CREATE FUNCTION agent.idempotency_private_functions() RETURNS event_trigger
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $$
declare
  v_routine regprocedure;
begin
  for v_routine in
    select c.objid
      from pg_catalog.pg_event_trigger_ddl_commands() c
     where c.classid = 'pg_catalog.pg_proc'::regclass
       and c.schema_name = 'agent'
  loop
    execute format('revoke execute on routine %s from public, anon, authenticated', v_routine);
  end loop;
end
$$;
