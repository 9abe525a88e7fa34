//! What a bench run found: each scenario's figure, the ratios between them
//! against their targets, printed and written as JSON.

use serde::Serialize;

use super::figure::Figure;
use super::layout::{Hot, Size};
use super::servers::ServerRun;
use super::work::Measure;
use super::Run;
use crate::BoxError;

/// Every figure of a run, and the ratios between them.
#[derive(Debug, Serialize)]
pub(super) struct Results {
    workers: usize,
    seconds_per_scenario: u64,
    growth_rows: i64,
    sweep_rows: i64,
    figures: Vec<Figure>,
    round_trips: Vec<(String, f64)>,
    wan: Vec<Figure>,
    sizes_per_million_claims: Vec<Size>,
    hot_completions: Vec<Hot>,
    work: Vec<Measure>,
    ratios: Vec<Ratio>,
    /// With `--also-on`: the server-bound scenarios on each server.
    pub(super) servers: Vec<ServerRun>,
}

/// One ratio between two figures, and whether it met its target.
#[derive(Debug, Serialize)]
struct Ratio {
    name: String,
    value: f64,
    target: String,
    met: bool,
}

impl Results {
    /// The results of a run, with the ratios its figures give.
    /// `(growth_rows, sweep_rows)`: the large table's rows and the sweep's
    /// backlog.
    pub(super) fn of(
        workers: usize,
        seconds_per_scenario: u64,
        run: Run,
        (growth_rows, sweep_rows): (i64, i64),
    ) -> Result<Results, BoxError> {
        let ratios = ratios(&run.figures, &run.round_trips, &run.wan, &run.work)?;
        Ok(Results {
            workers,
            seconds_per_scenario,
            growth_rows,
            sweep_rows,
            figures: run.figures,
            round_trips: run.round_trips,
            wan: run.wan,
            sizes_per_million_claims: run.sizes,
            hot_completions: run.hot,
            work: run.work,
            ratios,
            servers: Vec::new(),
        })
    }
}

