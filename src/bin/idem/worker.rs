//! One worker's job: propose a tool call (send one email) through the plane.
//!
//! The tool path of the spec, reduced to the plane: hash the request, claim
//! the key, and on `Claimed` call the vendor with the key as its
//! `Idempotency-Key`, then complete with the message. `Completed` is a replay,
//! `Processing` is retried after a backoff the way an orchestrator reruns a
//! step that raised `ClaimInFlight`, and `Conflict` is refused content.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idempotency_plane::{ClaimOutcome, Completion, Ending, RequestHash};
use rand::Rng;
use serde_json::{json, Value};
use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;
use uuid::Uuid;

use crate::plane::Service;
use crate::tally::Tally;
use crate::vendor::{Ledger, Sent, VendorClient};
use crate::BoxError;

/// The scope every demo effect is claimed under.
pub(crate) const SCOPE: &str = "tool.email.send";

/// The resource type a completion records.
pub(crate) const RESOURCE_TYPE: &str = "demo.message";

/// An ordinary worker's lease: the vendor timeout (5 s) plus a margin.
pub(crate) const LEASE: Duration = Duration::from_secs(15);

/// Backoff between `Processing` answers: doubles from the first to the cap,
/// plus up to half again of jitter.
const BACKOFF_FIRST: Duration = Duration::from_millis(20);
const BACKOFF_CAP: Duration = Duration::from_millis(250);

/// A key still in flight after this long is an error, not a wait.
const IN_FLIGHT_LIMIT: Duration = Duration::from_secs(30);

/// The stalled worker waits at most this long for another worker to take
/// its key over before it wakes anyway.
const TAKEOVER_WAIT: Duration = Duration::from_secs(20);

/// The idempotency key of effect `index`: stable per Run step, never a model
/// tool-call id.
pub(crate) fn effect_key(index: usize) -> String {
    format!("run-{index:04}:step-2:send-welcome-email")
}

/// The recipient of effect `index`; unique per effect.
pub(crate) fn recipient(index: usize) -> String {
    format!("user{index:04}@example.com")
}

/// The request of effect `index`.
pub(crate) fn effect_payload(index: usize) -> Value {
    json!({
        "to": recipient(index),
        "subject": "Welcome aboard",
        "body": format!("Hello user {index}, your workspace is ready."),
    })
}

/// What every worker shares.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) service: Service,
    pub(crate) vendor: VendorClient,
    pub(crate) ledger: Arc<Ledger>,
    pub(crate) organization_id: Uuid,
    pub(crate) tally: Tally,
    /// Signalled once a reclaimer has completed a key it took over.
    pub(crate) takeover_done: Notify,
    /// What the vendor answered the reclaimer.
    pub(crate) takeover_sent: Mutex<Option<Sent>>,
}

/// One proposed tool call for effect `index`, retried while another worker
/// holds the key, until it executes, replays, or is refused.
pub(crate) async fn tool_call(shared: &Shared, index: usize) -> Result<(), BoxError> {
    let tally = &shared.tally;
    let key = effect_key(index);
    let payload = effect_payload(index);
    let hash = RequestHash::of_json(&payload);
    let deadline = Instant::now() + IN_FLIGHT_LIMIT;
    let mut backoff = BACKOFF_FIRST;
    loop {
        Tally::bump(&tally.attempts);
        let outcome = shared.service.claim(shared.organization_id, SCOPE, &key, &hash, LEASE).await?;
        match outcome {
            ClaimOutcome::Claimed(claim) => {
                tally.executed(index, claim.reclaimed());
                let sent = match shared.vendor.send(claim.key(), &payload).await {
                    Ok(sent) => sent,
                    Err(error) => {
                        // No effect was observed: release, so a retry executes.
                        if let Err(release) = shared.service.release(&claim).await {
                            tracing::warn!(%release, "releasing after a vendor failure");
                        }
                        return Err(error);
                    }
                };
                let completion = Completion::response(json!({ "message_id": sent.id }))
                    .with_resource(RESOURCE_TYPE, sent.id.as_str());
                if shared.service.complete(&claim, completion).await? == Ending::LeaseMovedOn {
                    Tally::bump(&tally.fenced);
                }
                if claim.reclaimed() {
                    *shared.takeover_sent.lock().unwrap_or_else(PoisonError::into_inner) = Some(sent);
                    shared.takeover_done.notify_one();
                }
                return Ok(());
            }
            ClaimOutcome::Completed { resource, .. } => {
                Tally::bump(&tally.replays);
                let replayed = resource.map(|r| r.resource_id);
                if replayed.is_none() || replayed != shared.ledger.message_for(&key) {
                    Tally::bump(&tally.replay_mismatches);
                }
                return Ok(());
            }
            ClaimOutcome::Processing { .. } => {
                Tally::bump(&tally.processing);
                if Instant::now() >= deadline {
                    return Err(format!("{key} was still in flight after {IN_FLIGHT_LIMIT:?} of retries").into());
                }
                let jitter = rand::rng().random_range(0..=backoff.as_millis() as u64 / 2);
                tokio::time::sleep(backoff + Duration::from_millis(jitter)).await;
                backoff = (backoff * 2).min(BACKOFF_CAP);
            }
            ClaimOutcome::Conflict => {
                Tally::bump(&tally.conflicts);
                return Ok(());
            }
        }
    }
}

