//! The hot statements use their indexes, so a later change cannot silently
//! lose one. The statements are the ones inside the plane's functions
//! (EXPLAIN cannot see into PL/pgSQL), run against a table large enough
//! that the planner has a choice. On the partitioned layout (`IDEM_LAYOUT`)
//! an index is a partition's copy of the table's, and a statement that
//! names the organization must touch exactly one partition.

use serde_json::Value;
use sqlx::Executor;

use crate::support::harness::*;

/// Every index name anywhere in an EXPLAIN (FORMAT JSON) plan.
fn index_names(plan: &Value, names: &mut Vec<String>) {
    match plan {
        Value::Object(node) => {
            if let Some(Value::String(name)) = node.get("Index Name") {
                names.push(name.clone());
            }
            node.values().for_each(|v| index_names(v, names));
        }
        Value::Array(items) => items.iter().for_each(|v| index_names(v, names)),
        _ => {}
    }
}

#[tokio::test]
async fn the_hot_statements_use_index_scans() {
    let stack = stack().await;
    // 50,000 claims of 50 tenants (1,000 each, so naming the organization
    // alone narrows little), most still retained, a few expired.
    stack
        .db()
        .execute(
            "insert into agent.idempotency_keys
               (organization_id, scope, key, request_hash, status, lease_token, response,
                claimed_at, lease_expires_at, retain_until)
             select ('00000000-0000-0000-0000-' || lpad((i % 50)::text, 12, '0'))::uuid,
                    'tool.email.send', 'k' || i, repeat('a', 64), 'completed', gen_random_uuid(), '1',
                    now() - interval '31 days', now() - interval '31 days',
                    case when i % 100 = 0 then now() - interval '1 day' else now() + interval '30 days' end
               from generate_series(1, 50000) i;
             insert into agent.runs (organization_id, start_key, input)
             select gen_random_uuid(), 'start-' || i, '{}' from generate_series(1, 20000) i;
             insert into agent.provider_jobs (organization_id, provider, job_id)
             select gen_random_uuid(), 'transcribe', 'job-' || i from generate_series(1, 20000) i;
             analyze agent.idempotency_keys; analyze agent.runs; analyze agent.provider_jobs;",
        )
        .await
        .unwrap();
    let (org, id, token): (uuid::Uuid, uuid::Uuid, uuid::Uuid) =
        sqlx::query_as("select organization_id, id, lease_token from agent.idempotency_keys where key = 'k777'")
            .fetch_one(stack.db())
            .await
            .unwrap();

    let statements = [
        (
            "get / reclaim / try_claim's repeat: the claim by its key",
            format!(
                "select * from agent.idempotency_keys where organization_id = '{org}' and scope = 'tool.email.send' and key = 'k777'"
            ),
            "idempotency_keys_org_scope_key_key",
        ),
        (
            "complete / release: the claim by organization, id and fence",
            format!(
                "update agent.idempotency_keys set status = status
                  where organization_id = '{org}' and id = '{id}' and lease_token = '{token}'"
            ),
            "idempotency_keys_pkey",
        ),
        (
            "complete / release from a client that names no organization: the claim by id",
            format!("select organization_id from agent.idempotency_keys where id = '{id}'"),
            "idempotency_keys_pkey",
        ),
        (
            "the sweeper's read: oldest expired first",
            "select * from agent.idempotency_keys where retain_until < now() order by retain_until, id limit 1000".to_owned(),
            "idempotency_keys_retain_until_idx",
        ),
        (
            "the sweeper's delete: by id, still expired",
            format!("delete from agent.idempotency_keys where id = any(array['{id}']::uuid[]) and retain_until < now()"),
            "idempotency_keys_pkey",
        ),
        (
            "run_admit's replay: the Run by its start key",
            "select * from agent.runs where organization_id = '00000000-0000-0000-0000-000000000007' and start_key = 'start-7'".to_owned(),
            "runs_org_start_key_key",
        ),
        (
            "provider_job_lookup: the job by provider and id",
            "select * from agent.provider_jobs where provider = 'transcribe' and job_id = 'job-7'".to_owned(),
            "provider_jobs_provider_job_id_key",
        ),
    ];
    for (what, statement, index) in statements {
        let plan: Value = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("explain (format json) {statement}")))
            .fetch_one(stack.db())
            .await
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let mut names = Vec::new();
        index_names(&plan, &mut names);
        // The index itself, or on a partitioned table its partitions' copies.
        let copies: Vec<String> = sqlx::query_scalar(
            "select c.relname::text from pg_inherits i join pg_class c on c.oid = i.inhrelid
              where i.inhparent = to_regclass('agent.' || $1)",
        )
        .bind(index)
        .fetch_all(stack.db())
        .await
        .unwrap();
        let is_the_index = |name: &String| name == index || copies.contains(name);
        assert!(names.iter().any(is_the_index), "{what}: expected {index}, plan uses {names:?}\n{plan:#}");
        if !copies.is_empty() && statement.contains("organization_id = '") {
            assert_eq!(names.len(), 1, "{what}: names the organization, so one partition; plan uses {names:?}");
        }
    }
    stack.stop().await.unwrap();
}
