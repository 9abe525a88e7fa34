-- Functions created in schema agent later, by anyone, are not executable by
-- PUBLIC, anon or authenticated: this event trigger revokes EXECUTE from
-- them on every function, procedure or aggregate created in, moved into,
-- altered in or replaced in the schema (the function it runs is
-- agent.idempotency_private_functions). A grant to those roles therefore
-- lasts only until the function is next altered or replaced.
--
-- Creating an event trigger takes a superuser, or Supabase's postgres
-- (supautils). Elsewhere the schema applies without it, and says so: the
-- missing USAGE on schema agent still keeps anon and authenticated out.
-- On Supabase, supautils runs user event triggers for every role except
-- superusers: a function a superuser creates in agent is not covered, and
-- `idem doctor` reports such a function when PUBLIC may execute it.

do $trigger$
begin
  create event trigger idempotency_private_functions on ddl_command_end
    when tag in ('CREATE FUNCTION', 'CREATE PROCEDURE', 'CREATE AGGREGATE',
                 'ALTER FUNCTION', 'ALTER PROCEDURE', 'ALTER ROUTINE', 'ALTER AGGREGATE')
    execute function agent.idempotency_private_functions();
exception when insufficient_privilege then
  raise warning 'idempotency plane: % may not create event triggers; functions created later in schema agent '
                'stay executable by PUBLIC until revoked (anon and authenticated still lack USAGE on the schema)',
                current_user;
end
$trigger$;
