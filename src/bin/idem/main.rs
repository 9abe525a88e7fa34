//! `idem`: the idempotency plane's command-line tool.
//!
//! Against a deployed plane (`IDEM_POSTGREST_URL` / `SUPABASE_URL` and a
//! service key), with default features:
//! - `idem sweep` deletes expired claims: one bounded pass, or passes on a
//!   schedule with a Prometheus endpoint;
//! - `idem get` shows one claim as the database sees it;
//! - `idem claim` claims a key the way a worker does;
//! - `idem doctor` checks that a deployment can serve the plane;
//! - `idem redrive` asks a function's re-drive route to take over orphaned
//!   work, once or on a schedule, and with `--failed` sends journaled
//!   failures back to re-drive;
//! - `idem failures` lists the failures a scope journaled;
//! - `idem console` serves the plane in a browser, on loopback: what is in
//!   flight, orphans, failures, dead letters, the sweep's backlog, activity
//!   plots, and confirmed actions (send back, re-drive, end a stuck claim).
//!
//! With `--features local`, on the embedded local stack:
//! - `idem demo` runs a concurrent scenario and prints what the plane prevented;
//! - `idem up` serves the local stack until Ctrl-C;
//! - `idem bench` measures the plane side by side.
//!
//! Exit codes: 0 success; 1 a failure (an error, printed with its causes, a
//! failed `doctor` check, a failed `demo` check); 2 a usage or configuration
//! error, found before any request (a bad flag, no plane configured, an
//! unusable URL or key, a bound above the row cap, stdin that is not JSON);
//! 3 `sweep` left a backlog (its read filled the bound) or `redrive`
//! filled its bound.

mod claim;
mod console;
mod doctor;
mod exit;
mod failures;
mod get;
mod metrics_endpoint;
mod otel;
mod redrive;
mod remote;
mod schedule;
mod signal;
mod sweep;

#[cfg(feature = "local")]
mod bench;
#[cfg(feature = "local")]
mod demo;
#[cfg(feature = "local")]
mod plane;
#[cfg(feature = "local")]
mod report;
#[cfg(feature = "local")]
mod tally;
#[cfg(feature = "local")]
mod up;
#[cfg(feature = "local")]
mod vendor;
#[cfg(feature = "local")]
mod worker;

use std::error::Error as StdError;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Every error the binary propagates: printed, then exit code 1.
pub(crate) type BoxError = Box<dyn StdError + Send + Sync>;

/// The idempotency plane: claims, leases with fencing tokens, a replay journal.
#[derive(Debug, Parser)]
#[command(
    name = "idem",
    version,
    about,
    after_help = "Exit codes: 0 success, 1 failure, 2 usage or configuration error (nothing attempted), 3 sweep, redrive or failures backlog.\n\
                  sweep, redrive, failures, console, get, claim and doctor act on the plane --url/--service-key or the environment name: \
                  IDEM_POSTGREST_URL (or SUPABASE_URL), IDEM_SERVICE_KEY / SUPABASE_SECRET_KEY / \
                  SUPABASE_SERVICE_ROLE_KEY, IDEM_APIKEY, IDEM_MAX_ROWS.\n\
                  demo, up and bench need the embedded local stack: cargo install --path . --features local; \
                  it reads DATABASE_URL and PGSSLMODE, and IDEM_LAYOUT (single, the default, or partitioned: \
                  the claim table hash-partitioned by organization).\n\
                  RUST_LOG filters the logs on stderr (default warn); OTEL_EXPORTER_OTLP_ENDPOINT (and the other \
                  OTEL_* variables) exports spans and metrics over OTLP/HTTP."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// What every command acting on a deployment reads, in its --help.
const REMOTE_ENV_HELP: &str = "Reads IDEM_POSTGREST_URL (else SUPABASE_URL) and a service key (the first set \
                               of IDEM_SERVICE_KEY, SUPABASE_SECRET_KEY, SUPABASE_SERVICE_ROLE_KEY), which --url \
                               and --service-key override; and either way IDEM_APIKEY (the apikey header, in place \
                               of the service key's) and IDEM_MAX_ROWS (the server's row cap, default 1000). \
                               RUST_LOG filters the logs on stderr (default warn).";

