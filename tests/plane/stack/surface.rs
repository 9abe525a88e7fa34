//! The SQL surface as any PostgREST client sees it: names, shapes, privileges,
//! retry safety, Run admission, and bounded reads against the real server.

use std::sync::Arc;
use std::time::Duration;

use idempotency_plane::local::LocalStackConfig;
use idempotency_plane::postgrest::{ClientConfig, ClientError, PostgrestClient, Repeat};
use idempotency_plane::repo::{ClaimRequest, CompletionArgs};
use idempotency_plane::{IdempotencyRepository, PostgrestRepository};
use serde_json::{json, Value};

use crate::support::harness::*;

/// Every function of the README's SQL surface table, with its argument names in order.
const SURFACE: &[(&str, &str)] = &[
    (
        "idempotency_claim",
        "p_organization_id,p_scope,p_key,p_request_hash,p_lease_token,p_lease_ms,p_request,p_traceparent",
    ),
    ("idempotency_try_claim", "p_organization_id,p_scope,p_key,p_request_hash,p_lease_token,p_lease_ms,p_retain_ms"),
    ("idempotency_reclaim", "p_organization_id,p_scope,p_key,p_request_hash,p_lease_token,p_lease_ms,p_retain_ms"),
    ("idempotency_get", "p_organization_id,p_scope,p_key"),
    ("idempotency_complete", "p_claim_id,p_lease_token,p_resource_type,p_resource_id,p_response,p_organization_id"),
    ("idempotency_release", "p_claim_id,p_lease_token,p_organization_id"),
    ("idempotency_extend", "p_claim_id,p_lease_token,p_lease_ms,p_organization_id"),
    ("idempotency_redrive", "p_scope,p_lease_tokens,p_lease_ms,p_organization_id,p_row_cap,p_max_bytes"),
    ("idempotency_orphans", "p_limit"),
    ("idempotency_expired", "p_limit"),
    ("idempotency_delete_expired", "p_ids"),
    ("idempotency_retire_expired", "p_ids"),
    ("idempotency_sweep", "p_bound,p_row_cap"),
    (
        "run_admit",
        "p_organization_id,p_start_key,p_input,p_admission_token,p_claim_id,p_lease_token,p_max_run_duration_ms",
    ),
    ("run_get", "p_organization_id,p_start_key,p_admission_token"),
    ("provider_job_register", "p_organization_id,p_provider,p_job_id"),
    ("provider_job_lookup", "p_provider,p_job_id"),
    ("idempotency_cap_probe", "p_rows"),
    ("idempotency_row_cap", "p_row_cap"),
];

