//! `idem doctor`: can this deployment serve the plane? One line per check,
//! and a non-zero exit when any fails. Reads and writes none of the plane's
//! data: the probes are the repository's ([`PostgrestRepository::probe_reachable`],
//! [`PostgrestRepository::deployed_functions`] from the catalog,
//! [`PostgrestRepository::probe_row_cap`] with synthetic rows,
//! [`PostgrestRepository::policies`] for the webhook scopes' limits).

use std::process::ExitCode;
use std::time::Instant;

use idempotency_plane::callers::webhook::{
    largest_storable_body, stored_body_bound, DEFAULT_WEBHOOK_BODY_LIMIT, WEBHOOK_BODY_LIMIT_VAR, WEBHOOK_SCOPE_VAR,
};
use idempotency_plane::postgrest::{codes, ClientError, KeyKind};
use idempotency_plane::repo::probes::{DeployedFunction, RowCapProbe};
use idempotency_plane::repo::{SqlFunction, SQL_SURFACE};
use idempotency_plane::PostgrestRepository;
use serde_json::json;

use crate::{exit, remote, BoxError};

/// Options of `idem doctor`.
#[derive(Debug, clap::Args)]
pub(crate) struct DoctorArgs {
    /// Print the result as one JSON object: `{"ok", "url", "checks": [{"check", "ok", "detail"}]}`.
    #[arg(long)]
    json: bool,
    /// The largest body the deployment's webhook handler takes, in bytes:
    /// every policy row under --webhook-scope must store a body this large
    /// with its claim (at most 4 × ⌈bytes / 3⌉ + 18 bytes of work). Default:
    /// IDEM_WEBHOOK_BODY_LIMIT_BYTES, which the example handlers read too,
    /// else the gates' default, 262144 (256 KiB).
    #[arg(long, value_name = "BYTES", env = WEBHOOK_BODY_LIMIT_VAR, default_value_t = DEFAULT_WEBHOOK_BODY_LIMIT as u64)]
    webhook_body_limit: u64,
    /// The scope or family the webhook handler claims deliveries under.
    /// Default: IDEM_WEBHOOK_SCOPE, else webhook.*.
    #[arg(long, value_name = "SCOPE", env = WEBHOOK_SCOPE_VAR, default_value = "webhook.*")]
    webhook_scope: String,
    #[command(flatten)]
    target: crate::remote::Target,
}

/// One check's result.
#[derive(Debug, serde::Serialize)]
struct Check {
    check: String,
    ok: bool,
    detail: String,
}

/// The checks so far; printed as they come, or as one JSON object at the end.
struct Report {
    json: bool,
    checks: Vec<Check>,
}

impl Report {
    fn line(&mut self, ok: bool, check: &str, detail: impl std::fmt::Display) {
        let detail = detail.to_string();
        if !self.json {
            println!("{}  {check}: {detail}", if ok { "ok  " } else { "FAIL" });
        }
        self.checks.push(Check { check: check.to_owned(), ok, detail });
    }

    fn note(&self, text: &str) {
        if !self.json {
            println!("{text}");
        }
    }

    /// Prints the summary (or the JSON object) and answers the exit code:
    /// 0 when every check passed, else 1.
    fn finish(self, url: &str) -> Result<ExitCode, BoxError> {
        let failures = self.checks.iter().filter(|c| !c.ok).count();
        if self.json {
            let answer = json!({"ok": failures == 0, "url": url, "checks": self.checks});
            println!("{}", serde_json::to_string(&answer)?);
        } else if failures == 0 {
            println!("all checks passed");
        } else {
            println!("{failures} check(s) failed");
        }
        Ok(if failures == 0 { exit::ok() } else { exit::failure() })
    }
}

