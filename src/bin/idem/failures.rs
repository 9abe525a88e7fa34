//! `idem failures`: the failures a scope journaled, which every later claim
//! of their key replays (a vendor's redeliveries included), listed so an
//! operator can choose what to send back to re-drive once the bug behind
//! them is fixed (`idem redrive --failed`).
//!
//! Exit codes: 0 the list is whole, 3 it filled its bound (more may wait),
//! 1 an error, 2 a usage error.

use std::process::ExitCode;

use chrono::{DateTime, Utc};
use idempotency_plane::repo::{FailureRow, FailuresCall, JournaledFailures, EVERY_SCOPE};
use idempotency_plane::PostgrestRepository;
use uuid::Uuid;

use crate::{exit, get, remote, BoxError};

/// Failures one call lists by default.
const DEFAULT_BOUND: u64 = 100;

/// Longest error shown in the table; `--json` shows it whole.
const SHOWN_ERROR_CHARS: usize = 80;

/// Which failures: the flags `idem failures` and `idem redrive --failed` share.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct Filter {
    /// Only this organization's failures.
    #[arg(long)]
    org: Option<Uuid>,
    /// Only failures whose last attempt was claimed at or after this
    /// instant (RFC 3339, e.g. 2026-12-01T00:00:00Z; database clock).
    #[arg(long, value_name = "INSTANT")]
    since: Option<DateTime<Utc>>,
    /// How many failures one call answers: at most the server's row cap
    /// (IDEM_MAX_ROWS, default 1000). A larger bound is refused, never
    /// clamped.
    #[arg(long, default_value_t = DEFAULT_BOUND)]
    bound: u64,
}

impl Filter {
    /// The call for `scope` (and `ids`, when given), its bound checked
    /// against the row cap: a usage error otherwise, before any request.
    pub(crate) fn call<'a>(
        &self,
        repo: &PostgrestRepository,
        scope: &'a str,
        ids: Option<&'a [Uuid]>,
    ) -> Result<FailuresCall<'a>, BoxError> {
        let cap = JournaledFailures::max_bound(repo);
        if self.bound == 0 || self.bound > cap {
            return Err(exit::usage_error(format!(
                "--bound {} must be between 1 and the server's row cap, {cap} (IDEM_MAX_ROWS)",
                self.bound
            )));
        }
        Ok(FailuresCall { scope, bound: self.bound, organization_id: self.org, since: self.since, claim_ids: ids })
    }
}

/// Options of `idem failures`.
#[derive(Debug, clap::Args)]
pub(crate) struct FailuresArgs {
    /// The scope (webhook.stripe) or family (webhook.*); without it, every
    /// scope's failures (`*`).
    #[arg(long, default_value = EVERY_SCOPE)]
    scope: String,
    #[command(flatten)]
    filter: Filter,
    /// Print each failure as one JSON line.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    target: remote::Target,
}

pub(crate) async fn run(args: FailuresArgs) -> Result<ExitCode, BoxError> {
    let repo = PostgrestRepository::new(remote::client(&args.target)?);
    let call = args.filter.call(&repo, &args.scope, None)?;
    let failures = repo.failures(&call).await.map_err(exit::refused_input)?;
    print(&failures, args.json)?;
    if !args.json {
        let note = if failures.is_empty() { "no journaled failure" } else { "journaled failures" };
        let of = if args.scope == EVERY_SCOPE { "every scope".to_owned() } else { args.scope.clone() };
        println!("{} {note} of {of} (bound {})", failures.len(), call.bound);
    }
    Ok(filled(failures.len(), call.bound))
}

/// 3 when `rows` filled `bound`: more may be waiting.
pub(crate) fn filled(rows: usize, bound: u64) -> ExitCode {
    if rows as u64 >= bound {
        exit::backlog()
    } else {
        exit::ok()
    }
}

/// Prints `rows`, one JSON line each or one table line each.
pub(crate) fn print(rows: &[FailureRow], json: bool) -> Result<(), BoxError> {
    for row in rows {
        if json {
            println!("{}", serde_json::to_string(row)?);
            continue;
        }
        let error = get::printable(row.error.as_deref().unwrap_or("—"));
        let shown: String = error.chars().take(SHOWN_ERROR_CHARS).collect();
        let cut = if error.chars().count() > SHOWN_ERROR_CHARS { "…" } else { "" };
        let redrivable = if row.redrivable { "re-drivable" } else { "no work stored" };
        // The first failure's time, when a send-back moved claimed_at on.
        let first = match row.first_claimed_at {
            Some(first) if first != row.claimed_at => format!("  first failed attempt claimed {first}"),
            _ => String::new(),
        };
        println!(
            "{}  {}  {}/{}  {shown}{cut}  attempts {}  sent back {}×  {redrivable}  claimed {}{first}",
            row.id,
            row.organization_id,
            row.scope,
            get::printable(&row.key),
            row.attempts,
            row.requeues,
            row.claimed_at
        );
    }
    Ok(())
}
