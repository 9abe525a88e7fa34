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
//! on a large table; `wan`: each outcome over a slow link; `layout`: disk
//! per million claims, HOT completions, and completions by organization on
//! the partitioned layout; `work`: claims carrying work, heartbeats, re-drive
//! and the WAL and disk of work; `batches`: first claims in batches of 1,
//! 10 and 100 through the crate and from a bare HTTP client; `queue`: one
//! queue drained four ways, pgmq alone to the plane's consumer), `drive` to
//! run them, `rows` for the rows
//! they set up directly, and `report` for the figures and ratios.
//!
//! The first stack has the single-table layout (or the one `IDEM_LAYOUT`
//! names); a second stack, in the layout partitioned by organization, then
//! runs the claim scenarios again, so both layouts' figures come from one run.

mod batches;
mod claims;
mod drive;
mod figure;
mod floor;
mod http;
mod layout;
mod queue;
mod replays;
mod report;
mod rows;
mod servers;
mod sql;
mod wan;
mod work;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use idempotency_plane::local::{LocalStack, LocalStackConfig};
use idempotency_plane::migrations::Layout;
use idempotency_plane::{IdempotencyService, PostgrestClient, PostgrestRepository};

use self::batches::batch_claims;
use self::claims::{claims, claims_during_sweep};
use self::http::{pairs_bare_http, pairs_through_crate};
use self::layout::{completion_addressing, hot_updates, size_per_million};
use self::queue::queue_paths;
use self::replays::replays_and_conflicts;
use self::report::{print, Results};
use self::rows::fill_table;
use self::servers::{server_scenarios, ServerRun};
use self::sql::{definer_against_invoker, functions_against_floor};
use self::wan::wan_outcomes;
use self::work::{claims_with_work, heartbeats, redrive_throughput, wal_and_disk};
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
    #[arg(long, default_value_t = 10_000_000)]
    growth_rows: i64,
    /// Expired rows (the backlog) the concurrent sweep deletes.
    #[arg(long, default_value_t = 1_000_000)]
    sweep_rows: i64,
    /// Claim → complete pairs per side of the completion-addressing figure.
    #[arg(long, default_value_t = 2_000)]
    addressing_pairs: usize,
    /// One-way delay of the simulated WAN link, in milliseconds.
    #[arg(long, default_value_t = 25)]
    wan_delay_ms: u64,
    /// Operations per outcome over the simulated WAN link.
    #[arg(long, default_value_t = 40)]
    wan_operations: usize,
    /// Messages the end-to-end queue scenario drains.
    #[arg(long, default_value_t = 10_000)]
    queue_messages: usize,
    /// Where to write the raw figures as JSON.
    #[arg(long, default_value = "bench.json")]
    out: std::path::PathBuf,
    /// A second PostgreSQL server (an admin URL, as DATABASE_URL takes):
    /// the run ends with the server-bound scenarios on a fresh stack of each
    /// server, printed side by side: pairs through the crate and a bare HTTP
    /// client, the SQL functions against the plain-statement floor, SECURITY
    /// DEFINER against INVOKER, first claims.
    #[arg(long, value_name = "DATABASE_URL")]
    also_on: Option<String>,
    /// With --also-on: run only those scenarios, on both servers (minutes
    /// instead of half an hour).
    #[arg(long, requires = "also_on")]
    servers_only: bool,
    /// Run only the queue scenarios (a minute instead of half an hour).
    #[arg(long, conflicts_with = "servers_only")]
    queue_only: bool,
}

