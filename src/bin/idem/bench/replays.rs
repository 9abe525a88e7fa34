//! Replays and conflicts on completed keys (with and without the replay
//! cache), and the HTTP round trips of every claim outcome.

use std::sync::Arc;
use std::time::Duration;

use idempotency_plane::local::LocalStack;
use idempotency_plane::{
    ClaimOutcome, Completion, IdempotencyService, PostgrestClient, PostgrestRepository, RequestHash,
};
use serde_json::json;
use uuid::Uuid;

use super::drive::{drive, Run, Service};
use super::figure::Figure;
use super::rows::expire_leases;
use crate::BoxError;

/// Replays and conflicts on completed keys, and the round trips of each path
/// (first claim, replay, conflict, reclaim) read off the client's counter.
pub(super) async fn replays_and_conflicts(
    stack: &LocalStack,
    client: &PostgrestClient,
    service: Service,
    workers: usize,
    duration: Duration,
) -> Result<(Figure, Figure, Figure, Vec<(String, f64)>), BoxError> {
    let org = Uuid::new_v4();
    let hash = RequestHash::of_json(&json!({"bench": "replay"}));
    let other = RequestHash::of_json(&json!({"bench": "other"}));
    let keys = 256u64;
    let mut trips = Vec::new();

    let before = client.requests_sent();
    for k in 0..keys {
        let ClaimOutcome::Claimed(claim) =
            service.claim(org, "tool.bench", &format!("replay-{k}"), &hash, Duration::from_secs(60)).await?
        else {
            return Err("fresh key not claimed".into());
        };
        let _ = service.complete(&claim, Completion::response(json!({"k": k}))).await?;
    }
    // Each pair was one claim and one complete.
    trips.push(("first claim".to_owned(), (client.requests_sent() - before) as f64 / keys as f64 - 1.0));

    // Replays of each key, through `service`.
    let replays = |service: Service| {
        let is_replay = |outcome: &ClaimOutcome| matches!(outcome, ClaimOutcome::Completed { .. });
        claims_of_completed_keys(service, client, (org, &hash, keys), (workers, duration), is_replay, "a replay")
    };
    let replay = {
        let (run, per_claim) = replays(service.clone()).await?;
        trips.push(("replay".to_owned(), per_claim));
        Figure::from("replay", run.0, run.1)
    };
    let conflict = {
        let (run, per_claim) = claims_of_completed_keys(
            service.clone(),
            client,
            (org, &other, keys),
            (workers, duration),
            |outcome| matches!(outcome, ClaimOutcome::Conflict),
            "a conflict",
        )
        .await?;
        trips.push(("conflict".to_owned(), per_claim));
        Figure::from("conflict", run.0, run.1)
    };

    // The same replays through a service with a replay cache.
    let cached = {
        let service = Arc::new(IdempotencyService::new(PostgrestRepository::new(client.clone())).with_replay_cache(
            10_000,
            64 << 20,
            Duration::from_secs(60),
        ));
        for k in 0..keys {
            let _ = service.read(org, "tool.bench", &format!("replay-{k}"), &hash).await?;
        }
        let (run, per_claim) = replays(service.clone()).await?;
        trips.push(("replay, cached".to_owned(), per_claim));
        if let Some((entries, bytes)) = service.replay_cache_stats() {
            trips.push(("cache bytes per entry".to_owned(), bytes as f64 / entries.max(1) as f64));
        }
        Figure::from("replay, cache hit", run.0, run.1)
    };

    // Claims in flight: processing, answered to every other caller.
    let service = IdempotencyService::new(PostgrestRepository::new(client.clone()));
    let mut ids = Vec::new();
    for k in 0..64u64 {
        if let ClaimOutcome::Claimed(claim) =
            service.claim(org, "tool.bench", &format!("reclaim-{k}"), &hash, Duration::from_secs(60)).await?
        {
            ids.push(claim.id());
        }
    }
    let before = client.requests_sent();
    for k in 0..ids.len() {
        match service.claim(org, "tool.bench", &format!("reclaim-{k}"), &hash, Duration::from_secs(60)).await? {
            ClaimOutcome::Processing { .. } => {}
            other => return Err(format!("expected processing, got {}", other.kind()).into()),
        }
    }
    trips.push(("processing".to_owned(), (client.requests_sent() - before) as f64 / ids.len().max(1) as f64));

    // Reclaims: the same claims once their lease passed, taken over once each.
    expire_leases(stack.db(), &ids).await?;
    let before = client.requests_sent();
    for k in 0..ids.len() {
        match service.claim(org, "tool.bench", &format!("reclaim-{k}"), &hash, Duration::from_secs(60)).await? {
            ClaimOutcome::Claimed(claim) if claim.reclaimed() => {}
            other => return Err(format!("expected a reclaim, got {}", other.kind()).into()),
        }
    }
    trips.push(("reclaim".to_owned(), (client.requests_sent() - before) as f64 / ids.len().max(1) as f64));
    Ok((replay, conflict, cached, trips))
}

/// Claims of the completed keys `replay-0` to `replay-<keys - 1>` of `org`
/// with `request`, on `workers` tasks for `duration`: each must answer as
/// `wanted` says (else an error naming `expected`). Answers the run and the
/// HTTP requests `client` sent per claim.
async fn claims_of_completed_keys(
    service: Service,
    client: &PostgrestClient,
    (org, request, keys): (Uuid, &RequestHash, u64),
    (workers, duration): (usize, Duration),
    wanted: fn(&ClaimOutcome) -> bool,
    expected: &'static str,
) -> Result<(Run, f64), BoxError> {
    let request = request.clone();
    let before = client.requests_sent();
    let (latencies, elapsed) = drive(workers, duration, move |_, i| {
        let (service, request) = (service.clone(), request.clone());
        async move {
            let outcome = service
                .claim(org, "tool.bench", &format!("replay-{}", i % keys), &request, Duration::from_secs(60))
                .await?;
            if wanted(&outcome) {
                Ok(())
            } else {
                Err(format!("expected {expected}, got {}", outcome.kind()).into())
            }
        }
    })
    .await?;
    let per_claim = (client.requests_sent() - before) as f64 / latencies.len().max(1) as f64;
    Ok(((latencies, elapsed), per_claim))
}
