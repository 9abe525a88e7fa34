//! `idem demo`: many workers race to send the same emails through the plane.
//!
//! Phases: a worker claims one key with a short lease, sends, and stalls;
//! meanwhile the pool proposes every effect several times, concurrently (one
//! of them reclaims the stalled key); the stalled worker wakes into the
//! fence; changed payloads are proposed under used keys; finally every key is
//! read back and compared with what the vendor made.
//!
//! It runs on the embedded local stack unless given `--remote`: an exported
//! `SUPABASE_URL` or `IDEM_POSTGREST_URL` is never reason enough to write
//! into a deployment.

use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idempotency_plane::local::LocalStackConfig;
use idempotency_plane::{ReadOutcome, RequestHash};
use rand::Rng;
use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;
use uuid::Uuid;

use crate::plane::{Plane, Service};
use crate::report::{KeyFindings, Report, Totals};
use crate::tally::Tally;
use crate::vendor::{Ledger, Vendor};
use crate::worker::{self, Shared, RESOURCE_TYPE, SCOPE};
use crate::{remote, signal, BoxError};

/// The effect whose first worker stalls past its lease.
const STALLED_KEY: usize = 0;

/// How many used keys are proposed again with a changed body.
const CHANGED_PAYLOADS: usize = 3;

/// Options of `idem demo`.
#[derive(Debug, clap::Args)]
#[command(after_long_help = "Runs on the embedded local stack, whatever SUPABASE_URL or IDEM_POSTGREST_URL say; \
    only --remote acts on the deployment they name, writing the demo's claims (scope tool.email.send, \
    a fresh organization id) into its agent schema.")]
pub(crate) struct DemoArgs {
    /// Run against the deployment IDEM_POSTGREST_URL / SUPABASE_URL and its
    /// service key name (IDEM_SERVICE_KEY, SUPABASE_SECRET_KEY or
    /// SUPABASE_SERVICE_ROLE_KEY) instead of the embedded local stack. Writes
    /// the demo's claims into that deployment.
    #[arg(long)]
    remote: bool,
    /// Concurrent workers.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..=512))]
    workers: u16,
    /// Distinct effects (idempotency keys) under scope tool.email.send.
    #[arg(long, default_value_t = 40, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    keys: u32,
    /// Tool calls proposed per effect: orchestrator retries, duplicate
    /// deliveries and fan-out, racing each other.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=100))]
    calls_per_key: u32,
    /// Lease of the stalled worker's claim, in milliseconds (the store accepts 1 s and up).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1000..=20_000))]
    stall_lease_ms: u64,
    /// How long the stalled worker sleeps after it sends, in milliseconds;
    /// must be longer than its lease.
    #[arg(long, default_value_t = 1500, value_parser = clap::value_parser!(u64).range(1..=60_000))]
    stall_ms: u64,
}

/// Runs the demo and prints its table. Exit code 2 when a check failed.
pub(crate) async fn run(args: DemoArgs) -> Result<ExitCode, BoxError> {
    if args.stall_ms <= args.stall_lease_ms {
        return Err(format!(
            "--stall-ms ({}) must be longer than --stall-lease-ms ({}), or nothing stalls past its lease",
            args.stall_ms, args.stall_lease_ms
        )
        .into());
    }
    let plane = if args.remote {
        // Refuses, naming what to set, when the environment names no deployment.
        Plane::Remote(Box::new(remote::config(&remote::Target::default())?))
    } else {
        Plane::Local(Box::new(crate::plane::start_local(LocalStackConfig::default()).await?))
    };
    println!("idem demo on the {}", plane.describe());
    let outcome = tokio::select! {
        report = scenario(&plane, &args) => report,
        signal = signal::shutdown() => Err(match signal {
            Ok(name) => format!("stopped by {name}").into(),
            Err(error) => error.into(),
        }),
    };
    let stopped = plane.shutdown().await;
    let report = outcome?;
    report.print();
    stopped?;
    Ok(if report.passed() {
        crate::exit::ok()
    } else {
        eprintln!("idem demo: a check failed");
        crate::exit::failure()
    })
}