/// The ratios between the figures of one run, each against its target.
fn ratios(
    figures: &[Figure],
    trips: &[(String, f64)],
    wan: &[Figure],
    work: &[Measure],
) -> Result<Vec<Ratio>, BoxError> {
    let get = |name: &str| figures.iter().find(|f| f.name == name).cloned().ok_or("missing figure");
    let wan_p50 = |name: &str| wan.iter().find(|f| f.name == name).map_or(f64::NAN, |f| f.p50_ms);
    let (crate_pairs, bare, direct, floor) = (
        get("pairs via crate")?,
        get("pairs via bare HTTP")?,
        get("pairs via direct SQL")?,
        get("pairs via floor SQL")?,
    );
    let (definer, invoker) = (get("pairs via direct SQL, definer")?, get("pairs via direct SQL, invoker")?);
    let (idle, during) = (get("claim idle")?, get("claim during sweep")?);
    let (small, large) = (get("claim at 10k rows")?, get("claim at large table")?);
    let (p_idle, p_during) = (get("partitioned: claim idle")?, get("partitioned: claim during sweep")?);
    let (p_small, p_large) = (get("partitioned: claim at 10k rows")?, get("partitioned: claim at large table")?);
    let (named, by_id) = (get("complete, organization named")?, get("complete, by id alone")?);
    let (with_work, without_work) = (get("claim carrying 4 KiB of work")?, get("claim carrying no work")?);
    let measured = |name: &str| work.iter().find(|m| m.name == name).map_or(f64::NAN, |m| m.value);
    let ratio = |name: &str, value: f64, target: &str, met: bool| Ratio {
        name: name.to_owned(),
        value,
        target: target.to_owned(),
        met,
    };
    let trip = |name: &str| trips.iter().find(|(n, _)| n == name).map_or(f64::NAN, |(_, v)| *v);
    let ratios = vec![
        {
            let v = crate_pairs.per_second / bare.per_second;
            ratio("pairs/s crate ÷ bare HTTP", v, "≥ 0.90", v >= 0.90)
        },
        {
            let v = crate_pairs.p50_ms / bare.p50_ms;
            ratio("p50 crate ÷ bare HTTP", v, "≤ 1.10", v <= 1.10)
        },
        {
            let v = bare.per_second / direct.per_second;
            ratio("pairs/s PostgREST server ÷ direct SQL", v, "≥ 0.50", v >= 0.50)
        },
        {
            let v = direct.per_second / floor.per_second;
            ratio("pairs/s functions (direct SQL) ÷ floor", v, "≥ 0.90", v >= 0.90)
        },
        {
            let v = definer.per_second / invoker.per_second;
            ratio("pairs/s SECURITY DEFINER ÷ INVOKER", v, "≥ 0.95", v >= 0.95)
        },
        ratio("round trips: first claim", trip("first claim"), "1", trip("first claim") == 1.0),
        ratio("round trips: replay", trip("replay"), "1", trip("replay") == 1.0),
        ratio("round trips: conflict", trip("conflict"), "1", trip("conflict") == 1.0),
        ratio("round trips: processing", trip("processing"), "1", trip("processing") == 1.0),
        ratio("round trips: reclaim", trip("reclaim"), "1", trip("reclaim") == 1.0),
        {
            let v = wan_p50("replay") / wan_p50("first claim");
            ratio("WAN p50 replay ÷ first claim", v, "≤ 1.15", v <= 1.15)
        },
        {
            let v = wan_p50("conflict") / wan_p50("first claim");
            ratio("WAN p50 conflict ÷ first claim", v, "≤ 1.15", v <= 1.15)
        },
        {
            let v = wan_p50("reclaim") / wan_p50("first claim");
            ratio("WAN p50 reclaim ÷ first claim", v, "≤ 1.15", v <= 1.15)
        },
        {
            let v = during.p99_ms / idle.p99_ms;
            ratio("claim p99 during sweep ÷ idle", v, "≤ 1.5", v <= 1.5)
        },
        {
            let v = large.p50_ms / small.p50_ms;
            ratio("claim p50 large table ÷ 10k rows", v, "≤ 1.2", v <= 1.2)
        },
        {
            let v = p_large.p50_ms / p_small.p50_ms;
            ratio("partitioned: p50 large table ÷ 10k", v, "≤ 1.2", v <= 1.2)
        },
        {
            let v = p_during.p99_ms / p_idle.p99_ms;
            ratio("partitioned: p99 during sweep ÷ idle", v, "≤ 1.5", v <= 1.5)
        },
        {
            // The cost of the layout itself, on the same small table: the
            // bar it would have to clear to be the default.
            let v = p_small.p50_ms / small.p50_ms;
            ratio("claim p50 partitioned ÷ single, 10k", v, "≤ 1.05", v <= 1.05)
        },
        {
            let v = by_id.p50_ms / named.p50_ms;
            ratio("partitioned: complete by id ÷ by org", v, "(info)", true)
        },
        {
            let v = with_work.p50_ms / without_work.p50_ms;
            ratio("claim p50 with 4 KiB of work ÷ without", v, "≤ 1.15", v <= 1.15)
        },
        {
            let v = measured("round trips: heartbeat");
            ratio("round trips: heartbeat", v, "1", v == 1.0)
        },
        {
            let v = measured("claims/s, batches of 100, crate") / measured("claims/s, batches of 1, crate");
            ratio("claims/s batches of 100 ÷ of 1, crate", v, "≥ 10", v >= 10.0)
        },
        {
            let v = measured("claims/s, batches of 100, crate") / measured("claims/s, batches of 100, bare HTTP");
            ratio("claims/s batches of 100, crate ÷ bare", v, "≥ 0.90", v >= 0.90)
        },
        {
            let v = measured("round trips per batch of 100, crate");
            ratio("round trips: batch of 100 claims", v, "1", v == 1.0)
        },
        {
            let v = measured("queue: consumer through the plane's queue functions");
            ratio("queue: consumer msg/s, 4 × batches of 50", v, "≥ 5000", v >= 5000.0)
        },
        {
            let v = measured("queue: consumer through the plane's queue functions")
                / measured("queue: pgmq alone, direct SQL (the floor)");
            ratio("queue: consumer ÷ pgmq direct SQL floor", v, "≥ 0.50", v >= 0.50)
        },
        {
            let v = measured("queue: consumer through the plane's queue functions")
                / measured("queue: consumer through the pgmq_public");
            ratio("queue: consumer, plane ÷ pgmq_public path", v, "(info)", true)
        },
        {
            let v = measured("queue: round trips per batch, consumer, plane's queue functions");
            ratio("queue: round trips per batch of 50", v, "2", v == 2.0)
        },
    ];
    Ok(ratios)
}

