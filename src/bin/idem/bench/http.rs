//! Claim → complete pairs over HTTP: through the crate, and from a bare
//! HTTP client sending the same two calls.

use std::time::Duration;

use idempotency_plane::local::LocalStack;
use idempotency_plane::{ClaimOutcome, Completion, RequestHash};
use serde_json::{json, Value};
use uuid::Uuid;

use super::drive::{drive, Service};
use super::figure::Figure;
use crate::BoxError;

pub(super) async fn pairs_through_crate(
    service: Service,
    workers: usize,
    duration: Duration,
) -> Result<Figure, BoxError> {
    let org = Uuid::new_v4();
    let hash = RequestHash::of_json(&json!({"bench": true}));
    let (latencies, elapsed) = drive(workers, duration, move |worker, i| {
        let (service, hash) = (service.clone(), hash.clone());
        async move {
            let key = format!("crate-{worker}-{i}");
            let ClaimOutcome::Claimed(claim) =
                service.claim(org, "tool.bench", &key, &hash, Duration::from_secs(60)).await?
            else {
                return Err("a fresh key was not claimed".into());
            };
            let _ = service.complete(&claim, Completion::response(json!({"ok": true}))).await?;
            Ok(())
        }
    })
    .await?;
    Ok(Figure::from("pairs via crate", latencies, elapsed))
}

pub(super) async fn pairs_bare_http(
    stack: &LocalStack,
    workers: usize,
    duration: Duration,
) -> Result<Figure, BoxError> {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert("authorization", format!("Bearer {}", stack.service_key()).parse()?);
    headers.insert("content-profile", "agent".parse()?);
    headers.insert("content-type", "application/json".parse()?);
    let http = reqwest::Client::builder()
        .default_headers(headers)
        .pool_max_idle_per_host(workers)
        .tcp_nodelay(true)
        .build()?;
    let claim_url = format!("{}/rpc/idempotency_claim", stack.url());
    let complete_url = format!("{}/rpc/idempotency_complete", stack.url());
    let org = Uuid::new_v4();
    let hash = RequestHash::of_json(&json!({"bench": true})).as_str().to_owned();
    let (latencies, elapsed) = drive(workers, duration, move |worker, i| {
        let (http, claim_url, complete_url) = (http.clone(), claim_url.clone(), complete_url.clone());
        let token = Uuid::new_v4();
        let body = format!(
            r#"{{"p_organization_id":"{org}","p_scope":"tool.bench","p_key":"bare-{worker}-{i}","p_request_hash":"{hash}","p_lease_token":"{token}","p_lease_ms":60000}}"#
        );
        async move {
            let rows: Vec<Value> = http.post(&claim_url).body(body).send().await?.error_for_status()?.json().await?;
            let id = rows.first().and_then(|r| r["id"].as_str()).ok_or("no claim")?.to_owned();
            let done = format!(r#"{{"p_claim_id":"{id}","p_lease_token":"{token}","p_response":{{"ok":true}}}}"#);
            http.post(&complete_url).body(done).send().await?.error_for_status()?.bytes().await?;
            Ok(())
        }
    })
    .await?;
    Ok(Figure::from("pairs via bare HTTP", latencies, elapsed))
}
