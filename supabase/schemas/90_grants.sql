-- Who may do what, on the types, tables, view and functions (the schema's
-- own grants are in 01_schema.sql). Every function is private unless
-- granted here: the API role service_role calls the public surface. No API
-- role holds any privilege on a table; the functions that write are owned
-- by idempotency_owner and run as it (SECURITY DEFINER).

REVOKE ALL ON TABLE agent.idempotency_keys FROM PUBLIC, anon, authenticated, service_role;
REVOKE ALL ON TABLE agent.idempotency_scopes FROM PUBLIC, anon, authenticated, service_role;
REVOKE ALL ON TABLE agent.idempotency_replays FROM PUBLIC, anon, authenticated, service_role;
REVOKE ALL ON TABLE agent.idempotency_scheduled_calls FROM PUBLIC, anon, authenticated, service_role;
REVOKE ALL ON TABLE agent.idempotency_settings FROM PUBLIC, anon, authenticated, service_role;
REVOKE ALL ON TABLE agent.provider_jobs FROM PUBLIC, anon, authenticated, service_role;
REVOKE ALL ON TABLE agent.runs FROM PUBLIC, anon, authenticated, service_role;

GRANT USAGE ON SCHEMA agent TO service_role;
GRANT ALL ON SCHEMA agent TO idempotency_owner;

REVOKE ALL ON TYPE agent.idempotency_claim FROM PUBLIC;
GRANT ALL ON TYPE agent.idempotency_claim TO service_role;

REVOKE ALL ON TYPE agent.idempotency_claim_item FROM PUBLIC;
GRANT ALL ON TYPE agent.idempotency_claim_item TO service_role;

REVOKE ALL ON TYPE agent.idempotency_claim_outcome FROM PUBLIC;
GRANT ALL ON TYPE agent.idempotency_claim_outcome TO service_role;

REVOKE ALL ON TYPE agent.idempotency_completion_item FROM PUBLIC;
GRANT ALL ON TYPE agent.idempotency_completion_item TO service_role;

REVOKE ALL ON TYPE agent.idempotency_queue_ending FROM PUBLIC;

REVOKE ALL ON TYPE agent.idempotency_queue_extended FROM PUBLIC;
GRANT ALL ON TYPE agent.idempotency_queue_extended TO service_role;

REVOKE ALL ON TYPE agent.idempotency_queue_item FROM PUBLIC;
GRANT ALL ON TYPE agent.idempotency_queue_item TO service_role;

REVOKE ALL ON TYPE agent.idempotency_queue_settled FROM PUBLIC;
GRANT ALL ON TYPE agent.idempotency_queue_settled TO service_role;

REVOKE ALL ON TYPE agent.idempotency_release_item FROM PUBLIC;
GRANT ALL ON TYPE agent.idempotency_release_item TO service_role;

REVOKE ALL ON TYPE agent.run_admission FROM PUBLIC;
GRANT ALL ON TYPE agent.run_admission TO service_role;

