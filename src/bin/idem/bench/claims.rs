//! First claims alone: idle, while a sweep deletes expired rows, and on a
//! table grown large.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency_plane::local::LocalStack;
use idempotency_plane::sweeper::Sweeper;
use idempotency_plane::{ClaimOutcome, PostgrestClient, RequestHash};
use serde_json::json;
use uuid::Uuid;

use super::drive::drive;
use super::drive::Service;
use super::figure::Figure;
use super::rows::insert_expired;
use crate::BoxError;

/// First claims of fresh keys on `workers` tasks for `duration`.
pub(super) async fn claims(
    service: Service,
    workers: usize,
    duration: Duration,
    name: &str,
) -> Result<Figure, BoxError> {
    let org = Uuid::new_v4();
    let hash = RequestHash::of_json(&json!({"bench": "claims"}));
    let label = name.replace(' ', "-");
    let (latencies, elapsed) = drive(workers, duration, move |worker, i| {
        let (service, hash, label) = (service.clone(), hash.clone(), label.clone());
        async move {
            let key = format!("{label}-{worker}-{i}");
            match service.claim(org, "tool.bench", &key, &hash, Duration::from_secs(60)).await? {
                ClaimOutcome::Claimed(_) => Ok(()),
                other => Err(format!("expected a claim, got {}", other.kind()).into()),
            }
        }
    })
    .await?;
    Ok(Figure::from(name, latencies, elapsed))
}

/// First claims on `workers` tasks for as long as a sweep deletes a backlog
/// of `sweep_rows` expired rows (inserted first), one bounded pass after
/// another.
pub(super) async fn claims_during_sweep(
    stack: &LocalStack,
    client: &PostgrestClient,
    service: Service,
    workers: usize,
    sweep_rows: i64,
    name: &str,
) -> Result<Figure, BoxError> {
    insert_expired(stack.db(), sweep_rows).await?;
    let sweeper = Sweeper::new(client.clone(), u64::from(client.config().max_rows()))?;
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let finished = done.clone();
    let sweeping = tokio::spawn(async move {
        let started = Instant::now();
        let mut deleted = 0;
        let result = loop {
            match sweeper.pass().await {
                Ok(report) => {
                    deleted += report.deleted;
                    if !report.filled {
                        break Ok((deleted, started.elapsed()));
                    }
                }
                Err(error) => break Err(BoxError::from(error)),
            }
        };
        finished.store(true, std::sync::atomic::Ordering::SeqCst);
        result
    });
    // Measure for as long as the sweep runs (at least a second).
    let sweep_started = Instant::now();
    let org = Uuid::new_v4();
    let hash = RequestHash::of_json(&json!({"bench": "during sweep"}));
    let mut latencies = Vec::new();
    let workers: Vec<_> = (0..workers)
        .map(|worker| {
            let (service, hash) = (service.clone(), hash.clone());
            let done = done.clone();
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut i = 0;
                while !done.load(std::sync::atomic::Ordering::SeqCst) {
                    let t = Instant::now();
                    let key = format!("during-{worker}-{i}");
                    match service.claim(org, "tool.bench", &key, &hash, Duration::from_secs(60)).await? {
                        ClaimOutcome::Claimed(_) => latencies.push(t.elapsed()),
                        other => return Err(format!("expected a claim, got {}", other.kind()).into()),
                    }
                    i += 1;
                }
                Ok::<_, BoxError>(latencies)
            })
        })
        .collect();
    for worker in workers {
        latencies.extend(worker.await??);
    }
    let (deleted, swept_in) = sweeping.await??;
    eprintln!("  the sweep deleted {deleted} rows in {:.1} s", swept_in.as_secs_f64());
    Ok(Figure::from(name, latencies, sweep_started.elapsed()))
}