pub(crate) async fn run(args: DoctorArgs) -> Result<ExitCode, BoxError> {
    let repo = PostgrestRepository::new(remote::client(&args.target)?);
    let url = repo.client().config().redacted_url();
    let mut report = Report { json: args.json, checks: Vec::new() };
    report.note(&format!("idem doctor: {url}"));
    let config = repo.client().config();
    let headers = if config.key_kind() == KeyKind::Secret || config.key_kind() == KeyKind::Publishable {
        "apikey alone"
    } else if config.sends_apikey() {
        "Authorization: Bearer and apikey"
    } else {
        "Authorization: Bearer"
    };
    let source = config.key_variable().unwrap_or("the configuration");
    report.line(true, "service key", format!("a {} from {source}, sent as {headers}", config.key_kind().describe()));

    // Reachability, the key's role, the schema: one harmless read answers all three.
    let started = Instant::now();
    match repo.probe_reachable().await {
        Ok(_) => report.line(true, "reachable", format!("answered in {} ms", started.elapsed().as_millis())),
        Err(error) => {
            report.line(false, "reachable", diagnose(&error));
            report.note("      (the remaining checks need a reachable server with the right key; skipped)");
            return report.finish(&url);
        }
    }

    // One read of the catalog answers both.
    let held = repo.deployed_functions().await;
    check_surface(&held, &mut report);
    check_public_functions(&held, &mut report);
    let server_cap = check_row_cap(&repo, &mut report).await;
    check_plane_row_cap(&repo, server_cap, &mut report).await;
    check_orphans(&repo, &mut report).await;
    check_scheduled_calls(&repo, &mut report).await;
    check_webhook_body_limit(&repo, args.webhook_body_limit, &args.webhook_scope, &mut report).await;
    report.finish(&url)
}

/// Whether every policy row that governs the webhook handler's scope (or
/// lies under its family) stores a body as large as the handler takes: a
/// row that keeps less refuses such a delivery's work (`IDEM5`), and the
/// gate answers it 413 on every delivery, forever.
async fn check_webhook_body_limit(repo: &PostgrestRepository, limit: u64, scope: &str, report: &mut Report) {
    const CHECK: &str = "webhook body limit";
    let policies = match repo.policies(scope).await {
        Ok(policies) => policies,
        Err(error) => return report.line(false, CHECK, diagnose(&error)),
    };
    let needed = stored_body_bound(limit);
    let listed = |rows: &[&idempotency_plane::repo::probes::ScopePolicy]| {
        rows.iter().map(|p| format!("{} keeps {}", p.scope, p.max_request_bytes)).collect::<Vec<_>>().join(", ")
    };
    if policies.is_empty() {
        return report.line(
            false,
            CHECK,
            format!("no policy row governs {scope}: every delivery is refused (IDEM1); add one in a migration"),
        );
    }
    let short: Vec<_> = policies.iter().filter(|p| p.max_request_bytes < needed).collect();
    let Some(least) = short.iter().map(|p| p.max_request_bytes).min() else {
        let all: Vec<_> = policies.iter().collect();
        return report.line(
            true,
            CHECK,
            format!(
                "the handler takes bodies up to {limit} bytes ({WEBHOOK_BODY_LIMIT_VAR}), stored as at most \
                 {needed} bytes of work; {}",
                listed(&all)
            ),
        );
    };
    report.line(
        false,
        CHECK,
        format!(
            "the handler takes bodies up to {limit} bytes ({WEBHOOK_BODY_LIMIT_VAR}), stored as up to {needed} \
             bytes of work, but {}: a signed delivery above {} bytes may be answered 413 on every delivery. \
             Raise max_request_bytes to at least {needed} in a migration, or lower the handler's limit to {}",
            listed(&short),
            largest_storable_body(least),
            largest_storable_body(least)
        ),
    );
}

/// How long orphaned work may wait before the check says nothing re-drives
/// it: a re-drive scheduled every minute or so takes it well within this.
const ORPHAN_GRACE: std::time::Duration = std::time::Duration::from_secs(10 * 60);

/// Orphaned work per scope: claims whose worker is gone, still carrying
/// their work. Fails when some has waited longer than [`ORPHAN_GRACE`]:
/// nothing re-drives that scope.
async fn check_orphans(repo: &PostgrestRepository, report: &mut Report) {
    let scopes = match repo.orphans(100.min(repo.client().config().max_rows())).await {
        Ok(scopes) => scopes,
        Err(error) => return report.line(false, "orphans", diagnose(&error)),
    };
    if scopes.is_empty() {
        return report.line(true, "orphans", "no claim waits for a re-drive");
    }
    // How long work waited is the database's to say: no client clock decides it.
    let listed: Vec<String> =
        scopes.iter().map(|s| format!("{} {} (oldest waiting {} s)", s.scope, s.orphans, s.waited_ms / 1000)).collect();
    let stale = scopes.iter().any(|s| u128::from(s.waited_ms) > ORPHAN_GRACE.as_millis());
    let detail = if stale {
        format!(
            "{}: work waits longer than {} min, so nothing re-drives it; schedule a re-drive \
             (the function's re-drive route from pg_cron, or a worker's redrive loop)",
            listed.join(", "),
            ORPHAN_GRACE.as_secs() / 60
        )
    } else {
        format!("{}: waiting for the next re-drive", listed.join(", "))
    };
    report.line(!stale, "orphans", detail);
}