/// Starts a local stack, runs every scenario on it, prints the figures and
/// writes them to `--out`.
pub(crate) async fn run(args: BenchArgs) -> Result<ExitCode, BoxError> {
    if let Some(url) = &args.also_on {
        // Before half an hour of scenarios, not after.
        servers::reachable(url).await?;
    }
    if args.queue_only {
        eprintln!("a queue of {} messages drained four ways…", args.queue_messages);
        let measures = queue_paths(args.queue_messages).await?;
        report::print_queue(&measures);
        std::fs::write(&args.out, serde_json::to_vec_pretty(&measures)?)?;
        println!("\nraw figures: {}", args.out.display());
        return Ok(crate::exit::ok());
    }
    if args.servers_only {
        let servers = compare_servers(&args).await?;
        servers::print(&servers);
        std::fs::write(&args.out, serde_json::to_vec_pretty(&servers)?)?;
        println!("\nraw figures: {}", args.out.display());
        return Ok(crate::exit::ok());
    }
    let stack = crate::plane::start_local(LocalStackConfig::default()).await?;
    let layout = stack_layout(&stack).await?;
    let result = bench(&stack, &args, &layout).await;
    stack.stop().await?;
    let mut run = result?;

    eprintln!("a second stack, its claim table partitioned by organization…");
    let partitioned = LocalStack::start(LocalStackConfig::default().with_layout(Layout::PartitionedByOrganization))
        .await
        .map_err(BoxError::from)?;
    let result = on_partitioned_layout(&partitioned, &args, &mut run).await;
    partitioned.stop().await?;
    result?;

    let mut results = Results::of(args.workers, args.seconds, run, (args.growth_rows, args.sweep_rows))?;
    print(&results);
    // Written before the comparison of servers, which may still fail.
    std::fs::write(&args.out, serde_json::to_vec_pretty(&results)?)?;
    if args.also_on.is_some() {
        let servers = compare_servers(&args).await?;
        servers::print(&servers);
        results.servers = servers;
        std::fs::write(&args.out, serde_json::to_vec_pretty(&results)?)?;
    }
    println!("\nraw figures: {}", args.out.display());
    Ok(crate::exit::ok())
}

/// The server-bound scenarios on a fresh stack of the first server, then on
/// one of `--also-on`'s: the same scenarios in the same order, so their
/// ratios compare.
async fn compare_servers(args: &BenchArgs) -> Result<Vec<ServerRun>, BoxError> {
    let url = args.also_on.as_deref().ok_or("comparing servers needs --also-on")?;
    eprintln!("the server-bound scenarios on a fresh stack of the first server…");
    let first = on_server(LocalStackConfig::default(), args).await?;
    eprintln!("the same on a stack of the second server…");
    let second =
        on_server(LocalStackConfig { database_url: url.to_owned(), ..LocalStackConfig::default() }, args).await?;
    Ok(vec![first, second])
}

/// The server-bound scenarios on a local stack started with `config`.
async fn on_server(config: LocalStackConfig, args: &BenchArgs) -> Result<ServerRun, BoxError> {
    let stack = crate::plane::start_local(config).await?;
    let result = async {
        let figures = server_scenarios(&stack, args.workers, Duration::from_secs(args.seconds)).await?;
        ServerRun::of(&stack, figures).await
    }
    .await;
    stack.stop().await?;
    result
}

/// What the scenarios measured, before the ratios between them.
struct Run {
    figures: Vec<figure::Figure>,
    round_trips: Vec<(String, f64)>,
    wan: Vec<figure::Figure>,
    sizes: Vec<layout::Size>,
    hot: Vec<layout::Hot>,
    work: Vec<work::Measure>,
}

/// `single` or `partitioned`: how the stack's claim table is laid out.
async fn stack_layout(stack: &LocalStack) -> Result<String, BoxError> {
    let partitioned: bool =
        sqlx::query_scalar("select relkind = 'p' from pg_class where oid = 'agent.idempotency_keys'::regclass")
            .fetch_one(stack.db())
            .await?;
    Ok(if partitioned { Layout::PartitionedByOrganization } else { Layout::Single }.name().to_owned())
}