/// Proposes effect `index` again with a changed body under its used key.
/// True when the plane refused it (`Conflict`), as it must.
pub(crate) async fn changed_payload(shared: &Shared, index: usize) -> Result<bool, BoxError> {
    let mut payload = effect_payload(index);
    payload["subject"] = json!("Welcome aboard (edited)");
    let hash = RequestHash::of_json(&payload);
    Tally::bump(&shared.tally.attempts);
    let outcome = shared.service.claim(shared.organization_id, SCOPE, &effect_key(index), &hash, LEASE).await?;
    match outcome {
        ClaimOutcome::Conflict => {
            Tally::bump(&shared.tally.conflicts);
            Ok(true)
        }
        ClaimOutcome::Claimed(claim) => {
            // A plane that let this through must not keep the key either.
            let _ = shared.service.release(&claim).await?;
            Ok(false)
        }
        _ => Ok(false),
    }
}

/// What the stalled worker's late endings answered.
#[derive(Debug, Clone)]
pub(crate) struct StaleEndings {
    /// The message the stalled worker made before it stalled.
    pub(crate) sent: Sent,
    /// Its `complete()` after waking.
    pub(crate) complete: Ending,
    /// Its `release()` after that.
    pub(crate) release: Ending,
}

/// A worker that claims effect `index` with a short `lease`, sends, and then
/// stalls for `stall` before it completes: the crash-after-vendor-success
/// case. `claimed` fires once it holds the key.
///
/// After the stall it also waits (bounded) until another worker has
/// reclaimed and completed the key, so the fence is exercised even on a slow
/// server; then it wakes and tries both endings with its stale token.
pub(crate) async fn stalled(
    shared: &Shared,
    index: usize,
    lease: Duration,
    stall: Duration,
    claimed: oneshot::Sender<()>,
) -> Result<StaleEndings, BoxError> {
    let key = effect_key(index);
    let payload = effect_payload(index);
    let hash = RequestHash::of_json(&payload);
    Tally::bump(&shared.tally.attempts);
    let outcome = shared.service.claim(shared.organization_id, SCOPE, &key, &hash, lease).await?;
    let ClaimOutcome::Claimed(claim) = outcome else {
        return Err(format!("the stalled worker expected a fresh claim, got {}", outcome.kind()).into());
    };
    shared.tally.executed(index, claim.reclaimed());
    let sent = shared.vendor.send(claim.key(), &payload).await?;
    let _ = claimed.send(());

    tokio::time::sleep(stall).await;
    if tokio::time::timeout(TAKEOVER_WAIT, shared.takeover_done.notified()).await.is_err() {
        tracing::warn!(%key, "no worker took the stalled key over; waking anyway");
    }

    let completion = Completion::response(json!({ "message_id": sent.id, "stale": true }))
        .with_resource(RESOURCE_TYPE, sent.id.as_str());
    let complete = shared.service.complete(&claim, completion).await?;
    let release = shared.service.release(&claim).await?;
    for ending in [complete, release] {
        if ending == Ending::LeaseMovedOn {
            Tally::bump(&shared.tally.fenced);
        }
    }
    Ok(StaleEndings { sent, complete, release })
}

/// Runs `job` over `jobs` on `workers` concurrent tasks, in order of the
/// list. The first error stops the rest and is returned.
pub(crate) async fn fan_out<J, F, Fut>(workers: usize, jobs: Vec<usize>, job: J) -> Result<(), BoxError>
where
    J: Fn(usize) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<F, BoxError>> + Send + 'static,
    F: Send + 'static,
{
    let queue = Arc::new(Mutex::new(jobs.into_iter()));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..workers.max(1) {
        let queue = Arc::clone(&queue);
        let job = job.clone();
        tasks.spawn(async move {
            loop {
                let next = queue.lock().unwrap_or_else(PoisonError::into_inner).next();
                let Some(index) = next else {
                    return Ok::<(), BoxError>(());
                };
                job(index).await?;
            }
        });
    }
    while let Some(joined) = tasks.join_next().await {
        joined??;
    }
    Ok(())
}