/// Whether a scheduled job's call (pg_cron calling a function's route with
/// pg_net) failed in the last hour: pg_cron reports such a run `succeeded`
/// whatever the HTTP status, so only the answers the recipes record say so.
async fn check_scheduled_calls(repo: &PostgrestRepository, report: &mut Report) {
    const CHECK: &str = "scheduled calls";
    let failed = match repo.scheduled_failures(None, 20.min(repo.client().config().max_rows())).await {
        Ok(failed) => failed,
        Err(error) => return report.line(false, CHECK, diagnose(&error)),
    };
    let Some(last) = failed.first() else {
        return report.line(true, CHECK, "no scheduled call failed in the last hour");
    };
    let mut jobs: Vec<&str> = failed.iter().map(|f| f.job.as_str()).collect();
    jobs.sort_unstable();
    jobs.dedup();
    let answer = match (last.status_code, last.error.as_deref()) {
        (Some(status), Some(error)) => format!("HTTP {status}, {error}"),
        (Some(status), None) => format!("HTTP {status}"),
        (None, Some(error)) => error.to_owned(),
        (None, None) => "no status".to_owned(),
    };
    report.line(
        false,
        CHECK,
        format!(
            "{} call(s) of {} failed in the last hour (pg_cron still says succeeded); the last, of {} at {}: {answer}. \
             See select * from agent.idempotency_scheduled_failures()",
            last.failed_calls,
            jobs.join(", "),
            last.job,
            last.called_at.format("%Y-%m-%dT%H:%M:%SZ"),
        ),
    );
}

/// Compares the functions the database holds with the contract, read-only:
/// a function missing, with other arguments, or not executable by the key's
/// role fails.
fn check_surface(held: &Result<Vec<DeployedFunction>, ClientError>, report: &mut Report) {
    let held = match held {
        Ok(held) => held,
        Err(error) => return report.line(false, "idempotency_surface", diagnose(error)),
    };
    for &SqlFunction { name, arguments } in SQL_SURFACE {
        let versions: Vec<&DeployedFunction> = held.iter().filter(|h| h.name == name).collect();
        match versions.iter().find(|h| h.arguments == arguments) {
            Some(h) if h.executable => report.line(true, name, "present with the contract's arguments, executable"),
            Some(_) => {
                report.line(false, name, "present, but the key's role cannot execute it: use the service_role key")
            }
            None if versions.is_empty() => report.line(false, name, "missing: apply the migrations (supabase db push)"),
            None => {
                let found: Vec<&str> = versions.iter().map(|h| h.arguments.as_str()).collect();
                report.line(false, name, format!("has other arguments ({}); expected ({arguments})", found.join(" | ")))
            }
        }
    }
}

/// Functions of schema `agent` that PUBLIC, `anon` or `authenticated` may
/// execute. The plane's own are private, and the event trigger makes every
/// function created or replaced there later private too, except where it
/// does not fire: on Supabase, for a superuser. Such a function is callable
/// by those roles wherever they can reach the schema, so it fails the
/// check, with its owner (the role that created it) and who may call it.
fn check_public_functions(held: &Result<Vec<DeployedFunction>, ClientError>, report: &mut Report) {
    const CHECK: &str = "public functions";
    let held = match held {
        Ok(held) => held,
        Err(error) => return report.line(false, CHECK, diagnose(error)),
    };
    let said = |f: &DeployedFunction| {
        [("PUBLIC", f.public_executable), ("anon", f.anon_executable), ("authenticated", f.authenticated_executable)]
    };
    if held.iter().any(|f| said(f).iter().any(|(_, may)| may.is_none())) {
        return report.line(
            false,
            CHECK,
            "the plane does not say who may execute its functions: apply the migrations (supabase db push)",
        );
    }
    let exposed: Vec<String> = held
        .iter()
        .filter_map(|f| {
            let roles: Vec<&str> =
                said(f).iter().filter(|(_, may)| *may == Some(true)).map(|(role, _)| *role).collect();
            (!roles.is_empty()).then(|| {
                format!(
                    "agent.{}({}) owned by {} (executable by {})",
                    f.name,
                    f.arguments,
                    f.owner.as_deref().unwrap_or("?"),
                    roles.join(", ")
                )
            })
        })
        .collect();
    if exposed.is_empty() {
        return report.line(true, CHECK, "no function of schema agent is executable by PUBLIC, anon or authenticated");
    }
    report.line(
        false,
        CHECK,
        format!(
            "{}: created where the event trigger does not fire (a superuser's) or granted since; \
             revoke execute on function … from public, anon, authenticated, or drop it",
            exposed.join(", ")
        ),
    );
}

