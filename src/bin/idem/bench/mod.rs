//! `idem bench`: the plane's cost, side by side in one run on one database.
//!
//! Absolute times on a shared machine are noise; the ratios between rows
//! measured in the same run are the result. Every figure is also written as
//! JSON. Not a test: nothing here asserts a timing.
//!
//! One file per group of scenarios (`http`: pairs through the crate and from
//! a bare HTTP client; `sql`: the functions over direct connections; `floor`:
//! the plain statements they are measured against; `replays`: replays,
//! conflicts and round trips; `claims`: first claims idle, during a sweep,
//! on a large table; `wan`: each outcome over a slow link), `drive` to run
//! them, `rows` for the rows they set up directly, and `report` for the
//! figures and ratios.

mod claims;
mod drive;
mod floor;
mod http;
mod replays;
mod report;
mod rows;
mod sql;
mod wan;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use idempotency_plane::local::{LocalStack, LocalStackConfig};
use idempotency_plane::{IdempotencyService, PostgrestClient, PostgrestRepository};

use self::claims::{claims, claims_during_sweep};
use self::http::{pairs_bare_http, pairs_through_crate};
use self::replays::replays_and_conflicts;
use self::report::{print, Results};
use self::rows::fill_table;
use self::sql::{definer_against_invoker, functions_against_floor};
use self::wan::wan_outcomes;
use crate::BoxError;

/// Options of `idem bench`.
#[derive(Debug, clap::Args)]
pub(crate) struct BenchArgs {
    /// Concurrent workers per throughput scenario.
    #[arg(long, default_value_t = 16)]
    workers: usize,
    /// Seconds each throughput scenario runs.
    #[arg(long, default_value_t = 8)]
    seconds: u64,
    /// Rows already in the table for the large side of the growth figure.
    #[arg(long, default_value_t = 1_000_000)]
    growth_rows: i64,
    /// Expired rows the concurrent sweep deletes.
    #[arg(long, default_value_t = 100_000)]
    sweep_rows: i64,
    /// One-way delay of the simulated WAN link, in milliseconds.
    #[arg(long, default_value_t = 25)]
    wan_delay_ms: u64,
    /// Operations per outcome over the simulated WAN link.
    #[arg(long, default_value_t = 40)]
    wan_operations: usize,
    /// Where to write the raw figures as JSON.
    #[arg(long, default_value = "bench.json")]
    out: std::path::PathBuf,
}

/// Starts a local stack, runs every scenario on it, prints the figures and
/// writes them to `--out`.
pub(crate) async fn run(args: BenchArgs) -> Result<ExitCode, BoxError> {
    let stack = crate::plane::start_local(LocalStackConfig::default()).await?;
    let result = bench(&stack, &args).await;
    stack.stop().await?;
    let results = result?;
    print(&results);
    std::fs::write(&args.out, serde_json::to_vec_pretty(&results)?)?;
    println!("\nraw figures: {}", args.out.display());
    Ok(crate::exit::ok())
}

/// Every scenario in turn, on `stack`.
async fn bench(stack: &LocalStack, args: &BenchArgs) -> Result<Results, BoxError> {
    let client = PostgrestClient::new(stack.client_config()?.with_pool_max_idle_per_host(args.workers))?;
    let service = Arc::new(IdempotencyService::new(PostgrestRepository::new(client.clone())));
    let duration = Duration::from_secs(args.seconds);
    let mut figures = Vec::new();
    eprintln!("warming up…");
    pairs_through_crate(service.clone(), args.workers, Duration::from_secs(1)).await?;

    eprintln!("claim → complete through the crate…");
    figures.push(pairs_through_crate(service.clone(), args.workers, duration).await?);
    eprintln!("the same two calls from a bare HTTP client…");
    figures.push(pairs_bare_http(stack, args.workers, duration).await?);
    eprintln!("the same SQL functions over direct connections, alternating with the floor…");
    let (direct, floor) = functions_against_floor(stack.db(), args.workers, duration).await?;
    figures.push(direct);
    figures.push(floor);
    eprintln!("the same SQL functions as SECURITY DEFINER, alternating with SECURITY INVOKER…");
    let (definer, invoker) = definer_against_invoker(stack.db(), args.workers, duration).await?;
    figures.push(definer);
    figures.push(invoker);
    eprintln!("replays and conflicts…");
    let (replay, conflict, cached, trips) =
        replays_and_conflicts(stack, &client, service.clone(), args.workers, duration).await?;
    figures.push(replay);
    figures.push(conflict);
    figures.push(cached);

    eprintln!("claim latency idle, then while a sweep deletes {} expired rows…", args.sweep_rows);
    figures.push(claims(service.clone(), args.workers, duration, "claim idle").await?);
    figures.push(claims_during_sweep(stack, &client, service.clone(), args.workers, args.sweep_rows).await?);

    eprintln!("growth: 10,000 rows, then {} rows…", args.growth_rows);
    fill_table(stack.db(), 10_000).await?;
    figures.push(claims(service.clone(), args.workers, duration, "claim at 10k rows").await?);
    fill_table(stack.db(), args.growth_rows).await?;
    figures.push(claims(service.clone(), args.workers, duration, "claim at large table").await?);

    eprintln!("each outcome over a link with {} ms each way…", args.wan_delay_ms);
    let wan = wan_outcomes(stack, Duration::from_millis(args.wan_delay_ms), args.wan_operations).await?;
    Results::of(args.workers, args.seconds, figures, trips, wan)
}
