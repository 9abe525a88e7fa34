//! `idem sweep`: one bounded sweeper pass, or passes on a schedule.
//!
//! Exit codes: 0 the last pass left no backlog, 3 its read filled the bound
//! (expired claims are waiting), 1 an error (nothing was deleted by the
//! failing pass).

use std::process::ExitCode;
use std::time::Duration;

use idempotency_plane::sweeper::{SweepReport, Sweeper};

use crate::{remote, signal, BoxError};

/// The exit code of a pass whose read filled its bound.
pub(crate) const BACKLOG: u8 = 3;

/// Options of `idem sweep`.
#[derive(Debug, clap::Args)]
pub(crate) struct SweepArgs {
    /// Expired claims read per pass. At most the server's row cap
    /// (IDEM_MAX_ROWS, PostgREST db-max-rows); defaults to it. A larger bound
    /// is refused, never clamped.
    #[arg(long)]
    bound: Option<u64>,
    /// Run a pass every interval (e.g. 1h, 15m, 30s; ±10 % jitter) until
    /// interrupted, for a standalone worker. Without it, one pass.
    #[arg(long, value_parser = parse_interval)]
    every: Option<Duration>,
    /// Print each report as one JSON line.
    #[arg(long)]
    json: bool,
}

pub(crate) async fn run(args: SweepArgs) -> Result<ExitCode, BoxError> {
    let client = remote::client()?;
    let bound = args.bound.unwrap_or_else(|| u64::from(client.config().max_rows()));
    let sweeper = Sweeper::new(client, bound)?;
    let Some(every) = args.every else {
        let report = sweeper.pass().await?;
        print(&report, args.json)?;
        return Ok(exit_code(&report));
    };
    // A standalone worker outlives a failed pass (a network blip, a 503):
    // it logs it, counts it, and tries again at the next tick. Its exit code
    // on a signal is the last pass's.
    let mut shutdown = Box::pin(signal::shutdown());
    loop {
        let last = match sweeper.pass().await {
            Ok(report) => {
                print(&report, args.json)?;
                exit_code(&report)
            }
            Err(error) => {
                tracing::error!(%error, "sweep pass failed; trying again at the next tick");
                eprintln!("sweep pass failed: {error}");
                metrics::counter!("idempotency_sweep_errors_total").increment(1);
                ExitCode::FAILURE
            }
        };
        let wait = every.mul_f64(0.9 + 0.2 * rand::random::<f64>());
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            signal = &mut shutdown => {
                eprintln!("{}: stopping after the pass above", signal.unwrap_or("signal error"));
                return Ok(last);
            }
        }
    }
}

/// The longest `--every`: a sweep that runs less than weekly is no sweep.
const MAX_INTERVAL: Duration = Duration::from_secs(7 * 86_400);

fn exit_code(report: &SweepReport) -> ExitCode {
    if report.filled {
        ExitCode::from(BACKLOG)
    } else {
        ExitCode::SUCCESS
    }
}

fn print(report: &SweepReport, json: bool) -> Result<(), BoxError> {
    if json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        let state = if report.filled { "backlog: the read filled its bound" } else { "ok" };
        println!("read {} / bound {}, deleted {} — {state}", report.read, report.bound, report.deleted);
    }
    Ok(())
}

/// `90s`, `15m`, `1h`, `2d`, or plain seconds.
fn parse_interval(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let number: u64 = digits.parse().map_err(|_| format!("{text:?} is not an interval like 30s, 15m or 1h"))?;
    let seconds = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        other => return Err(format!("unknown unit {other:?}: use s, m, h or d")),
    };
    let interval = Duration::from_secs(number.saturating_mul(seconds));
    if interval.is_zero() || interval > MAX_INTERVAL {
        return Err("the interval must be above zero and at most 7d".into());
    }
    Ok(interval)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intervals_parse_with_units_and_refuse_garbage() {
        assert_eq!(parse_interval("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_interval("15m"), Ok(Duration::from_secs(900)));
        assert_eq!(parse_interval("45"), Ok(Duration::from_secs(45)));
        assert_eq!(parse_interval("2d"), Ok(Duration::from_secs(172_800)));
        for bad in ["", "h", "0s", "1w", "-1h", "1.5h", "8d", "99999999999999d"] {
            assert!(parse_interval(bad).is_err(), "{bad}");
        }
    }
}
