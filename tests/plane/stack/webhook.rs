//! The webhook gate's axum route over HTTP on the real stack (feature
//! `axum`, which `local` turns on). Every other decision of the gate is in
//! `crate::callers::webhook`, on both planes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use idempotency_plane::callers::http::provider_callback_router;
use idempotency_plane::callers::webhook::{ProcessingError, ProviderJobs};
use serde_json::{json, Value};

use crate::callers::webhook::gate;
use crate::support::harness::*;

#[tokio::test]
async fn the_axum_route_answers_a_redelivery_with_2xx_and_performs_nothing() {
    let stack = stack().await;
    let org = org();
    ProviderJobs::new(idempotency_plane::PostgrestRepository::new(client(&stack)))
        .register(org, "transcribe", "job-7")
        .await
        .unwrap();
    let performed = Arc::new(AtomicUsize::new(0));
    let counter = performed.clone();
    let verify = |_provider: &str, headers: &axum::http::HeaderMap, _body: &axum::body::Bytes| {
        headers.get("x-signature").is_some_and(|v| v == "valid")
    };
    let router = provider_callback_router(gate(&stack), verify, move |_job, _body| {
        let counter = counter.clone();
        async move {
            counter.fetch_add(1, Ordering::SeqCst);
            Ok(json!("stored"))
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/callbacks/transcribe/job-7", listener.local_addr().unwrap());
    let server = tokio::spawn(async move { axum::serve(listener, router).await });

    let http = reqwest::Client::new();
    let send = |id: Option<&'static str>, body: &'static str| {
        let mut request = http.post(&url).header("x-signature", "valid").body(body);
        if let Some(id) = id {
            request = request.header("webhook-id", id);
        }
        request.send()
    };
    let first = send(Some("evt-9"), r#"{"job_id":"job-7"}"#).await.unwrap();
    assert_eq!(first.status(), 200);
    assert_eq!(first.json::<Value>().await.unwrap(), json!({"ack": "processed"}));
    let redelivery = send(Some("evt-9"), r#"{"job_id":"job-7"}"#).await.unwrap();
    assert_eq!(redelivery.status(), 200);
    assert_eq!(redelivery.json::<Value>().await.unwrap(), json!({"ack": "dropped", "drop_reason": "duplicate"}));
    let mismatch = send(Some("evt-10"), r#"{"job_id":"job-8"}"#).await.unwrap();
    assert_eq!(mismatch.json::<Value>().await.unwrap()["drop_reason"], "job_mismatch");
    let anonymous = send(None, "{}").await.unwrap();
    assert_eq!(anonymous.status(), 400, "no delivery id, nothing to dedupe on");
    let numeric = send(Some("evt-11"), r#"{"job_id":8}"#).await.unwrap();
    assert_eq!(numeric.json::<Value>().await.unwrap()["drop_reason"], "job_mismatch");
    let rows_before_forgery = count_rows(&stack).await;
    let forged = http
        .post(&url)
        .header("webhook-id", "evt-12")
        .header("x-signature", "forged")
        .body(r#"{"job_id":"job-7"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(forged.status(), 401);
    assert_eq!(count_rows(&stack).await, rows_before_forgery, "a forged request claims nothing");
    assert_eq!(performed.load(Ordering::SeqCst), 1, "the redelivery performed nothing");
    server.abort();
    stack.stop().await.unwrap();
}

/// The route reads the body first, up to the gate's limit, before the
/// signature is checked: a correctly signed event just under the default
/// limit is taken and stored whole with its claim; a body above it is 413
/// whatever its signature (a forged one too: refused for its size, never
/// verified), by its Content-Length, unread.
#[tokio::test]
async fn the_axum_route_refuses_a_body_above_the_gate_limit_413_before_checking_its_signature() {
    use idempotency_plane::callers::webhook::DEFAULT_WEBHOOK_BODY_LIMIT;
    let stack = stack().await;
    let org = org();
    ProviderJobs::new(idempotency_plane::PostgrestRepository::new(client(&stack)))
        .register(org, "transcribe", "job-big")
        .await
        .unwrap();
    let verified = Arc::new(AtomicUsize::new(0));
    let verify = {
        let verified = verified.clone();
        move |_provider: &str, headers: &axum::http::HeaderMap, _body: &axum::body::Bytes| {
            verified.fetch_add(1, Ordering::SeqCst);
            headers.get("x-signature").is_some_and(|v| v == "valid")
        }
    };
    let gate = gate(&stack);
    assert_eq!(gate.body_limit(), DEFAULT_WEBHOOK_BODY_LIMIT);
    // While its processing runs, the claim carries the body as its work
    // (a success drops it; a failure keeps it for a re-run after a fix).
    let seen_work: Arc<std::sync::Mutex<Option<(Value, i64)>>> = Arc::default();
    let (db, seen) = (stack.db().clone(), seen_work.clone());
    let router = provider_callback_router(gate, verify, move |_job, body: axum::body::Bytes| {
        let (db, seen) = (db.clone(), seen.clone());
        async move {
            let stored: (Value, i64) = sqlx::query_as(
                "select request, octet_length(request::text)::int8 from agent.idempotency_keys where key = 'evt-big-1'",
            )
            .fetch_one(&db)
            .await
            .map_err(|error| ProcessingError::retryable(error.to_string()))?;
            *seen.lock().unwrap() = Some(stored);
            Ok(json!({"bytes": body.len()}))
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/callbacks/transcribe/job-big", listener.local_addr().unwrap());
    let server = tokio::spawn(async move { axum::serve(listener, router).await });
    let http = reqwest::Client::new();
    let send = |id: &str, signature: &str, body: Vec<u8>| {
        http.post(&url).header("webhook-id", id).header("x-signature", signature).body(body).send()
    };

    // Just under the limit (and above the 104 KB that 64 KiB refused).
    let mut event = br#"{"job_id":"job-big","text":""#.to_vec();
    event.resize(DEFAULT_WEBHOOK_BODY_LIMIT - 2, b'w');
    event.extend_from_slice(br#""}"#);
    assert_eq!(event.len(), DEFAULT_WEBHOOK_BODY_LIMIT);
    let taken = send("evt-big-1", "valid", event.clone()).await.unwrap();
    assert_eq!(taken.status(), 200);
    assert_eq!(taken.json::<Value>().await.unwrap(), json!({"ack": "processed"}));
    let (stored, stored_bytes) = seen_work.lock().unwrap().take().expect("the work, read while processing ran");
    let text = stored["body_text"].as_str().expect("JSON text is stored as text");
    assert_eq!(text.as_bytes(), event.as_slice(), "the very bytes, stored with the claim");
    assert!(stored_bytes > 256 * 1024, "the whole body: {stored_bytes} bytes");
    let kept: Option<Value> = sqlx::query_scalar("select request from agent.idempotency_keys where key = 'evt-big-1'")
        .fetch_one(stack.db())
        .await
        .unwrap();
    assert_eq!(kept, None, "the work is dropped once the success is journaled");
    let again = send("evt-big-1", "valid", event.clone()).await.unwrap();
    assert_eq!(again.json::<Value>().await.unwrap(), json!({"ack": "dropped", "drop_reason": "duplicate"}));
    assert_eq!(verified.load(Ordering::SeqCst), 2);

    // One byte over, signed or forged: 413 for its size, the signature unchecked.
    let rows = count_rows(&stack).await;
    let mut over = event.clone();
    over.insert(30, b'w');
    for (id, signature) in [("evt-big-2", "valid"), ("evt-big-3", "forged")] {
        let refused = send(id, signature, over.clone()).await.unwrap();
        assert_eq!(refused.status(), 413, "{signature}: refused before its signature is checked (not 401)");
        let answer = refused.json::<Value>().await.unwrap();
        assert_eq!(answer["ack"], "rejected");
        assert_eq!(answer["reason"], "body_too_large");
        assert_eq!(
            answer["error"],
            format!("the body is larger than this endpoint reads ({DEFAULT_WEBHOOK_BODY_LIMIT} bytes)")
        );
    }
    assert_eq!(verified.load(Ordering::SeqCst), 2, "no body above the limit reached the verifier");
    assert_eq!(count_rows(&stack).await, rows, "and none was claimed");
    // A forged body within the limit is still 401.
    let forged = send("evt-big-4", "forged", b"{}".to_vec()).await.unwrap();
    assert_eq!(forged.status(), 401);
    server.abort();
    stack.stop().await.unwrap();
}
