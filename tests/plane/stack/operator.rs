//! What an operator reads and does through the plane's own functions, on the
//! real stack: the W3C traceparent a claim stores and hands on with its work,
//! the console's bounded reads (in flight, processing, failure counts, the
//! sweep backlog, activity over time) and its one compare-and-set action,
//! `agent.idempotency_abandon`, which fences the worker it ends.

use idempotency_plane::postgrest::{codes, ClientError, Repeat};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::support::harness::*;

const SCOPE: &str = "webhook.operator";
const TRACE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const ORG: &str = "00000000-0000-0000-0000-00000000c0de";
const OTHER_TRACE: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

async fn rpc(stack: &idempotency_plane::local::LocalStack, function: &'static str, args: Value) -> Vec<Value> {
    client(stack).rpc(function, &args, Repeat::Safe).await.unwrap_or_else(|e| panic!("{function} {args}: {e}"))
}

async fn refused(stack: &idempotency_plane::local::LocalStack, function: &'static str, args: Value) -> String {
    match client(stack).rpc::<Vec<Value>>(function, &args, Repeat::Safe).await {
        Err(ClientError::Api { error, .. }) if error.code == codes::INVALID_PARAMETER_VALUE => error.message,
        other => panic!("{function} {args}: expected a 22023 refusal, got {other:?}"),
    }
}

/// A claim in SCOPE carrying work, made with `traceparent`; answers the row.
async fn claim_with_work(stack: &idempotency_plane::local::LocalStack, key: &str, traceparent: Option<&str>) -> Value {
    let mut args = json!({
        "p_organization_id": ORG, "p_scope": SCOPE, "p_key": key, "p_request_hash": hash(key).as_str(),
        "p_lease_token": Uuid::new_v4(), "p_lease_ms": 60_000, "p_request": {"body": key},
    });
    if let Some(traceparent) = traceparent {
        args["p_traceparent"] = json!(traceparent);
    }
    let mut rows = rpc(stack, "idempotency_claim", args).await;
    assert_eq!(rows.len(), 1);
    rows.remove(0)
}

async fn stored_traceparent(stack: &idempotency_plane::local::LocalStack, key: &str) -> Option<String> {
    sqlx::query_scalar("select traceparent from agent.idempotency_keys where key = $1")
        .bind(key)
        .fetch_one(stack.db())
        .await
        .expect("the claim")
}

/// A heartbeat: the lease's new end, or null when the token no longer holds the claim.
async fn extend(stack: &idempotency_plane::local::LocalStack, claim_id: &Value, token: &Value) -> Value {
    let args = json!({"p_claim_id": claim_id, "p_lease_token": token, "p_lease_ms": 60_000});
    client(stack).rpc("idempotency_extend", &args, Repeat::Safe).await.unwrap_or_else(|e| panic!("extend: {e}"))
}

fn id(row: &Value) -> Uuid {
    row["id"].as_str().and_then(|id| id.parse().ok()).unwrap_or_else(|| panic!("an id in {row}"))
}