/// Every scenario in turn, on `stack` (laid out as `layout`).
async fn bench(stack: &LocalStack, args: &BenchArgs, layout: &str) -> Result<Run, BoxError> {
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

    eprintln!("claims carrying 4 KiB of work, alternating with claims carrying none…");
    let repo = Arc::new(PostgrestRepository::new(client.clone()));
    let (with, without) = claims_with_work(repo.clone(), args.workers, duration).await?;
    figures.push(with);
    figures.push(without);
    eprintln!("heartbeats on held claims…");
    let (beat, beat_trips) = heartbeats(&client, repo, args.workers, duration).await?;
    figures.push(beat);
    let mut work = vec![beat_trips];
    eprintln!("re-drive: four re-drivers over 10,000 orphans…");
    work.push(redrive_throughput(stack.db(), &client).await?);
    eprintln!("WAL and disk of claims with and without work…");
    work.extend(wal_and_disk(stack.db()).await?);
    eprintln!("first claims in batches of 1, 10 and 100, through the crate and from a bare HTTP client…");
    work.extend(batch_claims(stack, &client, args.workers, duration).await?);
    eprintln!(
        "a queue of {} messages drained by four workers in batches of 50: pgmq alone, through the Data API, and the \
         consumer both ways…",
        args.queue_messages
    );
    work.extend(queue_paths(args.queue_messages).await?);

    eprintln!("claim latency idle, then while a sweep deletes {} expired rows…", args.sweep_rows);
    figures.push(claims(service.clone(), args.workers, duration, "claim idle").await?);
    figures.push(
        claims_during_sweep(stack, &client, service.clone(), args.workers, args.sweep_rows, "claim during sweep")
            .await?,
    );

    eprintln!("each outcome over a link with {} ms each way…", args.wan_delay_ms);
    let wan = wan_outcomes(stack, Duration::from_millis(args.wan_delay_ms), args.wan_operations).await?;

    eprintln!("completions on copies of the claim table: HOT updates by fillfactor and retain_until…");
    let hot = hot_updates(stack.db()).await?;

    eprintln!("growth: 10,000 rows, then {} rows…", args.growth_rows);
    fill_table(stack.db(), 10_000).await?;
    figures.push(claims(service.clone(), args.workers, duration, "claim at 10k rows").await?);
    fill_table(stack.db(), args.growth_rows).await?;
    figures.push(claims(service.clone(), args.workers, duration, "claim at large table").await?);
    let sizes = vec![size_per_million(stack.db(), layout).await?];
    Ok(Run { figures, round_trips: trips, wan, sizes, hot, work })
}

/// The claim scenarios again on `stack`, whose claim table is partitioned
/// by organization, and what a completion costs there with and without the
/// organization; added to `run` under names starting `partitioned:`.
async fn on_partitioned_layout(stack: &LocalStack, args: &BenchArgs, run: &mut Run) -> Result<(), BoxError> {
    let client = PostgrestClient::new(stack.client_config()?.with_pool_max_idle_per_host(args.workers))?;
    let service = Arc::new(IdempotencyService::new(PostgrestRepository::new(client.clone())));
    let duration = Duration::from_secs(args.seconds);
    claims(service.clone(), args.workers, Duration::from_secs(1), "partitioned warm-up").await?;
    run.figures.push(claims(service.clone(), args.workers, duration, "partitioned: claim idle").await?);
    eprintln!("partitioned: claim latency while a sweep deletes {} expired rows…", args.sweep_rows);
    let during = "partitioned: claim during sweep";
    run.figures
        .push(claims_during_sweep(stack, &client, service.clone(), args.workers, args.sweep_rows, during).await?);
    eprintln!("partitioned: growth: 10,000 rows, then {} rows…", args.growth_rows);
    fill_table(stack.db(), 10_000).await?;
    run.figures.push(claims(service.clone(), args.workers, duration, "partitioned: claim at 10k rows").await?);
    fill_table(stack.db(), args.growth_rows).await?;
    run.figures.push(claims(service.clone(), args.workers, duration, "partitioned: claim at large table").await?);
    run.sizes.push(size_per_million(stack.db(), Layout::PartitionedByOrganization.name()).await?);
    eprintln!("partitioned: {} completions naming the organization, and as many by id alone…", args.addressing_pairs);
    let (named, unnamed) = completion_addressing(stack.db(), args.addressing_pairs).await?;
    run.figures.push(named);
    run.figures.push(unnamed);
    Ok(())
}
