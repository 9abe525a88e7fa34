-- Only the service role reaches the plane. The functions are SECURITY INVOKER,
-- so the service role holds the table privileges they use (and BYPASSRLS,
-- as on Supabase); anon and authenticated hold nothing at all.

revoke all on schema agent from public, anon, authenticated;
grant usage on schema agent to service_role;

revoke all on all tables in schema agent from public, anon, authenticated;
grant select, insert, update, delete on agent.idempotency_keys to service_role;
grant select, insert, update, delete on agent.runs to service_role;

revoke all on all functions in schema agent from public, anon, authenticated;
grant execute on function
  agent.idempotency_claim_of(agent.idempotency_keys),
  agent.idempotency_durations(bigint, bigint),
  agent.idempotency_try_claim(uuid, text, text, text, uuid, bigint, bigint),
  agent.idempotency_reclaim(uuid, text, text, text, uuid, bigint, bigint),
  agent.idempotency_get(uuid, text, text),
  agent.idempotency_complete(uuid, uuid, text, text, jsonb),
  agent.idempotency_release(uuid, uuid),
  agent.idempotency_expired(integer),
  agent.idempotency_delete_expired(uuid[]),
  agent.run_admit(uuid, text, jsonb)
to service_role;

revoke all on type agent.idempotency_claim, agent.run_admission from public;
grant usage on type agent.idempotency_claim, agent.run_admission to service_role;