#[tokio::test]
async fn a_claim_keeps_the_first_traceparent_and_hands_it_on_with_its_work() {
    let stack = stack().await;

    // A malformed traceparent is refused by name and writes nothing.
    for bad in [
        "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        "traceparent",
    ] {
        let message = refused(
            &stack,
            "idempotency_claim",
            json!({"p_organization_id": ORG, "p_scope": SCOPE, "p_key": "bad", "p_request_hash": hash("bad").as_str(),
                   "p_lease_token": Uuid::new_v4(), "p_lease_ms": 60_000, "p_request": {}, "p_traceparent": bad}),
        )
        .await;
        assert!(message.contains("p_traceparent"), "{bad}: {message}");
    }
    assert_eq!(count_rows(&stack).await, 0, "a refused claim writes nothing");

    // The first claim stores its caller's trace and is answered it.
    let first = claim_with_work(&stack, "k-1", Some(TRACE)).await;
    assert_eq!(first["outcome"], "claimed");
    assert_eq!(first["traceparent"], TRACE);

    // A takeover after the lease passed keeps the first trace and answers it,
    // so the worker taking over can link to it.
    pass_lease(&stack, id(&first)).await;
    let taken = claim_with_work(&stack, "k-1", Some(OTHER_TRACE)).await;
    assert_eq!(taken["outcome"], "reclaimed");
    assert_eq!(taken["traceparent"], TRACE, "the trace that first claimed the key");
    assert_eq!(stored_traceparent(&stack, "k-1").await.as_deref(), Some(TRACE));

    // A re-drive of the orphan answers the work with the first trace.
    pass_lease(&stack, id(&first)).await;
    let work = rpc(
        &stack,
        "idempotency_redrive",
        json!({"p_scope": SCOPE, "p_lease_tokens": [Uuid::new_v4()], "p_lease_ms": 60_000}),
    )
    .await;
    assert_eq!(work.len(), 1, "{work:?}");
    assert_eq!(work[0]["traceparent"], TRACE);
    assert_eq!(work[0]["request"], json!({"body": "k-1"}));

    // A replay is never handed a trace; a claim without one stores none.
    let plain = claim_with_work(&stack, "k-2", None).await;
    assert_eq!(plain["traceparent"], Value::Null);
    assert_eq!(stored_traceparent(&stack, "k-2").await, None);

    // A batch stores each item's trace, and refuses a malformed one by index.
    let items = json!([
        {"key": "b-1", "request_hash": hash("b-1").as_str(), "lease_token": Uuid::new_v4(), "request": {"n": 1}, "traceparent": TRACE},
        {"key": "b-2", "request_hash": hash("b-2").as_str(), "lease_token": Uuid::new_v4(), "request": {"n": 2}},
    ]);
    let answered = rpc(
        &stack,
        "idempotency_claim_many",
        json!({"p_organization_id": ORG, "p_scope": SCOPE, "p_lease_ms": 60_000, "p_items": items}),
    )
    .await;
    assert_eq!(answered[0]["traceparent"], TRACE);
    assert_eq!(answered[1]["traceparent"], Value::Null);
    assert_eq!(stored_traceparent(&stack, "b-1").await.as_deref(), Some(TRACE));
    let bad_items = json!([
        {"key": "b-3", "request_hash": hash("b-3").as_str(), "lease_token": Uuid::new_v4()},
        {"key": "b-4", "request_hash": hash("b-4").as_str(), "lease_token": Uuid::new_v4(), "traceparent": "00-xyz"},
    ]);
    let message = refused(
        &stack,
        "idempotency_claim_many",
        json!({"p_organization_id": ORG, "p_scope": SCOPE, "p_lease_ms": 60_000, "p_items": bad_items}),
    )
    .await;
    assert!(message.contains("p_items[1].traceparent"), "{message}");
    let b3: i64 = sqlx::query_scalar("select count(*) from agent.idempotency_keys where key = 'b-3'")
        .fetch_one(stack.db())
        .await
        .unwrap();
    assert_eq!(b3, 0, "a refused batch writes nothing");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn abandon_ends_only_the_claim_the_operator_saw_and_fences_its_holder() {
    let stack = stack().await;
    let held = claim_with_work(&stack, "stuck", Some(TRACE)).await;
    let token = held["lease_token"].clone();
    let shown = rpc(&stack, "idempotency_processing", json!({"p_scope": "*", "p_limit": 10})).await;
    assert_eq!(shown.len(), 1, "{shown:?}");
    let shown = &shown[0];
    assert_eq!(shown["key"], "stuck");
    assert_eq!(shown["carries_work"], true);
    assert_eq!(shown["lease_live"], true);
    let version = shown["version"].as_str().expect("a version").to_owned();
    assert!(shown.get("lease_token").is_none(), "the token is never shown: {shown}");
    assert_ne!(version, token.as_str().unwrap_or_default());

    // The holder's heartbeat moves the claim on: the version shown is stale,
    // and abandoning with it changes nothing.
    let extended = extend(&stack, &held["id"], &token).await;
    assert!(extended.is_string(), "the heartbeat landed: {extended}");
    let stale = client(&stack)
        .rpc::<Vec<Value>>("idempotency_abandon", &json!({"p_id": held["id"], "p_version": version}), Repeat::Unsafe)
        .await
        .expect("abandon");
    assert!(stale.is_empty(), "changed since shown: nothing ended: {stale:?}");
    let status: String = sqlx::query_scalar("select status from agent.idempotency_keys where key = 'stuck'")
        .fetch_one(stack.db())
        .await
        .unwrap();
    assert_eq!(status, "processing");

    // With the version shown now, it ends as a failure that can be sent back.
    let now_shown = rpc(&stack, "idempotency_processing", json!({"p_scope": SCOPE, "p_limit": 10})).await;
    let version = now_shown[0]["version"].clone();
    let ended = client(&stack)
        .rpc::<Vec<Value>>("idempotency_abandon", &json!({"p_id": held["id"], "p_version": version}), Repeat::Unsafe)
        .await
        .expect("abandon");
    assert_eq!(ended.len(), 1, "{ended:?}");
    assert_eq!(ended[0]["error"], "abandoned_by_operator");
    assert_eq!(ended[0]["redrivable"], true);

    // The worker that held it is fenced: its heartbeat and its completion
    // change nothing.
    let beat = extend(&stack, &held["id"], &token).await;
    assert_eq!(beat, Value::Null, "a fenced heartbeat extends nothing");
    let completed = rpc(
        &stack,
        "idempotency_complete",
        json!({"p_claim_id": held["id"], "p_lease_token": token, "p_response": {"ok": true}}),
    )
    .await;
    assert!(completed.is_empty(), "a fenced completion records nothing: {completed:?}");
    let again = client(&stack)
        .rpc::<Vec<Value>>("idempotency_abandon", &json!({"p_id": held["id"], "p_version": version}), Repeat::Unsafe)
        .await
        .expect("abandon");
    assert!(again.is_empty(), "a journaled failure is not ended twice");

    // Listed as a failure; sent back after a fix, the next re-drive runs it
    // once, with its work and its first trace.
    let failures = rpc(&stack, "idempotency_failures", json!({"p_scope": SCOPE, "p_limit": 10})).await;
    assert_eq!(failures.len(), 1);
    assert_eq!(failures[0]["error"], "abandoned_by_operator");
    let counts = rpc(&stack, "idempotency_failure_counts", json!({"p_limit": 10})).await;
    assert_eq!(
        counts,
        vec![
            json!({"scope": SCOPE, "failures": 1, "redrivable": 1, "dead_lettered": 0, "oldest_claimed_at": counts[0]["oldest_claimed_at"]})
        ]
    );
    let sent = client(&stack)
        .rpc::<Vec<Value>>(
            "idempotency_redrive_failed",
            &json!({"p_scope": SCOPE, "p_limit": 10, "p_claim_ids": [held["id"]]}),
            Repeat::Unsafe,
        )
        .await
        .expect("send back");
    assert_eq!(sent.len(), 1);
    let tokens = json!([Uuid::new_v4(), Uuid::new_v4()]);
    let work =
        rpc(&stack, "idempotency_redrive", json!({"p_scope": SCOPE, "p_lease_tokens": tokens, "p_lease_ms": 60_000}))
            .await;
    assert_eq!(work.len(), 1, "{work:?}");
    assert_eq!(work[0]["request"], json!({"body": "stuck"}));
    assert_eq!(work[0]["traceparent"], TRACE);
    let none = rpc(
        &stack,
        "idempotency_redrive",
        json!({"p_scope": SCOPE, "p_lease_tokens": [Uuid::new_v4()], "p_lease_ms": 60_000}),
    )
    .await;
    assert!(none.is_empty(), "run once: {none:?}");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn the_console_reads_count_what_the_journal_holds_and_refuse_an_unbounded_read() {
    let stack = stack().await;
    let live = claim_with_work(&stack, "live", None).await;
    let orphan = claim_with_work(&stack, "orphan", None).await;
    pass_lease(&stack, id(&orphan)).await;
    let done = claim_with_work(&stack, "done", None).await;
    rpc(
        &stack,
        "idempotency_complete",
        json!({"p_claim_id": done["id"], "p_lease_token": done["lease_token"], "p_response": {"ok": true}}),
    )
    .await;
    let failed = claim_with_work(&stack, "failed", None).await;
    rpc(
        &stack,
        "idempotency_complete",
        json!({"p_claim_id": failed["id"], "p_lease_token": failed["lease_token"], "p_response": {"ok": false, "error": "boom"}}),
    )
    .await;
    // Two replays: one single claim, one batch item.
    assert_eq!(claim_with_work(&stack, "done", None).await["outcome"], "completed");
    let batch = json!([{"key": "done", "request_hash": hash("done").as_str(), "lease_token": Uuid::new_v4()}]);
    rpc(
        &stack,
        "idempotency_claim_many",
        json!({"p_organization_id": ORG, "p_scope": SCOPE, "p_lease_ms": 60_000, "p_items": batch}),
    )
    .await;
    expired_rows(&stack, 3).await;

    let in_flight = rpc(&stack, "idempotency_in_flight", json!({"p_limit": 10})).await;
    assert_eq!(in_flight.len(), 1, "{in_flight:?}");
    assert_eq!(in_flight[0]["scope"], SCOPE);
    assert_eq!(
        (in_flight[0]["processing"].clone(), in_flight[0]["live"].clone(), in_flight[0]["orphans"].clone()),
        (json!(2), json!(1), json!(1))
    );
    assert_eq!(live["outcome"], "claimed");

    let backlog = rpc(&stack, "idempotency_sweep_backlog", json!({"p_limit": 10})).await;
    let waiting: i64 = backlog.iter().filter_map(|day| day["rows"].as_i64()).sum();
    assert_eq!(waiting, 3, "{backlog:?}");

    let since = (chrono::Utc::now() - chrono::Duration::minutes(10)).to_rfc3339();
    let activity =
        rpc(&stack, "idempotency_activity", json!({"p_since": since, "p_bucket_s": 60, "p_limit": 20})).await;
    assert!((10..=11).contains(&activity.len()), "one row a minute: {}", activity.len());
    let total = |field: &str| activity.iter().filter_map(|bucket| bucket[field].as_i64()).sum::<i64>();
    assert_eq!((total("claims"), total("replays"), total("failures")), (4, 2, 1), "{activity:?}");

    // Each read refuses a bound above the plane's row cap, by name.
    set_plane_row_cap(&stack, 50).await;
    let two_hours_ago = (chrono::Utc::now() - chrono::Duration::hours(2)).to_rfc3339();
    for (function, args) in [
        ("idempotency_in_flight", json!({"p_limit": 51})),
        ("idempotency_processing", json!({"p_scope": "*", "p_limit": 51})),
        ("idempotency_failure_counts", json!({"p_limit": 51})),
        ("idempotency_sweep_backlog", json!({"p_limit": 51})),
        ("idempotency_sweep_backlog", json!({"p_limit": 0})),
        ("idempotency_activity", json!({"p_since": since, "p_bucket_s": 60, "p_limit": 51})),
        ("idempotency_activity", json!({"p_since": two_hours_ago, "p_bucket_s": 60, "p_limit": 50})),
    ] {
        let message = refused(&stack, function, args.clone()).await;
        assert!(message.contains("p_limit"), "{function} {args}: {message}");
    }
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn every_sweep_pass_trims_the_replay_counts_a_day_at_a_time() {
    let stack = stack().await;
    // Counts of ten days ago, eight and a half, and now, of one backend.
    sqlx::query(
        "insert into agent.idempotency_replays (minute, scope, backend, replays)
         select date_trunc('minute', now() - d * interval '1 day'), 'webhook.operator', 1, 1
           from unnest(array[10, 8.5, 0]) d",
    )
    .execute(stack.db())
    .await
    .expect("counts");
    let left = || async {
        let days: Vec<f64> = sqlx::query_scalar(
            "select round(extract(epoch from now() - minute) / 86400)::float8 from agent.idempotency_replays
              order by minute",
        )
        .fetch_all(stack.db())
        .await
        .expect("left");
        days
    };

    // A pass with nothing expired still trims, the oldest day first: the
    // ten-day-old count, then the 8.5-day-old one; today's stays.
    let sweeper = idempotency_plane::sweeper::Sweeper::new(client(&stack), 10).expect("a sweeper");
    let report = sweeper.pass().await.expect("a pass");
    assert_eq!(report.read, 0);
    assert_eq!(left().await, [9.0, 0.0], "one day trimmed");
    sweeper.pass().await.expect("a pass");
    assert_eq!(left().await, [0.0], "the next day trimmed");
    sweeper.pass().await.expect("a pass");
    assert_eq!(left().await, [0.0], "what is younger than 7 days stays");
    stack.stop().await.unwrap();
}