#[derive(Debug, Subcommand)]
enum Command {
    /// Run concurrent workers sending emails through the plane and a fake
    /// vendor, and check that every effect happened exactly once.
    ///
    /// Uses the embedded local stack (a fresh database on the PostgreSQL at
    /// DATABASE_URL, default postgres://postgres@127.0.0.1:5432/postgres,
    /// without TLS on loopback unless the URL or PGSSLMODE asks for a mode);
    /// with --remote, the deployment IDEM_POSTGREST_URL / SUPABASE_URL and
    /// a service key name (and IDEM_APIKEY, IDEM_MAX_ROWS). An exported
    /// SUPABASE_URL alone never makes it write into a hosted project.
    /// IDEM_LAYOUT=partitioned partitions the local claim table by
    /// organization. RUST_LOG filters the logs on stderr.
    #[cfg(feature = "local")]
    Demo(demo::DemoArgs),
    /// Measure the plane on the embedded local stack, side by side: the crate,
    /// a bare HTTP client, direct SQL, replays, conflicts, a concurrent
    /// sweep, a large table. Prints ratios; writes the raw figures as JSON.
    ///
    /// Uses a fresh database on the PostgreSQL at DATABASE_URL (default
    /// postgres://postgres@127.0.0.1:5432/postgres), without TLS on loopback
    /// unless the URL or PGSSLMODE asks for a mode. The partitioned layout's
    /// figures come from a second stack in that layout; IDEM_LAYOUT
    /// (single, the default, or partitioned) lays out the first. RUST_LOG
    /// filters the logs on stderr.
    #[cfg(feature = "local")]
    Bench(bench::BenchArgs),
    /// Serve the embedded local stack until Ctrl-C, and print how to reach it.
    ///
    /// Serves a database on the PostgreSQL at DATABASE_URL (default
    /// postgres://postgres@127.0.0.1:5432/postgres), without TLS on loopback
    /// unless the URL or PGSSLMODE asks for a mode, with the claim table
    /// laid out as IDEM_LAYOUT says (single, the default, or partitioned:
    /// hash-partitioned by organization). RUST_LOG filters the logs on
    /// stderr.
    #[cfg(feature = "local")]
    Up(up::UpArgs),
    /// Delete claims past their retention: one bounded pass, or passes on a
    /// schedule (--every). Exit 0 ok, 3 backlog (the read filled the bound),
    /// 1 error. Acts on the server IDEM_POSTGREST_URL / SUPABASE_URL names.
    #[command(after_help = REMOTE_ENV_HELP)]
    Sweep(sweep::SweepArgs),
    /// Ask a function's re-drive route to take over the orphans of its scope
    /// (work whose worker stopped): once, or on a schedule (--every). Exit 0
    /// ok, 3 the pass filled its bound, 1 error.
    #[command(after_help = REMOTE_ENV_HELP)]
    Redrive(redrive::RedriveArgs),
    /// List the failures a scope journaled (dead letters included), which
    /// every later claim of their key replays: what `idem redrive --failed`
    /// can send back after a fix. Exit 0, 3 the list filled its bound.
    #[command(after_help = REMOTE_ENV_HELP)]
    Failures(failures::FailuresArgs),
    /// Serve the plane in a browser, on 127.0.0.1: in flight by scope,
    /// orphans, failures, dead letters, the sweep's backlog, activity
    /// plots; send failures back, re-drive a scope, end a stuck claim as a
    /// failure, each confirmed. Prints the page's URL as its first line;
    /// serves until Ctrl-C. The service key stays in this process.
    #[command(after_help = REMOTE_ENV_HELP)]
    Console(console::ConsoleArgs),
    /// Show one claim as the database sees it: why did this call not run?
    #[command(after_help = REMOTE_ENV_HELP)]
    Get(get::GetArgs),
    /// Would this call run? For the request JSON on stdin, read what a
    /// worker's claim would meet (nothing is written) and print it as one
    /// JSON line; with --hold, claim the key as a worker does and hold it
    /// for its lease (or release it at once with --release).
    #[command(after_help = REMOTE_ENV_HELP)]
    Claim(claim::ClaimArgs),
    /// Check that a deployment can serve the plane: reachability, the key's
    /// role, the exposed schema, every function, the real row cap.
    #[command(after_help = REMOTE_ENV_HELP)]
    Doctor(doctor::DoctorArgs),
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => {
            // --help and --version print and succeed; anything else is a
            // usage error, exit 2.
            let _ = error.print();
            return if error.use_stderr() { exit::usage() } else { exit::ok() };
        }
    };
    // Logs, and the OTLP export when OTEL_EXPORTER_OTLP_ENDPOINT is set:
    // flushed below on every path (and by its drop on a panic).
    let otel = otel::init_logging(match cli.command {
        // The benchmark's sweep fills its bound on purpose.
        #[cfg(feature = "local")]
        Command::Bench(_) => "warn,postrust_server::build=error,idempotency_plane::sweeper=error,sqlx=error",
        _ => DEFAULT_LOG_FILTER,
    });
    let result = match cli.command {
        #[cfg(feature = "local")]
        Command::Demo(args) => demo::run(args).await,
        #[cfg(feature = "local")]
        Command::Bench(args) => bench::run(args).await,
        #[cfg(feature = "local")]
        Command::Up(args) => up::run(args).await,
        Command::Sweep(args) => sweep::run(args).await,
        Command::Redrive(args) => redrive::run(args).await,
        Command::Failures(args) => failures::run(args).await,
        Command::Console(args) => console::run(args).await,
        Command::Get(args) => get::run(args).await,
        Command::Claim(args) => claim::run(args).await,
        Command::Doctor(args) => doctor::run(args).await,
    };
    let code = match result {
        Ok(code) => code,
        Err(error) => {
            print_error(error.as_ref());
            if error.downcast_ref::<exit::Usage>().is_some() {
                exit::usage()
            } else {
                exit::failure()
            }
        }
    };
    otel::shutdown(otel);
    code
}

/// Logs go to stderr, filtered by `RUST_LOG`. The default is `warn`, which
/// keeps the demo's output to its table; it also quiets the embedded server's
/// start-up notice about JSON key order, which says nothing about this plane.
/// sqlx's own warnings (a slow `DROP DATABASE` when a local stack stops) are
/// not the operator's business either.
const DEFAULT_LOG_FILTER: &str = "warn,postrust_server::build=error,sqlx=error";

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
