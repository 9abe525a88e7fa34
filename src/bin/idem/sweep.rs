//! `idem sweep`: one bounded sweeper pass, or passes on a schedule.
//!
//! Exit codes: 0 the last pass left no backlog, 3 its read filled the bound
//! (expired claims are waiting), 1 an error (nothing was deleted by the
//! failing pass), 2 a usage error.

use std::process::ExitCode;

use idempotency_plane::sweeper::{SweepReport, Sweeper};

use crate::{exit, remote, schedule, BoxError};

/// Options of `idem sweep`.
#[derive(Debug, clap::Args)]
pub(crate) struct SweepArgs {
    /// Expired claims read per pass. At most the server's row cap
    /// (IDEM_MAX_ROWS, PostgREST db-max-rows); defaults to it. A larger bound
    /// is refused, never clamped.
    #[arg(long)]
    bound: Option<u64>,
    #[command(flatten)]
    schedule: schedule::ScheduleArgs,
    /// Print each report as one JSON line.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    target: remote::Target,
}

pub(crate) async fn run(args: SweepArgs) -> Result<ExitCode, BoxError> {
    args.schedule.serve_metrics()?;
    let client = remote::client(&args.target)?;
    let bound = args.bound.unwrap_or_else(|| u64::from(client.config().max_rows()));
    // A bound of zero or above the row cap is refused before any request.
    let sweeper = Sweeper::new(client, bound).map_err(exit::usage_error)?;
    let Some(schedule) = args.schedule.schedule() else {
        let report = sweeper.pass().await?;
        print(&report, args.json)?;
        return Ok(exit_code(&report));
    };
    // A standalone worker outlives a failed pass (a network blip, a 503):
    // it logs it, counts it, and tries again at the next tick. Its exit code
    // on a signal is the last pass's.
    schedule
        .run(|| async {
            match sweeper.pass().await {
                Ok(report) => match print(&report, args.json) {
                    Ok(()) => exit_code(&report),
                    Err(_) => exit::failure(),
                },
                Err(error) => {
                    tracing::error!(%error, "sweep pass failed; trying again at the next tick");
                    eprintln!("sweep pass failed: {error}");
                    metrics::counter!(idempotency_plane::telemetry::SWEEP_ERRORS_TOTAL).increment(1);
                    exit::failure()
                }
            }
        })
        .await
}

fn exit_code(report: &SweepReport) -> ExitCode {
    if report.filled {
        exit::backlog()
    } else {
        exit::ok()
    }
}

fn print(report: &SweepReport, json: bool) -> Result<(), BoxError> {
    if json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        let state = if report.filled { "backlog: the read filled its bound" } else { "ok" };
        println!(
            "read {} / bound {}, deleted {}, dead-lettered {} — {state}",
            report.read, report.bound, report.deleted, report.dead_lettered
        );
    }
    Ok(())
}