/// Asks the probe for one row more than the configured cap and reads what
/// the server did from Content-Range: the server's cap, when it truncated
/// (at or below the configured one).
async fn check_row_cap(repo: &PostgrestRepository, report: &mut Report) -> Option<u64> {
    let cap = u64::from(repo.client().config().max_rows());
    let RowCapProbe { range, received, .. } = match repo.probe_row_cap(cap + 1).await {
        Ok(probe) => probe,
        Err(error) => {
            report.line(false, "row cap", diagnose(&error));
            return None;
        }
    };
    if range.rows() != received || range.total() != Some(cap + 1) {
        let detail = format!(
            "Content-Range {range} does not count the {received} rows that arrived out of {} asked: \
             bounded reads cannot detect truncation through this server",
            cap + 1
        );
        report.line(false, "row cap", detail);
        return None;
    }
    let detail = match received.cmp(&cap) {
        std::cmp::Ordering::Equal => {
            report.line(true, "row cap", format!("the server truncates at {cap} rows, as configured (Content-Range {range})"));
            return Some(cap);
        }
        std::cmp::Ordering::Less => format!(
            "the server truncates at {received} rows, below the configured {cap}: every bounded read above \
             {received} fails with Truncated. Set IDEM_MAX_ROWS={received}, or raise db-max-rows / Supabase api.max_rows"
        ),
        std::cmp::Ordering::Greater => format!(
            "the server returned {received} rows for {} asked: its db-max-rows is above the configured {cap} or \
             unset. Set db-max-rows / Supabase api.max_rows to {cap}, or IDEM_MAX_ROWS to the server's",
            cap + 1
        ),
    };
    report.line(false, "row cap", detail);
    (received <= cap).then_some(received)
}

/// The plane's own row cap against the server's (`server_cap`, when the
/// probe measured it): every function that answers rows holds its callers
/// to the plane's, so one above the server's lets the server cut rows the
/// plane claimed or took over, and one below refuses what the server could
/// answer.
async fn check_plane_row_cap(repo: &PostgrestRepository, server_cap: Option<u64>, report: &mut Report) {
    const CHECK: &str = "plane row cap";
    let plane = match repo.plane_row_cap().await {
        Ok(plane) => plane,
        Err(error) => return report.line(false, CHECK, diagnose(&error)),
    };
    let configured = u64::from(repo.client().config().max_rows());
    let fix = "update agent.idempotency_settings set max_rows = <the server's db-max-rows> (in a migration)";
    match server_cap {
        Some(server) if server == plane => {
            report.line(true, CHECK, format!("the plane holds answers to {plane} rows, the server's cap"))
        }
        Some(server) => report.line(
            false,
            CHECK,
            format!("the plane holds answers to {plane} rows but the server cuts them at {server}: {fix}"),
        ),
        None if plane <= configured => report.line(
            true,
            CHECK,
            format!("the plane holds answers to {plane} rows, within the configured {configured}"),
        ),
        None => report.line(
            false,
            CHECK,
            format!("the plane holds answers to {plane} rows, above the configured {configured}: {fix}"),
        ),
    }
}

/// What an error means for an operator.
fn diagnose(error: &ClientError) -> String {
    if let Some(hint) = error.auth_hint() {
        return hint.to_owned();
    }
    match error {
        ClientError::Transport { .. } => format!("cannot reach the server ({error})"),
        ClientError::Api { error: body, .. } => match body.code.as_str() {
            codes::PGRST106 => {
                "schema `agent` is not exposed: add it to db-schemas (Supabase: API settings → exposed schemas)".into()
            }
            codes::PGRST202 => format!("missing, or not with the contract's argument names: {}", body.message),
            codes::INSUFFICIENT_PRIVILEGE => "the key's role cannot execute it: use the service_role key".into(),
            codes::PGRST301 | codes::PGRST303 => format!("the key is not accepted: {}", body.message),
            _ => error.to_string(),
        },
        other => other.to_string(),
    }
}