#[tokio::test]
async fn every_function_runs_as_the_planes_owner_with_an_empty_search_path_for_service_role_only() {
    let stack = stack().await;
    for (name, args) in SURFACE {
        let row: (String, bool, Option<Vec<String>>, bool, bool, bool, bool) = sqlx::query_as(
            "select array_to_string(p.proargnames, ','),
                    p.prosecdef and p.proowner = 'idempotency_owner'::regrole or p.proname = 'idempotency_surface',
                    p.proconfig,
                    has_function_privilege('service_role', p.oid, 'execute'),
                    has_function_privilege('anon', p.oid, 'execute'),
                    has_function_privilege('authenticated', p.oid, 'execute'),
                    p.proretset
               from pg_proc p join pg_namespace n on n.oid = p.pronamespace
              where n.nspname = 'agent' and p.proname = $1",
        )
        .bind(name)
        .fetch_one(stack.db())
        .await
        .unwrap_or_else(|e| panic!("agent.{name}: {e}"));
        let (names, definer, config, service, anon, authenticated, returns_set) = row;
        assert_eq!(&names, args, "agent.{name} arguments");
        // The surface report alone answers as its caller: it tells the
        // caller what the caller may execute.
        assert!(definer, "agent.{name} is SECURITY DEFINER, owned by idempotency_owner");
        // Every function that takes a row lock gives up after lock_timeout.
        let locks = matches!(
            *name,
            "idempotency_claim"
                | "idempotency_try_claim"
                | "idempotency_reclaim"
                | "idempotency_complete"
                | "idempotency_release"
                | "idempotency_extend"
                | "idempotency_redrive"
                | "idempotency_delete_expired"
                | "idempotency_retire_expired"
                | "idempotency_sweep"
                | "run_admit"
                | "provider_job_register"
        );
        let mut expected = vec!["search_path=\"\"".to_owned()];
        if locks {
            expected.push("lock_timeout=5s".to_owned());
        }
        assert_eq!(config, Some(expected), "agent.{name} pins search_path (and lock_timeout when it locks rows)");
        assert!(service && !anon && !authenticated, "agent.{name}: execute for service_role only");
        let scalar = matches!(
            *name,
            "idempotency_release" | "idempotency_extend" | "idempotency_delete_expired" | "idempotency_row_cap"
        );
        assert_eq!(returns_set, !scalar, "agent.{name} returns a set unless it is a scalar");
    }
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn every_table_has_rls_on_and_no_privileges_for_any_api_role() {
    let stack = stack().await;
    for table in ["agent.idempotency_keys", "agent.idempotency_scopes", "agent.runs", "agent.provider_jobs"] {
        let (rls, anon, authenticated, service): (bool, bool, bool, bool) = sqlx::query_as(
            "select c.relrowsecurity,
                    has_table_privilege('anon', c.oid, 'select,insert,update,delete,truncate,references,trigger'),
                    has_table_privilege('authenticated', c.oid, 'select,insert,update,delete,truncate,references,trigger'),
                    has_table_privilege('service_role', c.oid, 'select,insert,update,delete,truncate,references,trigger')
               from pg_class c where c.oid = $1::regclass",
        )
        .bind(table)
        .fetch_one(stack.db())
        .await
        .unwrap();
        assert!(rls, "{table} has row level security on");
        assert!(!anon && !authenticated && !service, "{table} grants nothing to anon, authenticated or service_role");
        let policies: i64 =
            sqlx::query_scalar("select count(*) from pg_policies where schemaname || '.' || tablename = $1")
                .bind(table)
                .fetch_one(stack.db())
                .await
                .unwrap();
        assert_eq!(policies, 0, "{table} has no policies");
    }
    stack.stop().await.unwrap();
}

fn client_as(stack: &idempotency_plane::local::LocalStack, token: &str) -> PostgrestClient {
    PostgrestClient::new(ClientConfig::new(stack.url(), token.to_owned()).unwrap()).unwrap()
}

#[tokio::test]
async fn anonymous_and_authenticated_callers_are_refused_over_http() {
    let stack = stack().await;
    let args = json!({"p_organization_id": org(), "p_scope": "tool.x", "p_key": "k"});
    // PostgREST answers 42501 with 401 for the anonymous role and 403 for any
    // other; postrust-server 3.1.0 answers 401 for both (observed here). The
    // code is what a caller matches on, and it is 42501 on both servers.
    for (role, statuses) in [("anon", &[401u16][..]), ("authenticated", &[401u16, 403][..])] {
        let client = client_as(&stack, &stack.token_for(role));
        let refused = client.rpc::<Value>("idempotency_get", &args, Repeat::Safe).await;
        match refused {
            Err(ClientError::Api { status, error, .. }) => {
                assert!(statuses.contains(&status), "{role}: status {status}");
                assert_eq!(error.code, "42501", "{role}");
            }
            other => panic!("{role}: expected 42501, got {other:?}"),
        }
    }
    let bad_signature = client_as(&stack, "eyJhbGciOiJIUzI1NiJ9.eyJyb2xlIjoic2VydmljZV9yb2xlIn0.bad");
    let refused = bad_signature.rpc::<Value>("idempotency_get", &args, Repeat::Safe).await;
    assert!(matches!(refused, Err(ClientError::Api { status: 401, .. })), "{refused:?}");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn an_empty_result_is_an_array_and_a_null_composite_is_never_answered() {
    let stack = stack().await;
    let client = PostgrestClient::new(stack.client_config().unwrap()).unwrap();
    let none: Value = client
        .rpc("idempotency_get", &json!({"p_organization_id": org(), "p_scope": "tool.x", "p_key": "k"}), Repeat::Safe)
        .await
        .unwrap();
    assert_eq!(none, json!([]));
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn every_claim_function_answers_every_record_column_and_lease_live() {
    let stack = stack().await;
    let client = PostgrestClient::new(stack.client_config().unwrap()).unwrap();
    let rows: Value = client
        .rpc(
            "idempotency_try_claim",
            &json!({
                "p_organization_id": org(), "p_scope": "tool.x", "p_key": "k",
                "p_request_hash": "a".repeat(64), "p_lease_token": uuid::Uuid::new_v4(),
                "p_lease_ms": 1000, "p_retain_ms": 5000
            }),
            Repeat::Safe,
        )
        .await
        .unwrap();
    let row = rows.as_array().and_then(|r| r.first()).and_then(Value::as_object).expect("one row");
    let mut columns: Vec<&str> = row.keys().map(String::as_str).collect();
    columns.sort_unstable();
    assert_eq!(
        columns,
        [
            "claimed_at",
            "id",
            "key",
            "lease_expires_at",
            "lease_live",
            "lease_token",
            "organization_id",
            "request_hash",
            "resource_id",
            "resource_type",
            "response",
            "retain_until",
            "scope",
            "status"
        ]
    );
    assert_eq!(row["status"], "processing");
    assert_eq!(row["lease_live"], true);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn the_database_refuses_malformed_rows_whoever_calls_it() {
    let stack = stack().await;
    let client = PostgrestClient::new(stack.client_config().unwrap()).unwrap();
    let base = json!({
        "p_organization_id": org(), "p_scope": "tool.x", "p_key": "k",
        "p_request_hash": "a".repeat(64), "p_lease_token": uuid::Uuid::new_v4(),
        "p_lease_ms": 1000, "p_retain_ms": 5000
    });
    let with = |field: &str, value: Value| {
        let mut args = base.clone();
        args[field] = value;
        args
    };
    for (args, code) in [
        (with("p_request_hash", json!("A".repeat(64))), "22023"),
        (with("p_request_hash", json!("abc")), "22023"),
        (with("p_key", json!("")), "22023"),
        (with("p_key", json!("k".repeat(513))), "22023"),
        (with("p_scope", json!("")), "22023"),
        (with("p_scope", json!("Tool.X")), "22023"),
        (with("p_scope", json!("payments.charge")), "IDEM1"),
        (with("p_lease_ms", json!(0)), "22023"),
        (with("p_lease_ms", json!(-5)), "22023"),
        (with("p_retain_ms", json!(0)), "22023"),
    ] {
        let refused = client.rpc::<Value>("idempotency_try_claim", &args, Repeat::Safe).await;
        match refused {
            Err(ClientError::Api { status: 400, error, .. }) => assert_eq!(error.code, code, "{args}"),
            other => panic!("{args}: expected 400 {code}, got {other:?}"),
        }
    }
    assert_eq!(count_rows(&stack).await, 0);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn claim_and_complete_are_safe_to_repeat_after_a_lost_response() {
    let stack = stack().await;
    let repo = PostgrestRepository::new(PostgrestClient::new(stack.client_config().unwrap()).unwrap());
    let org = org();
    let hash = hash("lost response");
    let request = ClaimRequest {
        organization_id: org,
        scope: "tool.email.send",
        key: "k",
        request_hash: hash.as_str(),
        lease_token: uuid::Uuid::new_v4(),
        lease: Duration::from_secs(30),
        retain: Duration::from_secs(3600),
    };
    let first = repo.try_claim(&request).await.unwrap().expect("claimed");
    // The same call again, as a retry after its answer was lost, answers the same claim.
    let repeat = repo.try_claim(&request).await.unwrap().expect("our own claim");
    assert_eq!(repeat.id, first.id);
    assert_eq!(repeat.lease_token, first.lease_token);
    // A different token is a real conflict.
    let other = ClaimRequest { lease_token: uuid::Uuid::new_v4(), ..request };
    assert!(repo.try_claim(&other).await.unwrap().is_none());

    let response = json!({"id": 1});
    let args = CompletionArgs { response: Some(&response), ..CompletionArgs::default() };
    assert_eq!(first.lease_token, Some(request.lease_token), "the claimant's answer carries its token");
    let token = request.lease_token;
    let done = repo.complete(first.organization_id, first.id, token, args).await.unwrap().expect("completed");
    let again = repo.complete(first.organization_id, first.id, token, args).await.unwrap().expect("still ours");
    assert_eq!(done, again);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn run_admission_admits_once_per_start_key_and_never_touches_the_claim_table() {
    let stack = stack().await;
    let client = Arc::new(PostgrestClient::new(stack.client_config().unwrap()).unwrap());
    let org = org();
    let admits = (0..20).map(|i| {
        let client = client.clone();
        tokio::spawn(async move {
            let args = json!({"p_organization_id": org, "p_start_key": "start:abc", "p_input": {"attempt": i}});
            client.rpc::<Vec<Value>>("run_admit", &args, Repeat::Safe).await
        })
    });
    let rows: Vec<Value> = futures::future::join_all(admits)
        .await
        .into_iter()
        .map(|joined| {
            let mut rows = joined.expect("task").expect("run_admit");
            assert_eq!(rows.len(), 1, "one row per call");
            rows.remove(0)
        })
        .collect();
    let admitted: Vec<&Value> = rows.iter().filter(|r| r["admitted"] == true).collect();
    assert_eq!(admitted.len(), 1, "{rows:?}");
    let id = &admitted[0]["id"];
    assert!(rows.iter().all(|r| &r["id"] == id), "every replay answers the admitted Run");
    assert!(rows.iter().all(|r| r["input"] == admitted[0]["input"]), "with the input it was admitted with");
    let runs: i64 = sqlx::query_scalar("select count(*) from agent.runs").fetch_one(stack.db()).await.unwrap();
    assert_eq!(runs, 1);
    assert_eq!(count_rows(&stack).await, 0, "Run admission writes no row in the idempotency table");
    stack.stop().await.unwrap();
}

#[derive(Debug, serde::Deserialize)]
struct Expired {
    id: uuid::Uuid,
}

#[tokio::test]
async fn a_bounded_read_reads_whole_pages_under_the_servers_cap() {
    let stack = stack_with(LocalStackConfig::default().with_max_rows(5)).await;
    expired_rows(&stack, 8).await;
    let client = PostgrestClient::new(stack.client_config().unwrap()).unwrap();
    let rows: Vec<Expired> = client
        .rpc_bounded("idempotency_expired", &json!({"p_limit": 5}), 5, Some("id,retain_until"), Repeat::Safe)
        .await
        .unwrap();
    assert_eq!(rows.len(), 5);
    let ids: Vec<uuid::Uuid> = rows.iter().map(|r| r.id).collect();
    let deleted: i64 = client.rpc("idempotency_delete_expired", &json!({"p_ids": ids}), Repeat::Safe).await.unwrap();
    assert_eq!(deleted, 5);
    // A bound above the cap is refused before any request.
    let refused =
        client.rpc_bounded::<Expired>("idempotency_expired", &json!({"p_limit": 6}), 6, None, Repeat::Safe).await;
    assert!(matches!(refused, Err(ClientError::BoundAboveCap { bound: 6, cap: 5 })), "{refused:?}");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_server_whose_real_cap_is_lower_than_configured_is_detected_as_truncation() {
    // The server caps at 3; the client, and the plane, were told 10.
    let stack = stack_with(LocalStackConfig::default().with_max_rows(3)).await;
    set_plane_row_cap(&stack, 10).await;
    expired_rows(&stack, 8).await;
    let config = stack.client_config().unwrap().with_max_rows(10).unwrap();
    let client = PostgrestClient::new(config).unwrap();
    let read = client
        .rpc_bounded::<Expired>(
            "idempotency_expired",
            &json!({"p_limit": 10}),
            10,
            Some("id,retain_until"),
            Repeat::Safe,
        )
        .await;
    match read {
        Err(ClientError::Truncated { received: 3, total: 8, .. }) => {}
        other => panic!("expected Truncated {{ received: 3, total: 8 }}, got {:?}", other.map(|r| r.len())),
    }
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn explicit_json_nulls_count_as_absent_whichever_way_the_server_binds_them() {
    let stack = stack().await;
    let client = PostgrestClient::new(stack.client_config().unwrap()).unwrap();
    let claim = |key: &'static str| {
        json!({
            "p_organization_id": "00000000-0000-0000-0000-0000000000aa", "p_scope": "tool.x", "p_key": key,
            "p_request_hash": "b".repeat(64), "p_lease_token": "00000000-0000-0000-0000-0000000000bb",
            "p_lease_ms": 60000, "p_retain_ms": 60000
        })
    };
    let rows: Vec<Value> = client.rpc("idempotency_try_claim", &claim("k"), Repeat::Safe).await.unwrap();
    let id = rows[0]["id"].clone();
    let token = rows[0]["lease_token"].clone();

    // A non-Rust caller that sends nulls instead of omitting them: refused,
    // whether the server binds null as SQL NULL (PostgREST) or as '' and
    // 'null'::jsonb (postrust-server).
    let all_null = json!({"p_claim_id": id, "p_lease_token": token,
                          "p_resource_type": null, "p_resource_id": null, "p_response": null});
    match client.rpc::<Value>("idempotency_complete", &all_null, Repeat::Safe).await {
        Err(ClientError::Api { status: 400, error, .. }) => assert_eq!(error.code, "22023"),
        other => panic!("expected 400 22023, got {other:?}"),
    }
    // Nulls beside a real response: accepted, and stored as absent.
    let with_response = json!({"p_claim_id": id, "p_lease_token": token,
                               "p_resource_type": null, "p_resource_id": null, "p_response": {"ok": true}});
    let rows: Vec<Value> = client.rpc("idempotency_complete", &with_response, Repeat::Safe).await.unwrap();
    assert_eq!(rows[0]["status"], "completed");
    assert_eq!(rows[0]["resource_type"], Value::Null);
    assert_eq!(rows[0]["resource_id"], Value::Null);
    assert_eq!(rows[0]["response"], json!({"ok": true}));
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_repeat_answers_only_a_live_lease_or_the_same_completion() {
    let stack = stack().await;
    let repo = PostgrestRepository::new(PostgrestClient::new(stack.client_config().unwrap()).unwrap());
    let org = org();
    let hash = hash("repeats");
    let request = ClaimRequest {
        organization_id: org,
        scope: "tool.email.send",
        key: "k",
        request_hash: hash.as_str(),
        lease_token: uuid::Uuid::new_v4(),
        lease: Duration::from_secs(30),
        retain: Duration::from_secs(3600),
    };
    let first = repo.try_claim(&request).await.unwrap().expect("claimed");

    // Past its lease, a repeated try_claim is no longer an owner's answer.
    pass_lease(&stack, first.id).await;
    assert!(repo.try_claim(&request).await.unwrap().is_none());

    // A reclaim, then its repeat after a lost response: the same live claim.
    let reclaim = ClaimRequest { lease_token: uuid::Uuid::new_v4(), ..request };
    let reclaimed = repo.reclaim(&reclaim).await.unwrap().expect("reclaimed");
    let repeated = repo.reclaim(&reclaim).await.unwrap().expect("our own reclaim");
    assert_eq!((reclaimed.lease_token, repeated.lease_token), (Some(reclaim.lease_token), Some(reclaim.lease_token)));
    assert_eq!(repeated.lease_expires_at, reclaimed.lease_expires_at, "a repeat does not extend the lease");

    // A completion repeated with the same answer answers the row; with a
    // different answer it answers nothing: the ending already happened.
    let answer = json!({"id": 1});
    let same = CompletionArgs { response: Some(&answer), ..CompletionArgs::default() };
    assert!(repo.complete(reclaimed.organization_id, reclaimed.id, reclaim.lease_token, same).await.unwrap().is_some());
    assert!(repo.complete(reclaimed.organization_id, reclaimed.id, reclaim.lease_token, same).await.unwrap().is_some());
    let other = json!({"id": 2});
    let different = CompletionArgs { response: Some(&other), ..CompletionArgs::default() };
    assert!(repo
        .complete(reclaimed.organization_id, reclaimed.id, reclaim.lease_token, different)
        .await
        .unwrap()
        .is_none());
    let stored: Value = sqlx::query_scalar("select response from agent.idempotency_keys where id = $1")
        .bind(reclaimed.id)
        .fetch_one(stack.db())
        .await
        .unwrap();
    assert_eq!(stored, answer);

    // Release reports what happened: true once, then false.
    let other_key = ClaimRequest { key: "k2", lease_token: uuid::Uuid::new_v4(), ..request };
    let claim = repo.try_claim(&other_key).await.unwrap().expect("claimed");
    assert!(repo.release(claim.organization_id, claim.id, other_key.lease_token).await.unwrap());
    assert!(!repo.release(claim.organization_id, claim.id, other_key.lease_token).await.unwrap());
    stack.stop().await.unwrap();
}

/// The one-call claim's answer, through a bare client (as curl or
/// postgrest-js would call it).
async fn one_call(client: &PostgrestClient, org: uuid::Uuid, key: &str, hash: &str, token: uuid::Uuid) -> Value {
    let args = json!({
        "p_organization_id": org, "p_scope": "tool.email.send", "p_key": key,
        "p_request_hash": hash, "p_lease_token": token, "p_lease_ms": 60_000,
    });
    let mut rows: Vec<Value> = client.rpc("idempotency_claim", &args, Repeat::Safe).await.expect("idempotency_claim");
    assert_eq!(rows.len(), 1, "always exactly one row: {rows:?}");
    rows.remove(0)
}

#[tokio::test]
async fn the_one_call_claim_shows_the_token_only_to_its_holder_and_the_answer_only_once_completed() {
    let stack = stack().await;
    let client = client(&stack);
    let (org, h, token) = (org(), hash("v2"), uuid::Uuid::new_v4());

    let claimed = one_call(&client, org, "k", h.as_str(), token).await;
    assert_eq!(
        (claimed["outcome"].as_str(), claimed["lease_token"].as_str()),
        (Some("claimed"), Some(&*token.to_string()))
    );
    let again = one_call(&client, org, "k", h.as_str(), token).await;
    assert_eq!((again["outcome"].as_str(), &again["id"]), (Some("claimed"), &claimed["id"]), "a repeat is ours");

    let processing = one_call(&client, org, "k", h.as_str(), uuid::Uuid::new_v4()).await;
    assert_eq!(processing["outcome"], "processing");
    assert_eq!((&processing["lease_token"], &processing["response"]), (&Value::Null, &Value::Null));

    let args = json!({"p_claim_id": claimed["id"], "p_lease_token": token, "p_response": {"sent": 1},
                      "p_resource_type": "email.message", "p_resource_id": "m-1"});
    let _: Vec<Value> = client.rpc("idempotency_complete", &args, Repeat::Safe).await.expect("complete");
    let completed = one_call(&client, org, "k", h.as_str(), uuid::Uuid::new_v4()).await;
    assert_eq!((completed["outcome"].as_str(), &completed["response"]), (Some("completed"), &json!({"sent": 1})));
    assert_eq!((&completed["resource_id"], &completed["lease_token"]), (&json!("m-1"), &Value::Null));

    let conflict = one_call(&client, org, "k", hash("other").as_str(), uuid::Uuid::new_v4()).await;
    assert_eq!(conflict["outcome"], "conflict");
    for hidden in ["lease_token", "response", "resource_type", "resource_id", "request_hash"] {
        assert_eq!(conflict[hidden], Value::Null, "a conflict discloses no {hidden}");
    }
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_tool_policy_under_thirty_days_is_refused_by_the_database() {
    let stack = stack().await;
    for (scope, retain) in [("tool.*", "29 days"), ("tool.crm.*", "1 day"), ("tool.email.send", "12 hours")] {
        let refused = sqlx::query("insert into agent.idempotency_scopes values ($1, $2::interval, 65536)")
            .bind(scope)
            .bind(retain)
            .execute(stack.db())
            .await;
        let code = refused.expect_err(scope).as_database_error().and_then(|e| e.code().map(|c| c.into_owned()));
        assert_eq!(code.as_deref(), Some("23514"), "{scope} {retain}");
    }
    let updated = sqlx::query("update agent.idempotency_scopes set retain = interval '1 day' where scope = 'tool.*'")
        .execute(stack.db())
        .await;
    assert!(updated.is_err(), "the seeded tool policy cannot be shortened either");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_response_above_the_scopes_limit_is_refused_by_the_database_and_journaled_by_reference_to_its_resource() {
    // A scope whose policy keeps 2 KiB, below the service's own 64 KiB limit:
    // only the database knows it.
    let stack = stack().await;
    sqlx::query("insert into agent.idempotency_scopes values ('webhook.small', interval '1 day', 2048)")
        .execute(stack.db())
        .await
        .unwrap();
    let service = service(&stack);
    let big = json!({"text": "x".repeat(10_000)});

    let claim = claimed(service.claim(org(), "webhook.small", "d-1", &hash("big"), LEASE).await);
    let refused = service.complete(&claim, idempotency_plane::Completion::response(big.clone())).await;
    match &refused {
        Err(error @ idempotency_plane::Error::Store(ClientError::Api { status: 400, error: body, .. })) => {
            assert_eq!(body.code, idempotency_plane::postgrest::codes::RESPONSE_TOO_LARGE);
            assert!(error.is_unstorable_answer(), "the caller's data, not the plane's availability");
        }
        other => panic!("expected a 400 IDEM2, got {other:?}"),
    }
    // After an effect the driver journals it anyway: the output by reference
    // to the effect's resource, which is kept, and the envelope whole.
    use idempotency_plane::service::{Answer, Begun, Effect, EffectDriver, Settle, Settled, Timing};
    let driver = EffectDriver::new(service);
    let timing = Timing::new(Duration::from_secs(5), Duration::from_secs(5), Duration::from_secs(1)).unwrap();
    let (org, request) = (org(), hash("big effect"));
    let effect = Effect {
        organization_id: org,
        scope: "webhook.small",
        key: "d-2",
        request_hash: &request,
        timing,
        request: None,
    };
    let Ok(Begun::Held(held)) = driver.begin(&effect).await else { panic!("claimed") };
    let resource = idempotency_plane::ResourceRef { resource_type: "blob".into(), resource_id: "b-1".into() };
    let answer = Answer::failure("partial", big.clone()).with_resource(Some(resource.clone()));
    let settled = held.settle(Settle::Journal(answer)).await;
    assert!(matches!(settled, Settled::Journaled { stand_in: Some(_), .. }), "{settled:?}");
    let stored: (Value, Option<String>, Option<String>) =
        sqlx::query_as("select response, resource_type, resource_id from agent.idempotency_keys where key = 'd-2'")
            .fetch_one(stack.db())
            .await
            .unwrap();
    assert_eq!((stored.1.as_deref(), stored.2.as_deref()), (Some("blob"), Some("b-1")), "the resource is kept");
    assert_eq!((&stored.0["ok"], &stored.0["error"]), (&json!(false), &json!("partial")), "still a failure");
    assert_eq!(stored.0["output"]["$response_ref"]["resource_id"], "b-1", "{}", stored.0);
    let Ok(Begun::Replayed(replayed)) = driver.begin(&effect).await else { panic!("replayed") };
    assert_eq!((replayed.ok, replayed.resource), (false, Some(resource)));
    stack.stop().await.unwrap();
}
