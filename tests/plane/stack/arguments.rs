//! Every function refuses a NULL or malformed required argument with 22023,
//! naming it, on every path; a response no client could read back is
//! refused before the row is locked.
//!
//! PostgREST binds a JSON `null` argument to SQL `NULL`, and the embedded
//! server turns it into `''`. So the NULL cases call the functions with SQL
//! NULL over a direct connection, as the API role PostgREST would switch
//! to. The malformed cases go through the embedded server as well.

use idempotency_plane::postgrest::{codes, ClientError, Repeat};
use idempotency_plane::repo::{CompletionArgs, IdempotencyRepository};
use idempotency_plane::service::{MAX_POLICY_RESPONSE_BYTES, MAX_RESPONSE_DEPTH};
use idempotency_plane::{ClaimOutcome, Completion, Ending, PostgrestRepository};
use serde_json::{json, Value};
use sqlx::{AssertSqlSafe, PgConnection};
use uuid::Uuid;

use crate::support::harness::*;

/// A function as SQL, each argument bound as text and cast to its type:
/// `(name, a good value, required)`.
struct Call {
    sql: &'static str,
    arguments: Vec<(&'static str, String, bool)>,
}

const CLAIM_ID: &str = "00000000-0000-0000-0000-0000000000c1";
const TOKEN: &str = "00000000-0000-0000-0000-0000000000f1";
const ORG: &str = "00000000-0000-0000-0000-0000000000a1";

fn surface() -> Vec<Call> {
    let hash = "a".repeat(64);
    let claim = |extra: Option<&'static str>| {
        let mut arguments = vec![
            ("p_organization_id", ORG.to_owned(), true),
            ("p_scope", "tool.x".to_owned(), true),
            ("p_key", "k-new".to_owned(), true),
            ("p_request_hash", hash.clone(), true),
            ("p_lease_token", Uuid::new_v4().to_string(), true),
            ("p_lease_ms", "60000".to_owned(), true),
        ];
        if let Some(name) = extra {
            arguments.push((name, "3600000".to_owned(), true));
        }
        arguments
    };
    vec![
        Call {
            sql: "select * from agent.idempotency_claim($1::uuid, $2, $3, $4, $5::uuid, $6::bigint, $7::jsonb, $8)",
            arguments: {
                let mut arguments = claim(None);
                arguments.push(("p_request", r#"{"event": "e-1"}"#.to_owned(), false));
                arguments.push((
                    "p_traceparent",
                    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned(),
                    false,
                ));
                arguments
            },
        },
        Call {
            sql: "select * from agent.idempotency_try_claim($1::uuid, $2, $3, $4, $5::uuid, $6::bigint, $7::bigint)",
            arguments: claim(Some("p_retain_ms")),
        },
        Call {
            sql: "select * from agent.idempotency_reclaim($1::uuid, $2, $3, $4, $5::uuid, $6::bigint, $7::bigint)",
            arguments: claim(Some("p_retain_ms")),
        },
        Call {
            sql: "select * from agent.idempotency_get($1::uuid, $2, $3)",
            arguments: vec![
                ("p_organization_id", ORG.to_owned(), true),
                ("p_scope", "tool.x".to_owned(), true),
                ("p_key", "k".to_owned(), true),
            ],
        },
        Call {
            sql: "select * from agent.idempotency_complete($1::uuid, $2::uuid, $3, $4, $5::jsonb)",
            arguments: vec![
                ("p_claim_id", CLAIM_ID.to_owned(), true),
                ("p_lease_token", TOKEN.to_owned(), true),
                ("p_resource_type", "email.message".to_owned(), false),
                ("p_resource_id", "m-1".to_owned(), false),
                ("p_response", r#"{"ok": true}"#.to_owned(), false),
            ],
        },
        Call {
            sql: "select agent.idempotency_release($1::uuid, $2::uuid)",
            arguments: vec![("p_claim_id", CLAIM_ID.to_owned(), true), ("p_lease_token", TOKEN.to_owned(), true)],
        },
        Call {
            sql: "select agent.idempotency_extend($1::uuid, $2::uuid, $3::bigint, $4::uuid)",
            arguments: vec![
                ("p_claim_id", CLAIM_ID.to_owned(), true),
                ("p_lease_token", TOKEN.to_owned(), true),
                ("p_lease_ms", "60000".to_owned(), true),
                ("p_organization_id", ORG.to_owned(), false),
            ],
        },
        Call {
            sql:
                "select * from agent.idempotency_redrive($1, $2::uuid[], $3::bigint, $4::uuid, $5::integer, $6::bigint)",
            arguments: vec![
                ("p_scope", "webhook.*".to_owned(), true),
                ("p_lease_tokens", format!("{{{TOKEN}}}"), true),
                ("p_lease_ms", "60000".to_owned(), true),
                ("p_organization_id", ORG.to_owned(), false),
                ("p_row_cap", "1000".to_owned(), false),
                ("p_max_bytes", "8388608".to_owned(), false),
            ],
        },
        Call {
            sql: "select * from agent.idempotency_failures($1, $2::integer, $3::uuid, $4::timestamptz, $5::integer)",
            arguments: vec![
                ("p_scope", "webhook.*".to_owned(), true),
                ("p_limit", "10".to_owned(), true),
                ("p_organization_id", ORG.to_owned(), false),
                ("p_since", "2026-01-01T00:00:00Z".to_owned(), false),
                ("p_row_cap", "1000".to_owned(), false),
            ],
        },
        Call {
            sql: "select * from agent.idempotency_redrive_failed($1, $2::integer, $3::uuid, $4::timestamptz, \
                  $5::uuid[], $6::integer)",
            arguments: vec![
                ("p_scope", "webhook.*".to_owned(), true),
                ("p_limit", "10".to_owned(), true),
                ("p_organization_id", ORG.to_owned(), false),
                // One of the two is required (both NULL is refused naming both).
                ("p_since", "2026-01-01T00:00:00Z".to_owned(), false),
                ("p_claim_ids", format!("{{{CLAIM_ID}}}"), false),
                ("p_row_cap", "1000".to_owned(), false),
            ],
        },
        Call {
            sql: "select * from agent.idempotency_redrivable($1::uuid[], $2, $3::uuid, $4::timestamptz, $5::integer)",
            arguments: vec![
                ("p_claim_ids", format!("{{{CLAIM_ID}}}"), true),
                ("p_scope", "webhook.*".to_owned(), false),
                ("p_organization_id", ORG.to_owned(), false),
                ("p_since", "2026-01-01T00:00:00Z".to_owned(), false),
                ("p_row_cap", "1000".to_owned(), false),
            ],
        },
        Call {
            sql: "select * from agent.idempotency_scheduled_call($1, $2::bigint, $3::jsonb)",
            arguments: vec![
                ("p_job", "idempotency-redrive-webhooks".to_owned(), true),
                ("p_request_id", "41".to_owned(), true),
                ("p_answers", json!([{"request_id": 40, "status_code": 200}]).to_string(), true),
            ],
        },
        Call {
            sql: "select * from agent.idempotency_scheduled_pending($1)",
            arguments: vec![("p_job", "idempotency-redrive-webhooks".to_owned(), true)],
        },
        Call {
            sql: "select * from agent.idempotency_scheduled_failures($1::timestamptz, $2::integer)",
            arguments: vec![
                ("p_since", "2026-01-01T00:00:00Z".to_owned(), false),
                ("p_row_cap", "1000".to_owned(), false),
            ],
        },
        Call {
            sql: "select * from agent.idempotency_claim_many($1::uuid, $2, $3::bigint, $4::jsonb, $5::integer)",
            arguments: vec![
                ("p_organization_id", ORG.to_owned(), true),
                ("p_scope", "tool.x".to_owned(), true),
                ("p_lease_ms", "60000".to_owned(), true),
                (
                    "p_items",
                    json!([{"key": "k-batch", "request_hash": hash, "lease_token": Uuid::new_v4()}]).to_string(),
                    true,
                ),
                ("p_row_cap", "1000".to_owned(), false),
            ],
        },
        Call {
            sql: "select * from agent.idempotency_complete_many($1::uuid, $2::jsonb, $3::integer)",
            arguments: vec![
                ("p_organization_id", ORG.to_owned(), true),
                (
                    "p_items",
                    json!([{"claim_id": CLAIM_ID, "lease_token": TOKEN, "response": {"ok": true}}]).to_string(),
                    true,
                ),
                ("p_row_cap", "1000".to_owned(), false),
            ],
        },
        Call {
            sql: "select * from agent.idempotency_release_many($1::uuid, $2::jsonb, $3::integer)",
            arguments: vec![
                ("p_organization_id", ORG.to_owned(), true),
                ("p_items", json!([{"claim_id": CLAIM_ID, "lease_token": TOKEN}]).to_string(), true),
                ("p_row_cap", "1000".to_owned(), false),
            ],
        },
        Call {
            sql: "select * from agent.idempotency_orphans($1::integer)",
            arguments: vec![("p_limit", "10".to_owned(), true)],
        },
        Call {
            sql: "select * from agent.idempotency_expired($1::integer)",
            arguments: vec![("p_limit", "10".to_owned(), true)],
        },
        Call {
            sql: "select agent.idempotency_delete_expired($1::uuid[])",
            arguments: vec![("p_ids", format!("{{{CLAIM_ID}}}"), true)],
        },
        Call {
            sql: "select * from agent.idempotency_retire_expired($1::uuid[])",
            arguments: vec![("p_ids", format!("{{{CLAIM_ID}}}"), true)],
        },
        Call {
            sql: "select * from agent.idempotency_sweep($1::integer, $2::integer)",
            arguments: vec![("p_bound", "10".to_owned(), true), ("p_row_cap", "1000".to_owned(), false)],
        },
        Call {
            sql: "select * from agent.run_admit($1::uuid, $2, $3::jsonb, $4::uuid, $5::uuid, $6::uuid, $7::bigint)",
            arguments: vec![
                ("p_organization_id", ORG.to_owned(), true),
                ("p_start_key", "start-1".to_owned(), true),
                ("p_input", r#"{"q": 1}"#.to_owned(), true),
                ("p_admission_token", Uuid::new_v4().to_string(), false),
                // The fence: the processing claim arranged below, held by TOKEN.
                ("p_claim_id", CLAIM_ID.to_owned(), false),
                ("p_lease_token", TOKEN.to_owned(), false),
                ("p_max_run_duration_ms", "86400000".to_owned(), false),
            ],
        },
        Call {
            sql: "select * from agent.run_get($1::uuid, $2, $3::uuid)",
            arguments: vec![
                ("p_organization_id", ORG.to_owned(), true),
                ("p_start_key", "start-1".to_owned(), true),
                ("p_admission_token", Uuid::new_v4().to_string(), false),
            ],
        },
        Call {
            sql: "select * from agent.provider_job_register($1::uuid, $2, $3)",
            arguments: vec![
                ("p_organization_id", ORG.to_owned(), true),
                ("p_provider", "nylas".to_owned(), true),
                ("p_job_id", "job-1".to_owned(), true),
            ],
        },
        Call {
            sql: "select * from agent.provider_job_lookup($1, $2)",
            arguments: vec![("p_provider", "nylas".to_owned(), true), ("p_job_id", "job-1".to_owned(), true)],
        },
        Call {
            sql: "select * from agent.idempotency_cap_probe($1::integer)",
            arguments: vec![("p_rows", "2".to_owned(), true)],
        },
        Call {
            sql: "select * from agent.idempotency_in_flight($1::integer)",
            arguments: vec![("p_limit", "10".to_owned(), true)],
        },
        Call {
            sql: "select * from agent.idempotency_processing($1, $2::integer)",
            arguments: vec![("p_scope", "*".to_owned(), true), ("p_limit", "10".to_owned(), true)],
        },
        Call {
            sql: "select * from agent.idempotency_abandon($1::uuid, $2)",
            arguments: vec![("p_id", CLAIM_ID.to_owned(), true), ("p_version", "a".repeat(64), true)],
        },
        Call {
            sql: "select * from agent.idempotency_failure_counts($1::integer)",
            arguments: vec![("p_limit", "10".to_owned(), true)],
        },
        Call {
            sql: "select * from agent.idempotency_sweep_backlog($1::integer)",
            arguments: vec![("p_limit", "10".to_owned(), true)],
        },
        Call {
            sql: "select * from agent.idempotency_activity($1::timestamptz, $2::integer, $3::integer)",
            arguments: vec![
                ("p_since", (chrono::Utc::now() - chrono::Duration::hours(1)).to_rfc3339(), true),
                ("p_bucket_s", "60".to_owned(), true),
                ("p_limit", "100".to_owned(), true),
            ],
        },
    ]
}

/// The decision every claim path shares; only its owner may call it.
fn decide() -> Call {
    Call {
        sql: "select * from agent.idempotency_decide($1::uuid, $2, $3, $4, $5::uuid, $6::bigint, $7::bigint,
                                                     $8::boolean, $9::boolean)",
        arguments: vec![
            ("p_organization_id", ORG.to_owned(), true),
            ("p_scope", "tool.x".to_owned(), true),
            ("p_key", "k-new".to_owned(), true),
            ("p_request_hash", "a".repeat(64), true),
            ("p_lease_token", Uuid::new_v4().to_string(), true),
            ("p_lease_ms", "60000".to_owned(), true),
            ("p_retain_ms", "60000".to_owned(), false),
            ("p_may_insert", "true".to_owned(), true),
            ("p_may_take_over", "true".to_owned(), true),
        ],
    }
}

/// Runs `call` as `role` (None: the superuser) in a transaction rolled back
/// afterwards, with argument `null` (if any) bound as SQL NULL; answers the
/// SQLSTATE and message of its refusal, or None when it ran.
async fn run(
    conn: &mut PgConnection,
    role: Option<&str>,
    call: &Call,
    null: Option<usize>,
) -> Option<(String, String)> {
    sqlx::query("begin").execute(&mut *conn).await.expect("begin");
    if let Some(role) = role {
        sqlx::query(AssertSqlSafe(format!("set local role {role}"))).execute(&mut *conn).await.expect("set role");
    }
    let mut query = sqlx::query(call.sql);
    for (i, (_, value, _)) in call.arguments.iter().enumerate() {
        query = query.bind((Some(i) != null).then_some(value.as_str()));
    }
    let result = query.execute(&mut *conn).await;
    sqlx::query("rollback").execute(&mut *conn).await.expect("rollback");
    result.err().map(|error| match error.as_database_error() {
        Some(db) => (db.code().map(|c| c.into_owned()).unwrap_or_default(), db.message().to_owned()),
        None => (String::from("?"), error.to_string()),
    })
}

#[tokio::test]
async fn every_function_refuses_each_required_argument_as_sql_null_by_name() {
    // Arrange: a processing claim for the completion and the release to name.
    let stack = stack().await;
    sqlx::query(
        "insert into agent.idempotency_keys
           (id, organization_id, scope, key, request_hash, status, lease_token, lease_expires_at, retain_until)
         values ($1::uuid, $2::uuid, 'tool.x', 'k', repeat('a', 64), 'processing', $3::uuid,
                 now() + interval '1 minute', now() + interval '31 days')",
    )
    .bind(CLAIM_ID)
    .bind(ORG)
    .bind(TOKEN)
    .execute(stack.db())
    .await
    .expect("a claim");
    let mut conn = stack.db().acquire().await.expect("a connection");

    let mut wrong = Vec::new();
    let paths = surface().into_iter().map(|call| (Some("service_role"), call)).chain([(None, decide())]);
    let mut refusals = 0;
    for (role, call) in paths {
        // With every argument given, the call runs: a refusal below is the NULL's.
        if let Some(refused) = run(&mut conn, role, &call, None).await {
            wrong.push(format!("{}: refused with good arguments: {refused:?}", call.sql));
        }
        for (i, (name, _, required)) in call.arguments.iter().enumerate() {
            if !required {
                continue;
            }
            match run(&mut conn, role, &call, Some(i)).await {
                Some((code, message)) if code == codes::INVALID_PARAMETER_VALUE && message.contains(name) => {
                    refusals += 1
                }
                other => wrong.push(format!("{} with {name} NULL: {other:?}", call.sql)),
            }
        }
    }
    drop(conn);
    assert!(wrong.is_empty(), "{wrong:#?}");
    assert_eq!(refusals, 84, "every required argument of every function and of the decision was refused");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_null_request_hash_takes_over_no_lease_and_replays_no_answer() {
    // Arrange: a claim for one request whose worker is gone, and a
    // completed claim of another.
    let stack = stack().await;
    let service = service(&stack);
    let org = org();
    let gone = claimed(service.claim(org, "tool.email.send", "gone", &hash("one"), LEASE).await);
    pass_lease(&stack, gone.id()).await;
    let done = claimed(service.claim(org, "tool.email.send", "done", &hash("two"), LEASE).await);
    let ending = service.complete(&done, Completion::response(json!({"charged": 100}))).await;
    assert_eq!(ending.expect("complete"), Ending::Recorded);

    // Act: every claim path, with SQL NULL for the hash, as the service role;
    // and the internal decision itself, as its owner.
    let mut conn = stack.db().acquire().await.expect("a connection");
    let mut answers = Vec::new();
    for (role, sql) in [
        (Some("service_role"), "select * from agent.idempotency_reclaim($1, 'tool.email.send', 'gone', null, gen_random_uuid(), 60000, 60000)"),
        (Some("service_role"), "select * from agent.idempotency_try_claim($1, 'tool.email.send', 'gone', null, gen_random_uuid(), 60000, 60000)"),
        (Some("service_role"), "select * from agent.idempotency_claim($1, 'tool.email.send', 'gone', null, gen_random_uuid(), 60000)"),
        (Some("service_role"), "select * from agent.idempotency_claim($1, 'tool.email.send', 'done', null, gen_random_uuid(), 60000)"),
        (None, "select * from agent.idempotency_decide($1, 'tool.email.send', 'done', null, gen_random_uuid(), 60000, null, false, false)"),
        (None, "select * from agent.idempotency_decide($1, 'tool.email.send', 'gone', null, gen_random_uuid(), 60000, null, false, true)"),
    ] {
        sqlx::query("begin").execute(&mut *conn).await.unwrap();
        if let Some(role) = role {
            sqlx::query(AssertSqlSafe(format!("set local role {role}"))).execute(&mut *conn).await.unwrap();
        }
        let result = sqlx::query_scalar::<_, Value>(AssertSqlSafe(format!("select to_jsonb(c) from ({sql}) c")))
            .bind(org)
            .fetch_all(&mut *conn)
            .await;
        sqlx::query("commit").execute(&mut *conn).await.unwrap();
        answers.push((sql, result.map_err(|e| e.as_database_error().and_then(|d| d.code().map(|c| c.into_owned())))));
    }
    drop(conn);

    // Assert: each refused (a refused statement writes nothing), where the
    // NULL once compared as "not different" and took the lease or the answer.
    for (sql, answer) in &answers {
        assert_eq!(answer, &Err(Some(codes::INVALID_PARAMETER_VALUE.to_owned())), "{sql}");
    }
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_null_or_malformed_text_argument_through_the_server_is_refused_by_name_on_every_claim_path() {
    // The embedded server turns a JSON null into '' (PostgREST into NULL):
    // either way the function refuses it, naming the argument.
    let stack = stack().await;
    let client = client(&stack);
    let base = |function: &str| {
        let mut args = json!({
            "p_organization_id": org(), "p_scope": "tool.x", "p_key": "k", "p_request_hash": "a".repeat(64),
            "p_lease_token": Uuid::new_v4(), "p_lease_ms": 60000
        });
        if function != "idempotency_claim" {
            args["p_retain_ms"] = json!(3_600_000);
        }
        args
    };
    let mut wrong = Vec::new();
    for function in ["idempotency_claim", "idempotency_try_claim", "idempotency_reclaim", "idempotency_get"] {
        let arguments: &[&str] =
            if function == "idempotency_get" { &["p_scope", "p_key"] } else { &["p_scope", "p_key", "p_request_hash"] };
        for argument in arguments {
            let mut bad_values = vec![json!(null), json!(""), json!("x".repeat(600))];
            if *argument != "p_key" {
                // Any text of 1 to 512 characters is a key.
                bad_values.extend([json!("A".repeat(64)), json!("'; drop table x; --")]);
            }
            for bad in bad_values {
                let mut args = base(function);
                if function == "idempotency_get" {
                    args = json!({"p_organization_id": args["p_organization_id"], "p_scope": "tool.x", "p_key": "k"});
                }
                args[*argument] = bad.clone();
                let refused = client.rpc::<Value>(function, &args, Repeat::Safe).await;
                match &refused {
                    Err(ClientError::Api { status: 400, error, .. })
                        if error.code == codes::INVALID_PARAMETER_VALUE && error.message.contains(argument) => {}
                    other => wrong.push(format!("{function} {argument}={bad}: {other:?}")),
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    assert_eq!(count_rows(&stack).await, 0);
    stack.stop().await.unwrap();
}

/// Runs `query` as the service role, as PostgREST would, in a transaction
/// rolled back afterwards; answers the SQLSTATE it was refused with.
async fn refusal_as_service_role(
    stack: &idempotency_plane::local::LocalStack,
    query: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
) -> Option<String> {
    let mut conn = stack.db().acquire().await.expect("a connection");
    sqlx::query("begin").execute(&mut *conn).await.expect("begin");
    sqlx::query("set local role service_role").execute(&mut *conn).await.expect("set role");
    let result = query.execute(&mut *conn).await;
    sqlx::query("rollback").execute(&mut *conn).await.expect("rollback");
    result.err().and_then(|e| e.as_database_error().and_then(|d| d.code().map(|c| c.into_owned())))
}

/// `levels` arrays, one inside the other, around a number.
fn nested(levels: usize) -> Value {
    (0..levels).fold(json!(1), |inner, _| json!([inner]))
}

/// The stored status of the only claim.
async fn status(stack: &idempotency_plane::local::LocalStack) -> String {
    sqlx::query_scalar("select status from agent.idempotency_keys").fetch_one(stack.db()).await.expect("the claim")
}

#[tokio::test]
async fn a_response_nested_deeper_than_64_levels_is_refused_with_idem3_and_the_claim_stays_processing() {
    let stack = stack().await;
    let service = service(&stack);
    let repository = PostgrestRepository::new(client(&stack));
    let claim = claimed(service.claim(org(), "tool.email.send", "deep", &hash("deep"), LEASE).await);
    let complete = |response: Value| {
        let repository = &repository;
        let (organization, id, token) = (claim.organization_id(), claim.id(), claim.lease_token());
        async move {
            let args = CompletionArgs { response: Some(&response), ..CompletionArgs::default() };
            repository.complete(organization, id, token, args).await
        }
    };
    // Through the server, the first level past the documented 64. (The
    // embedded server refuses a body deeper than 128 levels itself, with
    // PGRST102; PostgREST passes it on, so 130 levels go by SQL below.)
    match complete(nested(MAX_RESPONSE_DEPTH + 1)).await {
        Err(error @ idempotency_plane::Error::Store(ClientError::Api { status: 400, .. })) => {
            assert_eq!(error_code(&error), Some(codes::RESPONSE_TOO_DEEP));
            assert!(error.is_unstorable_answer(), "the caller's data");
        }
        other => panic!("65 levels: expected 400 IDEM3, got {other:?}"),
    }
    assert_eq!(status(&stack).await, "processing", "65 levels wrote nothing");
    // 130 levels, past serde_json's own limit of 128, as any client may send them.
    let deep = sqlx::query("select * from agent.idempotency_complete($1, $2, null, null, $3)")
        .bind(claim.id())
        .bind(claim.lease_token())
        .bind(sqlx::types::Json(nested(130)));
    assert_eq!(refusal_as_service_role(&stack, deep).await.as_deref(), Some(codes::RESPONSE_TOO_DEEP), "130 levels");
    assert_eq!(status(&stack).await, "processing");
    // 64 levels are kept, and read back.
    let kept = complete(nested(MAX_RESPONSE_DEPTH)).await.expect("64 levels").expect("our claim");
    assert_eq!(kept.response, Some(nested(MAX_RESPONSE_DEPTH)));
    stack.stop().await.unwrap();
}

fn error_code(error: &idempotency_plane::Error) -> Option<&str> {
    match error {
        idempotency_plane::Error::Store(store) => store.code(),
        _ => None,
    }
}

#[tokio::test]
async fn no_policy_may_keep_more_than_a_default_client_reads_and_the_largest_legal_answer_reads_back() {
    let stack = stack().await;
    // A policy above 4 MiB is refused by the table's check.
    let above = sqlx::query("insert into agent.idempotency_scopes values ('webhook.huge', interval '1 day', $1)")
        .bind(i32::try_from(MAX_POLICY_RESPONSE_BYTES + 1).unwrap())
        .execute(stack.db())
        .await;
    let code = above.err().and_then(|e| e.as_database_error().and_then(|d| d.code().map(|c| c.into_owned())));
    assert_eq!(code.as_deref(), Some("23514"), "a 4 MiB + 1 policy");
    sqlx::query("insert into agent.idempotency_scopes values ('webhook.large', interval '1 day', $1)")
        .bind(i32::try_from(MAX_POLICY_RESPONSE_BYTES).unwrap())
        .execute(stack.db())
        .await
        .expect("a 4 MiB policy");

    // The worst case for PostgreSQL's text form: `[1,1,…]`, 2 bytes an
    // element compact and 3 as stored, just under the limit. Completed by
    // SQL, as any client may: the embedded server's debug build takes long
    // to parse two million numbers, and what is measured is the read back.
    let elements = usize::try_from((MAX_POLICY_RESPONSE_BYTES - 1) / 2).unwrap();
    let largest = json!(vec![1; elements]);
    let service = service(&stack);
    let (org, request) = (org(), hash("large"));
    let claim = claimed(service.claim(org, "webhook.large", "d-1", &request, LEASE).await);
    let mut conn = stack.db().acquire().await.expect("a connection");
    sqlx::query("begin").execute(&mut *conn).await.unwrap();
    sqlx::query("set local role service_role").execute(&mut *conn).await.unwrap();
    let stored: i64 = sqlx::query_scalar(
        "select octet_length(response::text)::bigint from agent.idempotency_complete($1, $2, null, null, $3)",
    )
    .bind(claim.id())
    .bind(claim.lease_token())
    .bind(sqlx::types::Json(&largest))
    .fetch_one(&mut *conn)
    .await
    .expect("the largest legal answer is kept");
    sqlx::query("commit").execute(&mut *conn).await.unwrap();
    drop(conn);
    assert!(stored > 6_000_000, "as PostgreSQL writes it: {stored} bytes");

    // A client with the default read limit (and time to spare on a busy
    // machine) replays it whole.
    let config = stack.client_config().unwrap().with_request_timeout(std::time::Duration::from_secs(120));
    let reader = idempotency_plane::IdempotencyService::new(PostgrestRepository::new(
        idempotency_plane::PostgrestClient::new(config.with_deadline(std::time::Duration::from_secs(120)).unwrap())
            .unwrap(),
    ));
    let replay = reader.claim(org, "webhook.large", "d-1", &request, LEASE).await.expect("a replay");
    match replay {
        ClaimOutcome::Completed { response, .. } => assert!(response.as_ref() == Some(&largest), "the same answer"),
        other => panic!("expected the stored answer, got {other:?}"),
    }

    // One byte above the policy, and 9 MiB (above what a default client
    // reads): refused, and the claim stays processing.
    let other = claimed(service.claim(org, "webhook.large", "d-2", &hash("larger"), LEASE).await);
    let text = usize::try_from(MAX_POLICY_RESPONSE_BYTES).unwrap() - r#"{"t":""}"#.len() + 1;
    let larger = json!({"t": "x".repeat(text)});
    let args = CompletionArgs { response: Some(&larger), ..CompletionArgs::default() };
    let refused = service.repository().complete(other.organization_id(), other.id(), other.lease_token(), args).await;
    assert_eq!(refused.as_ref().err().and_then(error_code), Some(codes::RESPONSE_TOO_LARGE), "{refused:?}");
    let unreadable = sqlx::query("select * from agent.idempotency_complete($1, $2, null, null, $3)")
        .bind(other.id())
        .bind(other.lease_token())
        .bind(sqlx::types::Json(json!({"t": "x".repeat(9 * 1024 * 1024)})));
    assert_eq!(refusal_as_service_role(&stack, unreadable).await.as_deref(), Some(codes::RESPONSE_TOO_LARGE), "9 MiB");
    let kept: String = sqlx::query_scalar("select status from agent.idempotency_keys where id = $1")
        .bind(other.id())
        .fetch_one(stack.db())
        .await
        .unwrap();
    assert_eq!(kept, "processing");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn an_unreadable_response_is_refused_while_another_transaction_holds_the_row() {
    // Arrange: a claim whose row another transaction has locked.
    let stack = stack().await;
    let service = service(&stack);
    let claim = claimed(service.claim(org(), "tool.email.send", "locked", &hash("locked"), LEASE).await);
    let mut holder = stack.db().begin().await.expect("a transaction");
    sqlx::query("select 1 from agent.idempotency_keys where id = $1 for update")
        .bind(claim.id())
        .execute(&mut *holder)
        .await
        .expect("lock the row");

    // Act: answers above the scope's 64 KiB and deeper than 64 levels.
    let too_large = json!({"text": "x".repeat(1024 * 1024)});
    let too_deep = nested(MAX_RESPONSE_DEPTH + 1);
    let mut codes_seen = Vec::new();
    for response in [&too_large, &too_deep] {
        let args = CompletionArgs { response: Some(response), ..CompletionArgs::default() };
        let refused =
            service.repository().complete(claim.organization_id(), claim.id(), claim.lease_token(), args).await;
        codes_seen.push(refused.as_ref().err().and_then(error_code).map(str::to_owned));
    }
    holder.rollback().await.expect("let the row go");

    // Assert: measured before the lock, so refused rather than timed out
    // behind it (55P03 after the functions' 5 s lock_timeout).
    assert_eq!(
        codes_seen,
        [Some(codes::RESPONSE_TOO_LARGE.to_owned()), Some(codes::RESPONSE_TOO_DEEP.to_owned())],
        "refused without waiting for the row"
    );
    assert_eq!(status(&stack).await, "processing");
    stack.stop().await.unwrap();
}

/// A Run's max_run_duration is capped at 30 days, the tool retention, in
/// SQL whoever calls: `run_admit` refuses zero, a negative duration and one
/// above 30 days with 22023, naming the argument and admitting nothing, and
/// the table itself refuses a row that carries one (a superuser's insert).
/// The crate refuses it before any request.
#[tokio::test]
async fn a_run_longer_than_30_days_is_refused_by_the_function_the_table_and_the_crate() {
    let stack = stack().await;
    let mut conn = stack.db().acquire().await.expect("a connection");
    let admit = |ms: &str| Call {
        sql: "select * from agent.run_admit($1::uuid, $2, $3::jsonb, p_max_run_duration_ms => $4::bigint)",
        arguments: vec![
            ("p_organization_id", ORG.to_owned(), true),
            ("p_start_key", "long-run".to_owned(), true),
            ("p_input", "{}".to_owned(), true),
            ("p_max_run_duration_ms", ms.to_owned(), false),
        ],
    };
    for ms in ["0", "-1", "2592000001"] {
        let refused = run(&mut conn, Some("service_role"), &admit(ms), None).await;
        assert!(
            matches!(&refused, Some((code, message)) if code == codes::INVALID_PARAMETER_VALUE
                && message.contains("p_max_run_duration_ms") && message.contains("30 days")),
            "{ms} ms: {refused:?}"
        );
    }
    assert_eq!(run(&mut conn, Some("service_role"), &admit("2592000000"), None).await, None, "30 days exactly");
    let inserted = sqlx::query(
        "insert into agent.runs (organization_id, start_key, input, max_run_duration)
         values ($1::uuid, 'by-hand', '{}', interval '31 days')",
    )
    .bind(ORG)
    .execute(&mut *conn)
    .await
    .expect_err("a Run of 31 days");
    let code = inserted.as_database_error().and_then(|db| db.code().map(|c| c.into_owned()));
    assert_eq!(code.as_deref(), Some("23514"), "{inserted}");
    drop(conn);
    assert_eq!(count_runs(&stack).await, 0, "nothing admitted");

    let runs = idempotency_plane::callers::runs::RunAdmission::new(PostgrestRepository::new(client(&stack)));
    let token = idempotency_plane::callers::runs::AdmissionToken::random();
    let over = std::time::Duration::from_secs(30 * 86_400 + 1);
    let refused = runs.admit_with_max_duration(org(), "long-run", &json!({}), token, over).await;
    assert!(
        matches!(
            refused,
            Err(idempotency_plane::Error::Invalid(idempotency_plane::InvalidInput::RunDurationOutOfRange { .. }))
        ),
        "{refused:?}"
    );
    let day = std::time::Duration::from_secs(86_400);
    let admitted = runs.admit_with_max_duration(org(), "day-run", &json!({}), token, day).await.expect("a day");
    let stored: sqlx::postgres::types::PgInterval =
        sqlx::query_scalar("select max_run_duration from agent.runs where id = $1")
            .bind(admitted.id)
            .fetch_one(stack.db())
            .await
            .expect("the Run's duration");
    assert_eq!((stored.months, stored.days, stored.microseconds), (0, 0, 86_400_000_000), "kept with the Run");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn sending_failures_back_needs_a_choice_or_a_since_and_refuses_a_null_in_the_choice() {
    let stack = stack().await;
    let mut conn = stack.db().acquire().await.expect("a connection");
    let call = |since: Option<&'static str>, ids: Option<&'static str>| Call {
        sql: "select * from agent.idempotency_redrive_failed($1, $2::integer, $3::uuid, $4::timestamptz, \
              $5::uuid[], $6::integer)",
        arguments: vec![
            ("p_scope", "webhook.*".to_owned(), true),
            ("p_limit", "10".to_owned(), true),
            ("p_organization_id", ORG.to_owned(), false),
            ("p_since", since.unwrap_or("2026-01-01T00:00:00Z").to_owned(), false),
            ("p_claim_ids", ids.unwrap_or("{}").to_owned(), false),
            ("p_row_cap", "1000".to_owned(), false),
        ],
    };
    // Both filters SQL NULL: nothing named to send back.
    let both = call(None, None);
    let mut query = sqlx::query(both.sql);
    for (i, (_, value, _)) in both.arguments.iter().enumerate() {
        query = query.bind((i != 3 && i != 4).then_some(value.as_str()));
    }
    sqlx::query("set role service_role").execute(&mut *conn).await.expect("set role");
    let refused = query.execute(&mut *conn).await.expect_err("refused");
    let db = refused.as_database_error().expect("a database error");
    assert_eq!(db.code().as_deref(), Some(codes::INVALID_PARAMETER_VALUE));
    assert!(db.message().contains("p_claim_ids") && db.message().contains("p_since"), "{}", db.message());
    sqlx::query("reset role").execute(&mut *conn).await.expect("reset role");
    // An empty choice, and a choice holding NULL.
    for ids in ["{}", "{NULL}", "{00000000-0000-0000-0000-0000000000c1,NULL}"] {
        let refused = run(&mut conn, Some("service_role"), &call(Some("2026-01-01T00:00:00Z"), Some(ids)), None).await;
        assert!(
            matches!(&refused, Some((code, message)) if code == codes::INVALID_PARAMETER_VALUE && message.contains("p_claim_ids")),
            "{ids}: {refused:?}"
        );
    }
    drop(conn);
    stack.stop().await.unwrap();
}
