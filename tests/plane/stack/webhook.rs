//! The webhook gate's axum route over HTTP on the real stack (feature
//! `axum`, which `local` turns on). Every other decision of the gate is in
//! `crate::callers::webhook`, on both planes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use idempotency_plane::callers::http::provider_callback_router;
use idempotency_plane::callers::webhook::ProviderJobs;
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
