//! `idem redrive`: calls a function's re-drive route, once or on a
//! schedule, for a platform without pg_cron.
//!
//! Re-driving runs the function's own processing, so it happens where that
//! code lives: this command only asks. It POSTs `{"limit": N}` (and
//! `"scope"` when given) to the route with the service key (a JWT as a
//! bearer token, an `sb_` key as `apikey`), and prints the counts the route answers (`redriven`,
//! `journaled`, `dead_lettered`, `left`), the way the example webhook
//! function's `POST /redrive` and the crate's `WebhookGate::redrive` count.
//!
//! With `--failed` it first sends journaled failures back to re-drive (the
//! plane's `idempotency_redrive_failed`), each once, so the next re-drive
//! runs them again after a fix.
//!
//! Exit codes: 0 the pass took fewer orphans than its bound, 3 it filled the
//! bound (more may be waiting), 1 an error (the route refused, failed or
//! answered something that is not a report; or a failure named with
//! `--failed --id` was not sent back, each such one named with why), 2 a
//! usage error.

use std::process::ExitCode;

use serde::{Deserialize, Serialize};
use tracing::Instrument;

use idempotency_plane::repo::{FailuresCall, JournaledFailures, Redrivability, RedrivableRow, EVERY_SCOPE};
use idempotency_plane::{ClientError, PostgrestClient, PostgrestRepository};

use crate::{exit, failures, get, remote, schedule, BoxError};

/// How many orphans one pass asks for by default: the example function's
/// batch.
pub(crate) const DEFAULT_BOUND: u64 = 50;

/// Options of `idem redrive`.
#[derive(Debug, clap::Args)]
pub(crate) struct RedriveArgs {
    /// The function's re-drive route, e.g.
    /// https://<ref>.supabase.co/functions/v1/webhooks/redrive. It gets the
    /// service key: https://, or plain http:// to loopback or the plane's
    /// own host only.
    #[arg(long, value_name = "URL", required_unless_present = "failed")]
    to: Option<String>,
    /// The scope (or family, webhook.*) to re-drive, when the route serves
    /// more than one; without it, the route's own. With --failed it names
    /// the failures' scope, family, or every scope ('*'; the default with
    /// --id, whose claim ids name the failures exactly), and the route is
    /// asked for its own.
    #[arg(long)]
    scope: Option<String>,
    /// Orphans one pass takes over (with --failed: failures sent back): at
    /// most the server's row cap (IDEM_MAX_ROWS, default 1000). A larger
    /// bound is refused, never clamped.
    #[arg(long, default_value_t = DEFAULT_BOUND)]
    bound: u64,
    /// Send journaled failures of --scope back to re-drive first, once the
    /// bug behind them is fixed: the chosen --id ones, or every one claimed
    /// --since an instant (one of the two is required; `idem failures`
    /// lists them). Each becomes an orphan again, and what it replaced is
    /// kept in its row for the audit. Then --to, when given, re-drives them
    /// at once. Never on a schedule.
    #[arg(long, conflicts_with = "every")]
    failed: bool,
    /// With --failed: a failure to send back, by its claim id (repeat the
    /// flag for more). Each one not sent back is named with the reason
    /// (succeeded, no work kept, in flight, absent, …), and the command
    /// then exits 1.
    #[arg(long = "id", value_name = "CLAIM_ID", requires = "failed")]
    ids: Vec<uuid::Uuid>,
    /// With --failed: only this organization's failures.
    #[arg(long, requires = "failed")]
    org: Option<uuid::Uuid>,
    /// With --failed: every failure whose last attempt was claimed at or
    /// after this instant (RFC 3339; database clock).
    #[arg(long, value_name = "INSTANT", requires = "failed")]
    since: Option<chrono::DateTime<chrono::Utc>>,
    #[command(flatten)]
    schedule: schedule::ScheduleArgs,
    /// Print each report as one JSON line.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    target: remote::Target,
}

/// What the command sends the route.
#[derive(Debug, Serialize)]
pub(crate) struct Ask<'a> {
    pub(crate) limit: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) scope: Option<&'a str>,
}

/// What a re-drive route answers: every count is required, so a route
/// that answers something else is an error, not a pass that did nothing.
#[derive(Debug, Clone, Copy, Deserialize, Serialize)]
pub(crate) struct Report {
    pub(crate) redriven: u64,
    pub(crate) journaled: u64,
    pub(crate) dead_lettered: u64,
    pub(crate) left: u64,
}

pub(crate) async fn run(args: RedriveArgs) -> Result<ExitCode, BoxError> {
    let client = remote::client(&args.target)?;
    let route = match &args.to {
        Some(to) => Some(route(&client, to).map_err(|e| exit::usage_error(format!("--to {e}")))?),
        None => None,
    };
    let cap = u64::from(client.config().max_rows());
    if args.bound == 0 || args.bound > cap {
        return Err(exit::usage_error(format!(
            "--bound {} must be between 1 and the server's row cap, {cap} (IDEM_MAX_ROWS)",
            args.bound
        )));
    }
    let mut sent_back = None;
    if args.failed {
        sent_back = Some(send_back(&args, &client).await?);
    }
    let Some(route) = route else {
        return Ok(sent_back.unwrap_or_else(exit::ok));
    };
    args.schedule.serve_metrics()?;
    let ask = Ask { limit: args.bound, scope: args.scope.as_deref().filter(|_| !args.failed) };
    let pass = || async {
        match ask_route(&client, &route, &ask).await {
            Ok(report) => {
                print(&report, args.bound, args.json);
                if report.redriven + report.dead_lettered >= args.bound {
                    exit::backlog()
                } else {
                    exit::ok()
                }
            }
            Err(error) => {
                tracing::error!(%error, "the re-drive route failed");
                eprintln!("re-drive failed: {error}");
                exit::failure()
            }
        }
    };
    match args.schedule.schedule() {
        // After a send-back, the worse of the two passes: a send-back that
        // filled its bound says more failures may wait.
        None => {
            let routed = pass().await;
            Ok(match sent_back {
                Some(code) if code == exit::failure() => code,
                Some(code) if code == exit::backlog() && routed == exit::ok() => code,
                _ => routed,
            })
        }
        Some(schedule) => schedule.run(pass).await,
    }
}

