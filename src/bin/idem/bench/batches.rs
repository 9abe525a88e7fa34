//! What batches buy: claims per second and round trips for batches of 1, 10
//! and 100 first claims, through the crate and from a bare HTTP client.

use std::sync::Arc;
use std::time::Duration;

use idempotency_plane::local::LocalStack;
use idempotency_plane::repo::{BatchClaims, ClaimItem, ClaimManyCall};
use idempotency_plane::{PostgrestClient, PostgrestRepository, RequestHash};
use serde_json::{json, Value};
use uuid::Uuid;

use super::drive::drive;
use super::work::{measure, Measure};
use crate::BoxError;

/// The batch sizes compared.
pub(super) const SIZES: [usize; 3] = [1, 10, 100];

/// For each of [`SIZES`]: first claims per second in batches of that size,
/// through the crate and from a bare HTTP client, and the HTTP requests
/// each batch took through the crate.
pub(super) async fn batch_claims(
    stack: &LocalStack,
    client: &PostgrestClient,
    workers: usize,
    duration: Duration,
) -> Result<Vec<Measure>, BoxError> {
    let repo = Arc::new(PostgrestRepository::new(client.clone()));
    let hash = RequestHash::of_json(&json!({"bench": "batch"})).as_str().to_owned();
    let mut measures = Vec::new();
    for size in SIZES {
        let org = Uuid::new_v4();
        let before = client.requests_sent();
        let (repo, hash_) = (repo.clone(), hash.clone());
        let (latencies, elapsed) = drive(workers, duration, move |worker, i| {
            let (repo, hash) = (repo.clone(), hash_.clone());
            async move {
                let keys: Vec<String> = (0..size).map(|n| format!("crate-{worker}-{i}-{n}")).collect();
                let items: Vec<ClaimItem<'_>> = keys
                    .iter()
                    .map(|key| ClaimItem { key, request_hash: &hash, lease_token: Uuid::new_v4(), request: None })
                    .collect();
                let call = ClaimManyCall {
                    organization_id: org,
                    scope: "tool.bench",
                    lease: Duration::from_secs(60),
                    items: &items,
                };
                let rows = repo.claim_many(&call).await?;
                if rows.len() != size {
                    return Err("a batch answered another number of rows".into());
                }
                Ok(())
            }
        })
        .await?;
        let batches = latencies.len() as f64;
        let trips = (client.requests_sent() - before) as f64 / batches.max(1.0);
        measures.push(measure(
            &format!("claims/s, batches of {size}, crate"),
            batches * size as f64 / elapsed.as_secs_f64(),
            "/s",
        ));
        measures.push(measure(&format!("round trips per batch of {size}, crate"), trips, "HTTP"));
        let bare = bare_http(stack, workers, duration, size, &hash).await?;
        measures.push(measure(&format!("claims/s, batches of {size}, bare HTTP"), bare, "/s"));
    }
    Ok(measures)
}

/// First claims per second in batches of `size` from a bare HTTP client:
/// one `POST /rpc/idempotency_claim_many` per batch.
async fn bare_http(
    stack: &LocalStack,
    workers: usize,
    duration: Duration,
    size: usize,
    hash: &str,
) -> Result<f64, BoxError> {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert("authorization", format!("Bearer {}", stack.service_key()).parse()?);
    headers.insert("content-profile", "agent".parse()?);
    headers.insert("content-type", "application/json".parse()?);
    let http = reqwest::Client::builder()
        .default_headers(headers)
        .pool_max_idle_per_host(workers)
        .tcp_nodelay(true)
        .build()?;
    let url = format!("{}/rpc/idempotency_claim_many", stack.url());
    let org = Uuid::new_v4();
    let hash = hash.to_owned();
    let (latencies, elapsed) = drive(workers, duration, move |worker, i| {
        let (http, url) = (http.clone(), url.clone());
        let items: Vec<Value> = (0..size)
            .map(|n| json!({"key": format!("bare-{worker}-{i}-{n}"), "request_hash": hash, "lease_token": Uuid::new_v4()}))
            .collect();
        let body = json!({"p_organization_id": org, "p_scope": "tool.bench", "p_lease_ms": 60000, "p_items": items});
        async move {
            let rows: Vec<Value> = http.post(&url).json(&body).send().await?.error_for_status()?.json().await?;
            if rows.len() != size {
                return Err("a batch answered another number of rows".into());
            }
            Ok(())
        }
    })
    .await?;
    Ok(latencies.len() as f64 * size as f64 / elapsed.as_secs_f64())
}
