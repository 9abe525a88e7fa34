//! Running a scenario: workers looping an operation for a while, and two
//! scenarios in alternating segments, each on a pool of its own.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency_plane::{IdempotencyService, PostgrestRepository};
use sqlx::PgPool;

use crate::BoxError;

/// The service every scenario over the crate shares.
pub(super) type Service = Arc<IdempotencyService<PostgrestRepository>>;

/// Runs `op(worker, i)` on `workers` tasks until `duration` passes; answers
/// every latency.
pub(super) async fn drive<F, Fut>(
    workers: usize,
    duration: Duration,
    op: F,
) -> Result<(Vec<Duration>, Duration), BoxError>
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), BoxError>> + Send,
{
    let op = Arc::new(op);
    let started = Instant::now();
    let tasks: Vec<_> = (0..workers)
        .map(|worker| {
            let op = op.clone();
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut i = 0u64;
                while started.elapsed() < duration {
                    let t = Instant::now();
                    op(worker, i).await?;
                    latencies.push(t.elapsed());
                    i += 1;
                }
                Ok::<_, BoxError>(latencies)
            })
        })
        .collect();
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await??);
    }
    Ok((all, started.elapsed()))
}

/// Segments each of two scenarios compared side by side runs, alternating
/// (ABBA), so that a machine whose speed drifts during the run weighs on
/// both alike.
pub(super) const SEGMENTS: u32 = 4;

/// Latencies and elapsed time of one run of a scenario.
pub(super) type Run = (Vec<Duration>, Duration);

/// Runs two scenarios in alternating segments (ABBA…), so that the
/// machine's drift weighs on both alike: `segment(first, round)` runs
/// segment `round` of the first scenario when `first`, else of the second.
/// Answers both totals.
pub(super) async fn alternating<F, Fut>(mut segment: F) -> Result<(Run, Run), BoxError>
where
    F: FnMut(bool, u32) -> Fut,
    Fut: std::future::Future<Output = Result<Run, BoxError>>,
{
    let (mut first_total, mut second_total) = ((Vec::new(), Duration::ZERO), (Vec::new(), Duration::ZERO));
    for round in 0..SEGMENTS {
        for first in [round % 2 == 0, round % 2 == 1] {
            let (latencies, elapsed) = segment(first, round).await?;
            let total = if first { &mut first_total } else { &mut second_total };
            total.0.extend(latencies);
            total.1 += elapsed;
        }
    }
    Ok((first_total, second_total))
}

/// A pool of its own on the stack's database.
pub(super) async fn own_pool(db: &PgPool) -> Result<PgPool, BoxError> {
    let options = db.connect_options().as_ref().clone();
    Ok(sqlx::postgres::PgPoolOptions::new().max_connections(20).connect_with(options).await?)
}