/// Why a re-drive route was refused before any request.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RouteError {
    /// Not a URL.
    #[error("{to:?}: {source}")]
    Unparsable { to: String, source: url::ParseError },
    /// A URL the service key may not go to.
    #[error(transparent)]
    Refused(#[from] ClientError),
}

/// `to` as a re-drive route `client` may send the service key to: a URL,
/// `https://` or plain `http://` to loopback or the plane's own host.
pub(crate) fn route(client: &PostgrestClient, to: &str) -> Result<url::Url, RouteError> {
    let route = url::Url::parse(to).map_err(|source| RouteError::Unparsable { to: to.to_owned(), source })?;
    client.check_route(&route)?;
    Ok(route)
}

/// One pass: POSTs `ask` to `route` with the service key and reads the
/// route's report; sent once, never retried.
pub(crate) async fn ask_route(
    client: &PostgrestClient,
    route: &url::Url,
    ask: &Ask<'_>,
) -> Result<Report, ClientError> {
    let span = tracing::info_span!("idem.redrive", route = %route.path(), bound = ask.limit);
    client.post_route::<Report>(route, ask).instrument(span).await
}

/// `--failed`: sends the chosen failures back to re-drive and prints them,
/// then names each `--id` not sent back and why; exit 1 when one was not,
/// else 3 when the call filled its bound (more may wait).
async fn send_back(args: &RedriveArgs, client: &PostgrestClient) -> Result<ExitCode, BoxError> {
    if args.ids.is_empty() && args.since.is_none() {
        return Err(exit::usage_error(
            "--failed needs --id (the chosen failures, from `idem failures`) or --since (every one claimed since)",
        ));
    }
    let scope = match (args.scope.as_deref(), args.ids.is_empty()) {
        (Some(scope), _) => scope,
        (None, false) => EVERY_SCOPE,
        (None, true) => {
            return Err(exit::usage_error("--failed --since needs --scope (a scope, a family, or '*' for every scope)"))
        }
    };
    let ids = (!args.ids.is_empty()).then_some(args.ids.as_slice());
    let call = FailuresCall { scope, bound: args.bound, organization_id: args.org, since: args.since, claim_ids: ids };
    let repo = PostgrestRepository::new(client.clone());
    let sent = repo.redrive_failed(&call).await.map_err(exit::refused_input)?;
    tracing::info!(scope, sent_back = sent.len(), "journaled failures sent back to re-drive");
    failures::print(&sent, args.json)?;
    if !args.json {
        println!("{} failure(s) sent back to re-drive (bound {})", sent.len(), args.bound);
    }
    let skipped: Vec<uuid::Uuid> =
        args.ids.iter().filter(|id| !sent.iter().any(|row| row.id == **id)).copied().collect();
    if skipped.is_empty() {
        return Ok(failures::filled(sent.len(), args.bound));
    }
    let why =
        repo.redrivable(&FailuresCall { claim_ids: Some(&skipped), ..call }).await.map_err(exit::refused_input)?;
    for row in &why {
        tracing::warn!(claim_id = %row.claim_id, reason = ?row.reason, "a named failure was not sent back");
        print_skipped(row, args.json)?;
    }
    Ok(exit::failure())
}

/// One `--id` that was not sent back, and why: a JSON line, or a line on
/// stderr.
fn print_skipped(row: &RedrivableRow, json: bool) -> Result<(), BoxError> {
    if json {
        println!("{}", serde_json::to_string(&serde_json::json!({"skipped": row}))?);
        return Ok(());
    }
    let what = match (&row.scope, &row.key) {
        (Some(scope), Some(key)) => format!(" ({}/{})", get::printable(scope), get::printable(key)),
        _ => String::new(),
    };
    let why = match row.reason {
        // Sendable, yet this call did not take it: its bound was filled, or
        // another send-back held it at that moment.
        Redrivability::Redrivable => {
            "not taken by this call (its bound was filled, or another send-back held it): run it again"
        }
        reason => reason.explain(),
    };
    eprintln!("not sent back: {}{what}: {why}", row.claim_id);
    Ok(())
}

fn print(report: &Report, bound: u64, json: bool) {
    if json {
        match serde_json::to_string(report) {
            Ok(line) => println!("{line}"),
            Err(error) => eprintln!("the report does not serialize: {error}"),
        }
        return;
    }
    let filled = report.redriven + report.dead_lettered >= bound;
    let state = if filled { "backlog: the pass filled its bound" } else { "ok" };
    println!(
        "re-driven {} / bound {bound}: journaled {}, dead-lettered {}, left {} — {state}",
        report.redriven, report.journaled, report.dead_lettered, report.left
    );
}