async fn scenario(plane: &Plane, args: &DemoArgs) -> Result<Report, BoxError> {
    let keys = args.keys as usize;
    let vendor = Vendor::start().await?;
    let shared = Arc::new(Shared {
        service: plane.service()?,
        vendor: vendor.client()?,
        ledger: vendor.ledger(),
        organization_id: Uuid::new_v4(),
        tally: Tally::new(keys),
        takeover_done: Notify::new(),
        takeover_sent: Mutex::new(None),
    });
    let stall_lease = Duration::from_millis(args.stall_lease_ms);
    let stall = Duration::from_millis(args.stall_ms);
    let started = Instant::now();

    // The stalled worker claims first; the pool starts once it holds the key.
    let (claimed, holds_key) = oneshot::channel();
    let stalled = worker::stalled(&shared, STALLED_KEY, stall_lease, stall, claimed);
    let pool = async {
        holds_key.await.map_err(|_| "the stalled worker never claimed its key")?;
        let pool_shared = Arc::clone(&shared);
        worker::fan_out(usize::from(args.workers), jobs(keys, args.calls_per_key), move |index| {
            let shared = Arc::clone(&pool_shared);
            async move { worker::tool_call(&shared, index).await }
        })
        .await
    };
    let (stale, ()) = tokio::try_join!(stalled, pool)?;

    let mut changed_refused = 0;
    let changed = CHANGED_PAYLOADS.min(keys);
    for index in 0..changed {
        if worker::changed_payload(&shared, index).await? {
            changed_refused += 1;
        }
    }

    let completed = read_back(&shared.service, &shared.ledger, shared.organization_id, keys, args.workers).await?;
    let elapsed = started.elapsed();
    vendor.stop().await;

    let tally = &shared.tally;
    let mut findings = KeyFindings { completed, ..KeyFindings::default() };
    for index in 0..keys {
        let effects = shared.ledger.effects_for(&worker::recipient(index));
        let (executions, reclaims) = tally.of_key(index);
        findings.max_effects = findings.max_effects.max(effects);
        findings.without_effect += usize::from(effects == 0);
        findings.max_executions = findings.max_executions.max(executions);
        findings.unexplained_executions += usize::from(executions != 1 + reclaims);
    }
    let takeover = shared.takeover_sent.lock().unwrap_or_else(PoisonError::into_inner).clone();
    Ok(Report {
        organization_id: shared.organization_id,
        workers: args.workers,
        keys,
        calls_per_key: args.calls_per_key,
        stall_lease,
        stall,
        stalled_key: worker::effect_key(STALLED_KEY),
        totals: Totals {
            tool_calls: (keys as u64) * u64::from(args.calls_per_key) + 1 + changed as u64,
            attempts: Tally::get(&tally.attempts),
            executions: Tally::get(&tally.executions),
            vendor_messages: shared.ledger.messages() as u64,
            vendor_sends: shared.ledger.sends(),
            vendor_replayed_sends: shared.ledger.replayed_sends(),
            replays: Tally::get(&tally.replays),
            replay_mismatches: Tally::get(&tally.replay_mismatches),
            processing: Tally::get(&tally.processing),
            conflicts: Tally::get(&tally.conflicts),
            reclaims: Tally::get(&tally.reclaims),
            fenced: Tally::get(&tally.fenced),
        },
        findings,
        stale,
        takeover,
        changed,
        changed_refused,
        elapsed,
    })
}

/// Each effect `calls_per_key` times, loosely grouped by key so duplicates
/// race each other: a call lands within about three keys of its siblings.
fn jobs(keys: usize, calls_per_key: u32) -> Vec<usize> {
    let mut rng = rand::rng();
    let mut jobs: Vec<(f64, usize)> = (0..keys)
        .flat_map(|index| (0..calls_per_key).map(move |_| index))
        .map(|index| (index as f64 + rng.random_range(0.0..3.0), index))
        .collect();
    jobs.sort_by(|a, b| a.0.total_cmp(&b.0));
    jobs.into_iter().map(|(_, index)| index).collect()
}

/// Reads every key back with `read()` (which never writes) and counts those
/// completed with the message the vendor made for that key.
async fn read_back(
    service: &Service,
    ledger: &Arc<Ledger>,
    organization_id: Uuid,
    keys: usize,
    workers: u16,
) -> Result<usize, BoxError> {
    let completed = Arc::new(AtomicU64::new(0));
    let (service, ledger, counter) = (service.clone(), Arc::clone(ledger), Arc::clone(&completed));
    worker::fan_out(usize::from(workers), (0..keys).collect(), move |index| {
        let (service, ledger, counter) = (service.clone(), Arc::clone(&ledger), Arc::clone(&counter));
        async move {
            let key = worker::effect_key(index);
            let hash = RequestHash::of_json(&worker::effect_payload(index));
            let outcome = service.read(organization_id, SCOPE, &key, &hash).await?;
            if let ReadOutcome::Completed { resource: Some(resource), .. } = outcome {
                if resource.resource_type == RESOURCE_TYPE
                    && ledger.message_for(&key).as_deref() == Some(resource.resource_id.as_str())
                {
                    counter.fetch_add(1, Ordering::Relaxed);
                }
            }
            Ok::<(), BoxError>(())
        }
    })
    .await?;
    Ok(completed.load(Ordering::Relaxed) as usize)
}