GRANT SELECT ON TABLE agent.idempotency_rows TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_canonical_json(p_value jsonb) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_cap_probe(p_rows integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_cap_probe(p_rows integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_check_batch(p_items jsonb, p_row_cap integer) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_check_item(p_item jsonb, p_index integer) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_check_key(p_organization_id uuid, p_scope text, p_key text) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_check_traceparent(p_traceparent text, p_name text) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_check_work(p_scope text, p_request jsonb) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_claim(p_organization_id uuid, p_scope text, p_key text, p_request_hash text, p_lease_token uuid, p_lease_ms bigint, p_request jsonb, p_traceparent text) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_claim(p_organization_id uuid, p_scope text, p_key text, p_request_hash text, p_lease_token uuid, p_lease_ms bigint, p_request jsonb, p_traceparent text) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_claim_many(p_organization_id uuid, p_scope text, p_lease_ms bigint, p_items jsonb, p_row_cap integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_claim_many(p_organization_id uuid, p_scope text, p_lease_ms bigint, p_items jsonb, p_row_cap integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_claim_of(k agent.idempotency_keys) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_complete(p_claim_id uuid, p_lease_token uuid, p_resource_type text, p_resource_id text, p_response jsonb, p_organization_id uuid) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_complete(p_claim_id uuid, p_lease_token uuid, p_resource_type text, p_resource_id text, p_response jsonb, p_organization_id uuid) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_complete_many(p_organization_id uuid, p_items jsonb, p_row_cap integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_complete_many(p_organization_id uuid, p_items jsonb, p_row_cap integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_decide(p_organization_id uuid, p_scope text, p_key text, p_request_hash text, p_lease_token uuid, p_lease_ms bigint, p_retain_ms bigint, p_may_insert boolean, p_may_take_over boolean, p_request jsonb, p_traceparent text) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_delete_expired(p_ids uuid[]) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_delete_expired(p_ids uuid[]) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_expired(p_limit integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_expired(p_limit integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_extend(p_claim_id uuid, p_lease_token uuid, p_lease_ms bigint, p_organization_id uuid) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_extend(p_claim_id uuid, p_lease_token uuid, p_lease_ms bigint, p_organization_id uuid) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_failures(p_scope text, p_limit integer, p_organization_id uuid, p_since timestamp with time zone, p_row_cap integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_failures(p_scope text, p_limit integer, p_organization_id uuid, p_since timestamp with time zone, p_row_cap integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_failures_scope(p_scope text, p_limit integer, p_row_cap integer) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_get(p_organization_id uuid, p_scope text, p_key text) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_get(p_organization_id uuid, p_scope text, p_key text) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_item_text(p_item jsonb, p_index integer, p_field text, p_required boolean) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_item_uuid(p_item jsonb, p_index integer, p_field text) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_json_number(p_number numeric) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_json_size(p_value jsonb) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_orphans(p_limit integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_orphans(p_limit integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_policies(p_scope text) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_policies(p_scope text) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_policy(p_scope text, OUT retain interval, OUT max_response_bytes integer, OUT max_request_bytes integer, OUT max_attempts integer) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_private_functions() FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_queue_check(p_name text, p_argument text) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_queue_extend(p_queue text, p_lease_ms bigint, p_items jsonb, p_row_cap integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_queue_extend(p_queue text, p_lease_ms bigint, p_items jsonb, p_row_cap integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_queue_items(p_items jsonb, p_row_cap integer, p_endings boolean) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_queue_letter(p_queue text, p_dead_letter_queue text, p_msg_id bigint, p_read_ct integer, p_message jsonb, p_failure jsonb) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_queue_lock(p_queue text, p_msg_ids bigint[], p_organizations uuid[], p_claim_ids uuid[]) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_queue_privileges(p_queue text, p_dead_letter_queue text) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_queue_settle(p_queue text, p_dead_letter_queue text, p_items jsonb, p_row_cap integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_queue_settle(p_queue text, p_dead_letter_queue text, p_items jsonb, p_row_cap integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_queue_take(p_queue text, p_dead_letter_queue text, p_organization_id uuid, p_lease_ms bigint, p_lease_tokens uuid[], p_max_reads integer, p_scope text, p_organizations uuid[], p_row_cap integer, p_traceparent text) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_queue_take(p_queue text, p_dead_letter_queue text, p_organization_id uuid, p_lease_ms bigint, p_lease_tokens uuid[], p_max_reads integer, p_scope text, p_organizations uuid[], p_row_cap integer, p_traceparent text) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_reclaim(p_organization_id uuid, p_scope text, p_key text, p_request_hash text, p_lease_token uuid, p_lease_ms bigint, p_retain_ms bigint) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_reclaim(p_organization_id uuid, p_scope text, p_key text, p_request_hash text, p_lease_token uuid, p_lease_ms bigint, p_retain_ms bigint) TO service_role;

GRANT SELECT ON TABLE agent.idempotency_work TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_redrive(p_scope text, p_lease_tokens uuid[], p_lease_ms bigint, p_organization_id uuid, p_row_cap integer, p_max_bytes bigint) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_redrive(p_scope text, p_lease_tokens uuid[], p_lease_ms bigint, p_organization_id uuid, p_row_cap integer, p_max_bytes bigint) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_redrivable(p_claim_ids uuid[], p_scope text, p_organization_id uuid, p_since timestamp with time zone, p_row_cap integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_redrivable(p_claim_ids uuid[], p_scope text, p_organization_id uuid, p_since timestamp with time zone, p_row_cap integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_redrive_failed(p_scope text, p_limit integer, p_organization_id uuid, p_since timestamp with time zone, p_claim_ids uuid[], p_row_cap integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_redrive_failed(p_scope text, p_limit integer, p_organization_id uuid, p_since timestamp with time zone, p_claim_ids uuid[], p_row_cap integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_release(p_claim_id uuid, p_lease_token uuid, p_organization_id uuid) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_release(p_claim_id uuid, p_lease_token uuid, p_organization_id uuid) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_release_many(p_organization_id uuid, p_items jsonb, p_row_cap integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_release_many(p_organization_id uuid, p_items jsonb, p_row_cap integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_request_hash(p_value jsonb) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_request_hash(p_value jsonb) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_surface() FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_surface() TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_retire_expired(p_ids uuid[]) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_retire_expired(p_ids uuid[]) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_row_cap(p_row_cap integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_row_cap(p_row_cap integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_scheduled_call(p_job text, p_request_id bigint, p_answers jsonb) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_scheduled_call(p_job text, p_request_id bigint, p_answers jsonb) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_scheduled_pending(p_job text) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_scheduled_pending(p_job text) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_scheduled_failures(p_since timestamp with time zone, p_row_cap integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_scheduled_failures(p_since timestamp with time zone, p_row_cap integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_sweep(p_bound integer, p_row_cap integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_sweep(p_bound integer, p_row_cap integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_try_claim(p_organization_id uuid, p_scope text, p_key text, p_request_hash text, p_lease_token uuid, p_lease_ms bigint, p_retain_ms bigint) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_try_claim(p_organization_id uuid, p_scope text, p_key text, p_request_hash text, p_lease_token uuid, p_lease_ms bigint, p_retain_ms bigint) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_utf16_order(p_key text) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.provider_job_lookup(p_provider text, p_job_id text) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.provider_job_lookup(p_provider text, p_job_id text) TO service_role;

REVOKE ALL ON FUNCTION agent.provider_job_register(p_organization_id uuid, p_provider text, p_job_id text) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.provider_job_register(p_organization_id uuid, p_provider text, p_job_id text) TO service_role;

REVOKE ALL ON FUNCTION agent.run_admit(p_organization_id uuid, p_start_key text, p_input jsonb, p_admission_token uuid, p_claim_id uuid, p_lease_token uuid, p_max_run_duration_ms bigint) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.run_admit(p_organization_id uuid, p_start_key text, p_input jsonb, p_admission_token uuid, p_claim_id uuid, p_lease_token uuid, p_max_run_duration_ms bigint) TO service_role;

REVOKE ALL ON FUNCTION agent.run_get(p_organization_id uuid, p_start_key text, p_admission_token uuid) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.run_get(p_organization_id uuid, p_start_key text, p_admission_token uuid) TO service_role;

-- The console's reads and its one action (idem console).
REVOKE ALL ON TYPE agent.idempotency_activity_bucket FROM PUBLIC;
GRANT ALL ON TYPE agent.idempotency_activity_bucket TO service_role;

REVOKE ALL ON TYPE agent.idempotency_failure_count FROM PUBLIC;
GRANT ALL ON TYPE agent.idempotency_failure_count TO service_role;

REVOKE ALL ON TYPE agent.idempotency_in_flight_scope FROM PUBLIC;
GRANT ALL ON TYPE agent.idempotency_in_flight_scope TO service_role;

REVOKE ALL ON TYPE agent.idempotency_processing_claim FROM PUBLIC;
GRANT ALL ON TYPE agent.idempotency_processing_claim TO service_role;

REVOKE ALL ON TYPE agent.idempotency_sweep_backlog_day FROM PUBLIC;
GRANT ALL ON TYPE agent.idempotency_sweep_backlog_day TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_abandon(p_id uuid, p_version text) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_abandon(p_id uuid, p_version text) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_activity(p_since timestamp with time zone, p_bucket_s integer, p_limit integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_activity(p_since timestamp with time zone, p_bucket_s integer, p_limit integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_failure_counts(p_limit integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_failure_counts(p_limit integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_in_flight(p_limit integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_in_flight(p_limit integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_processing(p_scope text, p_limit integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_processing(p_scope text, p_limit integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_sweep_backlog(p_limit integer) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_sweep_backlog(p_limit integer) TO service_role;

REVOKE ALL ON FUNCTION agent.idempotency_count_replays(p_scope text, p_replays bigint) FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_trim_replays() FROM PUBLIC;

REVOKE ALL ON FUNCTION agent.idempotency_version(p_lease_token uuid, p_lease_expires_at timestamp with time zone, p_reclaims integer) FROM PUBLIC;
