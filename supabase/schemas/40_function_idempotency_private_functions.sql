-- agent.idempotency_private_functions
--
-- The event trigger's function (80_event_trigger.sql), private: revokes
-- EXECUTE from PUBLIC, anon and authenticated on every function created in,
-- or moved into, schema agent, and on every function there that is altered or
-- replaced, so a grant to those roles does not survive a later CREATE OR
-- REPLACE. It runs as the role that ran the command, which owns the function
-- or is a superuser, so it may revoke. Owned by the role that applies the
-- schema.

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