/// The queue scenarios alone (`idem bench --queue-only`), with their ratios.
pub(super) fn print_queue(measures: &[Measure]) {
    println!();
    println!("  one queue drained four ways: four workers, batches of 50");
    println!("  {:-<58} {:->12}", "", "");
    for m in measures {
        println!("  {:<58} {:>8.1} {}", m.name, m.value, m.unit);
    }
    let measured = |name: &str| measures.iter().find(|m| m.name == name).map_or(f64::NAN, |m| m.value);
    let plane = measured("queue: consumer through the plane's queue functions");
    println!();
    println!(
        "  consumer ÷ pgmq direct SQL floor   {:>6.2}  (target ≥ 0.50)",
        plane / measured("queue: pgmq alone, direct SQL (the floor)")
    );
    println!(
        "  consumer, plane ÷ pgmq_public path {:>6.2}",
        plane / measured("queue: consumer through the pgmq_public")
    );
}

pub(super) fn print(results: &Results) {
    println!();
    println!(
        "idem bench: {} workers, {} s per scenario, one run; large table {} rows, sweep backlog {} rows",
        results.workers, results.seconds_per_scenario, results.growth_rows, results.sweep_rows
    );
    println!();
    println!("  {:<34} {:>9} {:>11} {:>9} {:>9}", "scenario", "ops", "ops/s", "p50 ms", "p99 ms");
    println!("  {:-<34} {:->9} {:->11} {:->9} {:->9}", "", "", "", "", "");
    for f in &results.figures {
        println!("  {:<34} {:>9} {:>11.0} {:>9.3} {:>9.3}", f.name, f.operations, f.per_second, f.p50_ms, f.p99_ms);
    }
    println!();
    println!("  {:<34} {:>9}", "round trips per operation", "HTTP");
    println!("  (and the replay cache's memory per entry, bytes)");
    println!("  {:-<34} {:->9}", "", "");
    for (name, trips) in &results.round_trips {
        println!("  {:<34} {:>9.2}", name, trips);
    }
    println!();
    println!("  {:<34} {:>9} {:>9}", "over the WAN link, per outcome", "p50 ms", "p99 ms");
    println!("  {:-<34} {:->9} {:->9}", "", "", "");
    for f in &results.wan {
        println!("  {:<34} {:>9.1} {:>9.1}", f.name, f.p50_ms, f.p99_ms);
    }
    println!();
    println!("  disk per million claims, MiB (after vacuum)");
    println!(
        "  {:<12} {:>11} {:>8} {:>8} {:>11} {:>13}",
        "layout", "rows", "table", "pkey", "unique key", "retain_until"
    );
    println!("  {:-<12} {:->11} {:->8} {:->8} {:->11} {:->13}", "", "", "", "", "", "");
    for s in &results.sizes_per_million_claims {
        println!(
            "  {:<12} {:>11} {:>8.1} {:>8.1} {:>11.1} {:>13.1}",
            s.layout, s.rows, s.table_mib, s.primary_key_mib, s.unique_key_mib, s.retain_until_index_mib
        );
    }
    println!();
    println!("  completions that were HOT updates (no index entry written)");
    println!("  {:<10} {:<33} {:>8} {:>8}", "fillfactor", "completion", "updates", "HOT");
    println!("  {:-<10} {:-<33} {:->8} {:->8}", "", "", "", "");
    for h in &results.hot_completions {
        let what = if h.completion_moves_retain_until {
            "moves retain_until (lease passed)"
        } else {
            "leaves it alone (within lease)"
        };
        println!("  {:<10} {:<33} {:>8} {:>8}", h.fillfactor, what, h.updates, h.hot_updates);
    }
    println!();
    println!("  work that outlives its worker, batches and queues");
    println!("  {:-<48} {:->12}", "", "");
    for m in &results.work {
        println!("  {:<48} {:>8.1} {}", m.name, m.value, m.unit);
    }
    println!();
    println!("  {:<40} {:>8} {:>9}  met", "ratio", "value", "target");
    println!("  {:-<40} {:->8} {:->9}  ---", "", "", "");
    for r in &results.ratios {
        println!("  {:<40} {:>8.2} {:>9}  {}", r.name, r.value, r.target, if r.met { "yes" } else { "NO" });
    }
}
