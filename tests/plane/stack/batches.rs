//! Batches on the real stack: refused whole for a NULL or malformed item
//! anywhere (with SQL NULL over a direct connection, and through the
//! server), bounded by the row cap at the server as well as in the client,
//! one round trip whatever the outcomes, and decided under real concurrency
//! so that no key is held by two items of racing batches.

use idempotency_plane::postgrest::{codes, RetryConfig};
use idempotency_plane::repo::{
    BatchClaims, ClaimDecision, ClaimFence, ClaimItem, ClaimManyCall, CompletionArgs, CompletionItem,
};
use idempotency_plane::PostgrestRepository;
use std::time::Duration;

use serde_json::{json, Value};
use sqlx::{AssertSqlSafe, PgConnection};
use uuid::Uuid;

use crate::support::harness::*;
use crate::support::proxy::RpcProxy;
use crate::support::LEASE;

const ORG: &str = "00000000-0000-0000-0000-0000000000b1";

/// Runs `sql` as the service role with `items` bound as `$1::jsonb` (SQL
/// NULL where `None`); answers the refusal's SQLSTATE and message, or
/// None when it ran. The statement is committed when it runs, so a test can
/// count what it wrote.
async fn as_service(conn: &mut PgConnection, sql: &str, items: Option<Value>) -> Option<(String, String)> {
    sqlx::query("begin").execute(&mut *conn).await.expect("begin");
    sqlx::query("set local role service_role").execute(&mut *conn).await.expect("set role");
    let result = sqlx::query(AssertSqlSafe(sql.to_owned())).bind(items).execute(&mut *conn).await;
    sqlx::query("commit").execute(&mut *conn).await.expect("commit");
    result.err().map(|error| match error.as_database_error() {
        Some(db) => (db.code().map(|c| c.into_owned()).unwrap_or_default(), db.message().to_owned()),
        None => (String::from("?"), error.to_string()),
    })
}

fn claim_item(key: &str) -> Value {
    json!({"key": key, "request_hash": "a".repeat(64), "lease_token": Uuid::new_v4()})
}

