//! The same server-bound scenarios on two PostgreSQL servers (`--also-on`),
//! their ratios printed side by side: what a move from one major version to
//! another (Supabase's new projects run 17) changes in the plane's cost.
//!
//! Each server gets a fresh local stack of its own, one after the other,
//! with the same workers and seconds (in a full run, after every other
//! scenario, on stacks of their own): the crate's pairs against a bare HTTP client,
//! the SQL functions against the plain-statement floor, SECURITY DEFINER
//! against INVOKER, and first claims. The two clusters' settings are printed
//! with the figures: a ratio is comparable across them, an absolute figure
//! only as far as their settings agree.

use std::sync::Arc;
use std::time::Duration;

use idempotency_plane::local::LocalStack;
use idempotency_plane::{IdempotencyService, PostgrestClient, PostgrestRepository};
use serde::Serialize;

use super::claims::claims;
use super::figure::Figure;
use super::http::{pairs_bare_http, pairs_through_crate};
use super::sql::{definer_against_invoker, functions_against_floor};
use crate::BoxError;

/// Whether an admin connection to `url` opens: checked before the run, so a
/// wrong `--also-on` fails at once.
pub(super) async fn reachable(url: &str) -> Result<(), BoxError> {
    use sqlx::Connection;
    let conn = sqlx::PgConnection::connect(url).await.map_err(|e| format!("--also-on: cannot connect: {e}"))?;
    conn.close().await?;
    Ok(())
}

/// The figures the comparison takes, by the names the main run gives them.
pub(super) const SERVER_FIGURES: &[&str] = &[
    "pairs via crate",
    "pairs via bare HTTP",
    "pairs via direct SQL",
    "pairs via floor SQL",
    "pairs via direct SQL, definer",
    "pairs via direct SQL, invoker",
    "claim idle",
];

/// Settings that change what an absolute figure means.
const SETTINGS: &[&str] = &["shared_buffers", "synchronous_commit", "max_connections", "jit"];

/// One server's figures.
#[derive(Debug, Serialize)]
pub(super) struct ServerRun {
    version: String,
    settings: Vec<(String, String)>,
    figures: Vec<Figure>,
}

impl ServerRun {
    /// What `stack`'s server is, with `figures` (every name of
    /// [`SERVER_FIGURES`]) measured on it.
    pub(super) async fn of(stack: &LocalStack, figures: Vec<Figure>) -> Result<ServerRun, BoxError> {
        let version: String =
            sqlx::query_scalar("select current_setting('server_version')").fetch_one(stack.db()).await?;
        let mut settings = Vec::new();
        for name in SETTINGS {
            let value: String =
                sqlx::query_scalar("select current_setting($1)").bind(name).fetch_one(stack.db()).await?;
            settings.push(((*name).to_owned(), value));
        }
        for name in SERVER_FIGURES {
            if !figures.iter().any(|f| f.name == *name) {
                return Err(format!("the server comparison lacks {name}").into());
            }
        }
        let figures = figures.into_iter().filter(|f| SERVER_FIGURES.contains(&f.name.as_str())).collect();
        Ok(ServerRun { version, settings, figures })
    }
}

/// Operations per second of figure `name` on `server`.
fn per_second(server: &ServerRun, name: &str) -> f64 {
    server.figures.iter().find(|f| f.name == name).map_or(f64::NAN, |f| f.per_second)
}

/// The p50 of figure `name` on `server`, in milliseconds.
fn p50_ms(server: &ServerRun, name: &str) -> f64 {
    server.figures.iter().find(|f| f.name == name).map_or(f64::NAN, |f| f.p50_ms)
}

/// The server-bound scenarios on `stack`, named as in the main run.
pub(super) async fn server_scenarios(
    stack: &LocalStack,
    workers: usize,
    duration: Duration,
) -> Result<Vec<Figure>, BoxError> {
    let client = PostgrestClient::new(stack.client_config()?.with_pool_max_idle_per_host(workers))?;
    let service = Arc::new(IdempotencyService::new(PostgrestRepository::new(client)));
    eprintln!("warming up…");
    pairs_through_crate(service.clone(), workers, Duration::from_secs(1)).await?;
    let mut figures = Vec::new();
    eprintln!("claim → complete through the crate, then from a bare HTTP client…");
    figures.push(pairs_through_crate(service.clone(), workers, duration).await?);
    figures.push(pairs_bare_http(stack, workers, duration).await?);
    eprintln!("the SQL functions alternating with the floor, then DEFINER with INVOKER…");
    let (direct, floor) = functions_against_floor(stack.db(), workers, duration).await?;
    let (definer, invoker) = definer_against_invoker(stack.db(), workers, duration).await?;
    figures.extend([direct, floor, definer, invoker]);
    eprintln!("first claims…");
    figures.push(claims(service, workers, duration, "claim idle").await?);
    Ok(figures)
}

/// The comparison's rows: `(name, value on each server)`.
fn rows(servers: &[ServerRun]) -> Vec<(&'static str, Vec<f64>)> {
    let of = |f: fn(&ServerRun) -> f64| servers.iter().map(f).collect::<Vec<f64>>();
    vec![
        ("pairs/s crate ÷ bare HTTP", of(|s| per_second(s, "pairs via crate") / per_second(s, "pairs via bare HTTP"))),
        (
            "pairs/s PostgREST server ÷ direct SQL",
            of(|s| per_second(s, "pairs via bare HTTP") / per_second(s, "pairs via direct SQL")),
        ),
        (
            "pairs/s functions (direct SQL) ÷ floor",
            of(|s| per_second(s, "pairs via direct SQL") / per_second(s, "pairs via floor SQL")),
        ),
        (
            "pairs/s SECURITY DEFINER ÷ INVOKER",
            of(|s| per_second(s, "pairs via direct SQL, definer") / per_second(s, "pairs via direct SQL, invoker")),
        ),
        ("pairs/s through the crate", of(|s| per_second(s, "pairs via crate"))),
        ("pairs/s functions (direct SQL)", of(|s| per_second(s, "pairs via direct SQL"))),
        ("claims/s, first claims", of(|s| per_second(s, "claim idle"))),
        ("claim p50 ms, first claims", of(|s| p50_ms(s, "claim idle"))),
    ]
}

/// Prints the servers side by side.
pub(super) fn print(servers: &[ServerRun]) {
    println!();
    println!("  the same scenarios on each server, one after the other in this run");
    print!("  {:<40}", "");
    for s in servers {
        print!(" {:>17}", format!("PostgreSQL {}", s.version.split_whitespace().next().unwrap_or("?")));
    }
    println!();
    for (i, (name, _)) in servers.first().map(|s| s.settings.clone()).unwrap_or_default().iter().enumerate() {
        print!("  {:<40}", name);
        for s in servers {
            print!(" {:>17}", s.settings.get(i).map_or("?", |(_, v)| v.as_str()));
        }
        println!();
    }
    print!("  {:-<40}", "");
    for _ in servers {
        print!(" {:->17}", "");
    }
    println!();
    for (name, values) in rows(servers) {
        print!("  {:<40}", name);
        for v in values {
            if v >= 100.0 {
                print!(" {:>17.0}", v);
            } else {
                print!(" {:>17.2}", v);
            }
        }
        println!();
    }
}
