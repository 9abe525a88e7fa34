//! `idem`: the idempotency plane's command-line tool.
//!
//! - `idem demo` runs a concurrent scenario against the embedded local stack
//!   (or the server `IDEM_POSTGREST_URL` / `SUPABASE_URL` names) and prints
//!   what the plane prevented.
//! - `idem up` serves the embedded local stack until Ctrl-C.
//! - `idem bench` measures the plane side by side on the embedded stack.
//! - `idem sweep`, `idem get`, `idem claim`, `idem doctor` act on the deployment
//!   `IDEM_POSTGREST_URL` / `SUPABASE_URL` names.
//!
//! Exit codes: 0 success; 1 an error (printed with its causes), or a failed
//! `doctor` check; 2 a usage error (clap), or a demo check that failed;
//! 3 `sweep`'s read filled its bound (a backlog).

mod bench;
mod claim;
mod demo;
mod doctor;
mod get;
mod plane;
mod remote;
mod report;
mod signal;
mod sweep;
mod tally;
mod up;
mod vendor;
mod worker;

use std::error::Error as StdError;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

/// Every error the binary propagates: printed, then exit code 1.
pub(crate) type BoxError = Box<dyn StdError + Send + Sync>;

/// The idempotency plane: claims, leases with fencing tokens, a replay journal.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run concurrent workers sending emails through the plane and a fake
    /// vendor, and check that every effect happened exactly once.
    ///
    /// Uses the embedded local stack (a fresh database on the PostgreSQL at
    /// DATABASE_URL, default postgres://postgres@127.0.0.1:5432/postgres),
    /// or the server IDEM_POSTGREST_URL / SUPABASE_URL names with its
    /// service key (IDEM_SERVICE_KEY / SUPABASE_SERVICE_ROLE_KEY).
    Demo(demo::DemoArgs),
    /// Measure the plane on the embedded local stack, side by side: the crate,
    /// a bare HTTP client, direct SQL, replays, conflicts, a concurrent
    /// sweep, a large table. Prints ratios; writes the raw figures as JSON.
    Bench(bench::BenchArgs),
    /// Serve the embedded local stack until Ctrl-C, and print how to reach it.
    Up(up::UpArgs),
    /// Delete claims past their retention: one bounded pass, or passes on a
    /// schedule (--every). Exit 0 ok, 3 backlog (the read filled the bound),
    /// 1 error. Acts on the server IDEM_POSTGREST_URL / SUPABASE_URL names.
    Sweep(sweep::SweepArgs),
    /// Show one claim as the database sees it: why did this call not run?
    Get(get::GetArgs),
    /// Would this call run? Claim a key the way a worker does, for the
    /// request JSON on stdin; print the outcome as one JSON line. A key it
    /// takes is held for its lease (or released with --release).
    Claim(claim::ClaimArgs),
    /// Check that a deployment can serve the plane: reachability, the key's
    /// role, the exposed schema, every function, the real row cap.
    Doctor,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(match cli.command {
        // The benchmark's sweep fills its bound on purpose.
        Command::Bench(_) => "warn,postrust_server::build=error,idempotency_plane::sweeper=error,sqlx=error",
        _ => DEFAULT_LOG_FILTER,
    });
    let result = match cli.command {
        Command::Demo(args) => demo::run(args).await,
        Command::Bench(args) => bench::run(args).await,
        Command::Up(args) => up::run(args).await,
        Command::Sweep(args) => sweep::run(args).await,
        Command::Get(args) => get::run(args).await,
        Command::Claim(args) => claim::run(args).await,
        Command::Doctor => doctor::run().await,
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            print_error(error.as_ref());
            ExitCode::FAILURE
        }
    }
}

/// Logs go to stderr, filtered by `RUST_LOG`. The default is `warn`, which
/// keeps the demo's output to its table; it also quiets the embedded server's
/// start-up notice about JSON key order, which says nothing about this plane.
const DEFAULT_LOG_FILTER: &str = "warn,postrust_server::build=error";

fn init_logging(default_filter: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

/// Prints `error` and the chain of its causes to stderr, skipping a cause
/// whose text the line above already carries.
fn print_error(error: &(dyn StdError + 'static)) {
    let mut printed = error.to_string();
    eprintln!("error: {printed}");
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !printed.contains(&text) {
            eprintln!("  caused by: {text}");
        }
        printed = text;
        source = cause.source();
    }
}