#[tokio::test]
async fn a_null_or_malformed_item_anywhere_refuses_the_whole_batch_naming_its_index() {
    let stack = stack().await;
    let mut conn = stack.db().acquire().await.expect("a connection");
    let claim_many = format!("select * from agent.idempotency_claim_many('{ORG}', 'tool.x', 60000, $1::jsonb)");
    let complete_many = format!("select * from agent.idempotency_complete_many('{ORG}', $1::jsonb)");
    let release_many = format!("select * from agent.idempotency_release_many('{ORG}', $1::jsonb)");
    let fence = || json!({"claim_id": Uuid::new_v4(), "lease_token": Uuid::new_v4()});
    let answered = || json!({"claim_id": Uuid::new_v4(), "lease_token": Uuid::new_v4(), "response": {"ok": true}});

    // Each case: a batch whose item 2 (of 3) is bad in one way, and what
    // the refusal must name.
    let mut cases: Vec<(&str, Value, String)> = Vec::new();
    for field in ["key", "request_hash", "lease_token"] {
        let mut bad = claim_item("k-2");
        bad[field] = Value::Null;
        cases.push((&claim_many, json!([claim_item("k-0"), claim_item("k-1"), bad]), format!("p_items[2].{field}")));
        let mut absent = claim_item("k-2");
        absent.as_object_mut().map(|item| item.remove(field));
        cases.push((&claim_many, json!([claim_item("k-0"), claim_item("k-1"), absent]), format!("p_items[2].{field}")));
    }
    for (field, value) in [
        ("request_hash", json!("A".repeat(64))),
        ("request_hash", json!(7)),
        ("key", json!("")),
        ("key", json!("k".repeat(513))),
        ("lease_token", json!("not-a-uuid")),
    ] {
        let mut bad = claim_item("k-2");
        bad[field] = value;
        cases.push((&claim_many, json!([claim_item("k-0"), claim_item("k-1"), bad]), format!("p_items[2].{field}")));
    }
    cases.push((&claim_many, json!([claim_item("k-0"), claim_item("k-1"), null]), "p_items[2]".into()));
    cases.push((&claim_many, json!([claim_item("k-0"), claim_item("k-1"), "k-2"]), "p_items[2]".into()));
    cases.push((&claim_many, json!({"key": "k"}), "p_items must be a JSON array".into()));
    cases.push((&claim_many, json!([]), "p_items must hold between 1".into()));
    for field in ["claim_id", "lease_token"] {
        let mut bad = answered();
        bad[field] = Value::Null;
        cases.push((&complete_many, json!([answered(), answered(), bad]), format!("p_items[2].{field}")));
        let mut bad = fence();
        bad[field] = Value::Null;
        cases.push((&release_many, json!([fence(), fence(), bad]), format!("p_items[2].{field}")));
    }
    cases.push((&complete_many, json!([answered(), answered(), fence()]), "p_items[2]".into()));
    let mut typeless = answered();
    typeless["resource_id"] = json!("m-1");
    cases.push((&complete_many, json!([answered(), answered(), typeless]), "p_items[2].resource_id".into()));

    let mut wrong = Vec::new();
    for (sql, items, named) in &cases {
        match as_service(&mut conn, sql, Some(items.clone())).await {
            Some((code, message)) if code == codes::INVALID_PARAMETER_VALUE && message.contains(named.as_str()) => {}
            other => wrong.push(format!("{sql} with {items}: expected 22023 naming {named}, got {other:?}")),
        }
    }
    for sql in [&claim_many, &complete_many, &release_many] {
        match as_service(&mut conn, sql, None).await {
            Some((code, message)) if code == codes::INVALID_PARAMETER_VALUE && message.contains("p_items") => {}
            other => wrong.push(format!("{sql} with p_items SQL NULL: {other:?}")),
        }
    }
    // An item built with SQL NULL in SQL itself, not only JSON null.
    let built = format!(
        "select * from agent.idempotency_claim_many('{ORG}', 'tool.x', 60000,
           jsonb_build_array($1::jsonb, jsonb_build_object('key', null::text, 'request_hash', repeat('a', 64),
                                                          'lease_token', gen_random_uuid())))"
    );
    match as_service(&mut conn, &built, Some(claim_item("k-0"))).await {
        Some((code, message)) if code == codes::INVALID_PARAMETER_VALUE && message.contains("p_items[1].key") => {}
        other => wrong.push(format!("an item built with SQL NULL: {other:?}")),
    }
    drop(conn);
    assert!(wrong.is_empty(), "{wrong:#?}");
    assert_eq!(count_rows(&stack).await, 0, "no refused batch wrote anything");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_batch_of_1001_against_a_cap_of_1000_is_refused_by_the_server_and_writes_nothing() {
    let stack = stack().await;
    let items: Vec<Value> = (0..1001).map(|i| claim_item(&format!("k-{i}"))).collect();
    let mut conn = stack.db().acquire().await.expect("a connection");
    let sql = format!("select * from agent.idempotency_claim_many('{ORG}', 'tool.x', 60000, $1::jsonb)");
    let refused = as_service(&mut conn, &sql, Some(json!(items))).await;
    assert!(
        matches!(&refused, Some((code, message)) if code == codes::INVALID_PARAMETER_VALUE && message.contains("got 1001")),
        "{refused:?}"
    );
    drop(conn);

    // Through the server, as curl or an Edge Function would send it.
    let answer = reqwest::Client::new()
        .post(format!("{}/rpc/idempotency_claim_many", stack.url()))
        .bearer_auth(stack.service_key())
        .header("apikey", stack.service_key())
        .header("Content-Profile", "agent")
        .json(&json!({"p_organization_id": ORG, "p_scope": "tool.x", "p_lease_ms": 60000, "p_items": items}))
        .send()
        .await
        .expect("an answer");
    let status = answer.status();
    let body: Value = answer.json().await.expect("a JSON error");
    assert_eq!((status.as_u16(), body["code"].as_str()), (400, Some(codes::INVALID_PARAMETER_VALUE)), "{body}");
    assert_eq!(count_rows(&stack).await, 0, "nothing written");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_batch_of_every_outcome_is_one_round_trip_each_way() {
    let stack = stack().await;
    let proxy = RpcProxy::start(stack.url()).await;
    let repo = PostgrestRepository::new(proxy.client(stack.service_key(), RetryConfig::disabled()));
    let org = Uuid::new_v4();
    let (h, other) = (hash("batch").as_str().to_owned(), hash("other").as_str().to_owned());
    let keys: Vec<String> = (0..100).map(|i| format!("k-{i}")).collect();
    let items: Vec<ClaimItem<'_>> = keys
        .iter()
        .map(|key| ClaimItem { key, request_hash: &h, lease_token: Uuid::new_v4(), request: None })
        .collect();
    fn many<'a>(org: Uuid, items: &'a [ClaimItem<'a>]) -> ClaimManyCall<'a> {
        ClaimManyCall { organization_id: org, scope: "tool.x", lease: LEASE, items }
    }
    let first = repo.claim_many(&many(org, &items[..50])).await.unwrap();
    let answer = json!({"ok": true});
    let completions: Vec<CompletionItem<'_>> = first[..25]
        .iter()
        .map(|row| CompletionItem {
            fence: ClaimFence { claim_id: row.id, lease_token: row.lease_token.expect("held") },
            completion: CompletionArgs { response: Some(&answer), ..CompletionArgs::default() },
        })
        .collect();
    repo.complete_many(org, &completions).await.unwrap();
    pass_lease(&stack, first[40].id).await;

    // 25 completed, 24 held by others, 1 orphan, 10 of another request, 40 new.
    let mut mixed: Vec<ClaimItem<'_>> =
        items.iter().map(|item| ClaimItem { lease_token: Uuid::new_v4(), ..*item }).collect();
    for item in &mut mixed[50..60] {
        item.request_hash = &other;
    }
    repo.claim_many(&many(org, &mixed[50..60])).await.unwrap();
    for item in &mut mixed[50..60] {
        item.request_hash = &h;
        item.lease_token = Uuid::new_v4();
    }
    let before = proxy.requests("idempotency_claim_many");
    let rows = repo.claim_many(&many(org, &mixed)).await.unwrap();
    assert_eq!(proxy.requests("idempotency_claim_many") - before, 1, "one round trip for 100 items");
    let count = |outcome| rows.iter().filter(|row| row.outcome == outcome).count();
    use ClaimDecision::*;
    assert_eq!(
        [count(Completed), count(Processing), count(Reclaimed), count(Conflict), count(Claimed)],
        [25, 24, 1, 10, 40]
    );
    assert_eq!(proxy.requests("idempotency_complete_many"), 1);
    stack.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_batches_over_the_same_keys_hold_each_key_once() {
    let stack = stack().await;
    let org = Uuid::new_v4();
    let h = hash("race").as_str().to_owned();
    let keys: Vec<String> = (0..200).map(|i| format!("k-{i}")).collect();
    let mut racers = Vec::new();
    for racer in 0..8usize {
        // No retries: batches over the same keys must not deadlock, which a
        // retried 40P01 would hide.
        let config = stack.client_config().expect("a config").with_retry(RetryConfig::disabled());
        let repo = PostgrestRepository::new(idempotency_plane::PostgrestClient::new(config).expect("a client"));
        let (keys, h) = (keys.clone(), h.clone());
        racers.push(tokio::spawn(async move {
            // Each racer takes the keys in its own order, so batches overlap
            // in every way (and lock rows in different orders).
            let mut order: Vec<&String> = keys.iter().collect();
            order.rotate_left(racer * 25);
            if racer % 2 == 1 {
                order.reverse();
            }
            let items: Vec<ClaimItem<'_>> = order
                .iter()
                .map(|key| ClaimItem { key, request_hash: &h, lease_token: Uuid::new_v4(), request: None })
                .collect();
            let call = ClaimManyCall { organization_id: org, scope: "tool.x", lease: LEASE, items: &items };
            let rows = repo.claim_many(&call).await.expect("a batch");
            rows.into_iter().filter(|row| row.outcome == ClaimDecision::Claimed).map(|row| row.key).collect::<Vec<_>>()
        }));
    }
    let mut held: Vec<String> = Vec::new();
    for racer in racers {
        held.extend(racer.await.expect("a racer"));
    }
    held.sort();
    let distinct = held.len();
    held.dedup();
    assert_eq!((distinct, held.len()), (200, 200), "each of 200 keys claimed by exactly one item of 8 racing batches");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_batch_claim_that_waited_on_another_transactions_insert_gets_its_whole_lease() {
    let stack = stack().await;
    let org = Uuid::new_v4();
    // Another transaction claims the key and holds its insert uncommitted.
    let mut other = stack.db().begin().await.expect("a transaction");
    let item = json!([{"key": "k-wait", "request_hash": "a".repeat(64), "lease_token": Uuid::new_v4()}]);
    sqlx::query("select * from agent.idempotency_claim_many($1, 'tool.x', 60000, $2)")
        .bind(org)
        .bind(&item)
        .execute(&mut *other)
        .await
        .expect("the other claim");
    let repo = PostgrestRepository::new(client(&stack));
    let hash = hash("wait").as_str().to_owned();
    let waiting = tokio::spawn(async move {
        let items = [ClaimItem { key: "k-wait", request_hash: &hash, lease_token: Uuid::new_v4(), request: None }];
        let call =
            ClaimManyCall { organization_id: org, scope: "tool.x", lease: Duration::from_secs(1), items: &items };
        repo.claim_many(&call).await
    });
    // Longer than the lease asked for: a lease stamped before the wait
    // would be over when the claim is answered.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    other.rollback().await.expect("a rollback");
    let rows = waiting.await.expect("the batch").expect("a claim");
    assert_eq!(rows[0].outcome, ClaimDecision::Claimed);
    assert!(rows[0].lease_live, "the lease starts when the wait ended: {:?}", rows[0]);
    let lease = rows[0].lease_expires_at - rows[0].claimed_at;
    assert_eq!(lease, chrono::TimeDelta::seconds(1));
    stack.stop().await.unwrap();
}
