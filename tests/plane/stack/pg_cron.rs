//! The Supabase Cron recipe of docs/deploying.md (`sql/recipes/pg_cron_sweep.sql`), run
//! by pg_cron itself.
//!
//! pg_cron needs `shared_preload_libraries = 'pg_cron'`, which the shared
//! cluster does not load, so each test starts a PostgreSQL 15 cluster of its
//! own (initdb in a temporary directory, a free port on 127.0.0.1), applies
//! the embedded migrations to its `postgres` database (pg_cron's
//! `cron.database_name`, as on Supabase), schedules the recipe every minute
//! instead of hourly, waits for pg_cron to run it, and checks what the run
//! deleted. The cluster is stopped (`pg_ctl stop -m immediate`) and its
//! directory removed when the test ends, passed or failed.
//!
//! pg_cron runs a job over a client connection (the default, to
//! `cron.host`, localhost) or in a background worker
//! (`cron.use_background_workers = on`); a test for each. Each waits for the
//! next minute boundary, so each takes up to about a minute.
//!
//! Needs the PostgreSQL 15 server binaries and Debian's pg_cron
//! (`apt-get install -y postgresql-15-cron`; `.ci/run` installs it). Without
//! them the tests fail under CI (`CI` or `IDEM_REQUIRE_PG_CRON` set, as
//! `.ci/run` does) and are skipped, saying so, elsewhere. As root, the cluster runs as the `postgres` system user
//! (initdb refuses root).

use std::path::Path;
use std::time::{Duration, Instant};

use idempotency_plane::migrations::MIGRATIONS;
use sqlx::{AssertSqlSafe, Connection, Row};

use crate::support::cluster::{Cluster, PG_BIN};

/// The recipe, exactly as docs/deploying.md quotes it.
const RECIPE: &str = include_str!("../../../sql/recipes/pg_cron_sweep.sql");
/// The guide's check of the last runs.
const CHECK: &str = "select * from cron.job_run_details order by start_time desc limit 5;";
/// The guide's way to stop the sweep.
const UNSCHEDULE: &str = "select cron.unschedule('idempotency-sweep');";

/// The recipe's schedule, and the one the tests run it on.
const HOURLY: &str = "'17 * * * *'";
const EVERY_MINUTE: &str = "'* * * * *'";
/// The recipe's sweep, and one whose bound is above the default row cap.
const SWEEP: &str = "agent.idempotency_sweep(1000)";
const ABOVE_CAP: &str = "agent.idempotency_sweep(1001)";

const PG_CRON: &str = "/usr/lib/postgresql/15/lib/pg_cron.so";

/// How long a test waits for pg_cron's runs: up to two minute boundaries
/// (a job scheduled in the last instant of a minute may first run at the
/// one after next), and a margin for a busy machine.
const RUN_DEADLINE: Duration = Duration::from_secs(125);

/// Claims past retention: exactly the recipe's bound, so the run fills it.
const EXPIRED: i64 = 1000;

/// `text` with `from` replaced by `to`, where `from` occurs exactly once.
fn replace_once(text: &str, from: &str, to: &str) -> String {
    assert_eq!(text.matches(from).count(), 1, "{from} occurs once in the recipe:\n{text}");
    text.replacen(from, to, 1)
}

/// The recipe's statements: the file without its comment lines.
fn recipe_statements() -> String {
    RECIPE.lines().filter(|line| !line.starts_with("--")).collect::<Vec<_>>().join("\n").trim().to_owned()
}

#[test]
fn the_deploying_guide_quotes_the_recipe_its_check_and_its_unschedule_exactly() {
    let guide = include_str!("../../../docs/deploying.md");
    let section = guide
        .split("**Sweeping with Supabase Cron.**")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("docs/deploying.md has a section \"Sweeping with Supabase Cron\"");
    let statements = recipe_statements();
    assert!(statements.starts_with("create extension if not exists pg_cron;"), "{statements}");
    assert!(section.contains(&statements), "docs/deploying.md quotes sql/recipes/pg_cron_sweep.sql:\n{statements}");
    for statement in [CHECK, UNSCHEDULE] {
        assert!(section.contains(statement), "docs/deploying.md shows {statement}");
    }
    // Hourly, at the default row cap (the bound the recipe's sweep may take).
    assert!(statements.contains(HOURLY) && statements.contains(SWEEP), "{statements}");
    let default_cap =
        idempotency_plane::postgrest::ClientConfig::new("http://localhost", "key").expect("a config").max_rows();
    assert_eq!(SWEEP, format!("agent.idempotency_sweep({default_cap})"));
}

/// How pg_cron runs a job.
#[derive(Debug, Clone, Copy)]
enum Mode {
    /// A client connection to `cron.host` (localhost), pg_cron's default.
    Connection,
    /// A background worker of the server.
    BackgroundWorker,
}

/// Whether pg_cron and the server binaries are here. Without them: a
/// failure under CI, a notice (and `false`) elsewhere.
fn pg_cron_installed(test: &str) -> bool {
    let missing: Vec<&str> = [format!("{PG_BIN}/initdb"), format!("{PG_BIN}/pg_ctl"), PG_CRON.to_owned()]
        .iter()
        .filter(|path| !Path::new(path).exists())
        .map(|path| {
            if path.ends_with("pg_cron.so") {
                "pg_cron (postgresql-15-cron)"
            } else {
                "PostgreSQL 15's server binaries"
            }
        })
        .collect();
    if missing.is_empty() {
        return true;
    }
    let set = |name: &str| std::env::var(name).is_ok_and(|value| !value.is_empty() && value != "false" && value != "0");
    let required = set("CI") || set("IDEM_REQUIRE_PG_CRON");
    let message = format!(
        "{test}: {} not installed (looked for {PG_BIN}/initdb and {PG_CRON}); \
         install them with `apt-get install -y postgresql-15-cron` (.ci/run does)",
        missing.join(" and ")
    );
    assert!(!required, "CI (or IDEM_REQUIRE_PG_CRON) is set, so the pg_cron recipe must be tested: {message}");
    eprintln!("SKIPPED {message}");
    false
}

/// The claims a run must keep: retention holds for each.
const KEPT: [&str; 3] = ["kept-completed", "kept-live-lease", "kept-passed-lease"];

/// Runs the recipe through pg_cron in `mode` and checks what it swept.
async fn the_recipe_sweeps_through_pg_cron(mode: Mode, test: &str) {
    if !pg_cron_installed(test) {
        return;
    }
    let began = Instant::now();
    let background_workers = match mode {
        Mode::Connection => "off",
        Mode::BackgroundWorker => "on",
    };
    let cluster = Cluster::start(
        "pg-cron",
        &format!(
            "-c shared_preload_libraries=pg_cron -c cron.database_name=postgres \
             -c cron.use_background_workers={background_workers}"
        ),
    );
    let mut admin = cluster.connect("postgres").await;
    for (file, sql) in MIGRATIONS {
        sqlx::raw_sql(*sql).execute(&mut admin).await.unwrap_or_else(|e| panic!("applying {file}: {e}"));
    }

    // Arrange: claims past retention, exactly the recipe's bound of them,
    // half completed and half processing (their lease long gone), and three
    // claims whose retention holds: completed, with a live lease, and with a
    // lease that passed.
    sqlx::query(
        "insert into agent.idempotency_keys
           (organization_id, scope, key, request_hash, status, lease_token, response,
            claimed_at, lease_expires_at, retain_until)
         select gen_random_uuid(), 'tool.x', 'expired-' || i, repeat('a', 64),
                case when i % 2 = 0 then 'completed' else 'processing' end, gen_random_uuid(),
                case when i % 2 = 0 then '1'::jsonb end,
                now() - interval '31 days', now() - interval '31 days', now() - interval '1 day' + i * interval '1 second'
           from generate_series(1, $1) i",
    )
    .bind(EXPIRED)
    .execute(&mut admin)
    .await
    .expect("expired claims");
    sqlx::raw_sql(
        "insert into agent.idempotency_keys
           (organization_id, scope, key, request_hash, status, lease_token, response,
            claimed_at, lease_expires_at, retain_until)
         values
           (gen_random_uuid(), 'tool.x', 'kept-completed', repeat('b', 64), 'completed', gen_random_uuid(), '1',
            now() - interval '1 day', now() - interval '1 day', now() + interval '29 days'),
           (gen_random_uuid(), 'tool.x', 'kept-live-lease', repeat('c', 64), 'processing', gen_random_uuid(), null,
            now(), now() + interval '1 hour', now() + interval '30 days'),
           (gen_random_uuid(), 'tool.x', 'kept-passed-lease', repeat('d', 64), 'processing', gen_random_uuid(), null,
            now() - interval '2 minutes', now() - interval '1 minute', now() + interval '30 days')",
    )
    .execute(&mut admin)
    .await
    .expect("claims retention holds");

    // The recipe with a bound above the row cap, run by the superuser on a
    // cluster without pg_cron's extension: its first statement creates it
    // (on Supabase, the Dashboard's Integrations → Cron does, or that
    // statement run as postgres).
    let above_cap = replace_once(&replace_once(RECIPE, HOURLY, EVERY_MINUTE), SWEEP, ABOVE_CAP).replacen(
        "'idempotency-sweep'",
        "'idempotency-sweep-above-cap'",
        1,
    );
    sqlx::raw_sql(AssertSqlSafe(above_cap)).execute(&mut admin).await.expect("schedule the sweep above the cap");
    // The recipe itself, every minute, scheduled as Supabase's postgres would:
    // a role that is no superuser, a member of service_role, and allowed to
    // use pg_cron.
    sqlx::raw_sql(
        "create role scheduler login;
         grant service_role to scheduler;
         grant usage on schema cron to scheduler;",
    )
    .execute(&mut admin)
    .await
    .expect("the scheduling role");
    let mut scheduler = cluster.connect("scheduler").await;
    let every_minute = replace_once(RECIPE, HOURLY, EVERY_MINUTE);
    sqlx::raw_sql(AssertSqlSafe(every_minute)).execute(&mut scheduler).await.expect("run the recipe");

    // Act: wait for pg_cron to run both jobs.
    let scheduled = Instant::now();
    let runs = loop {
        let runs: Vec<(String, String, String, String)> = sqlx::query_as(
            "select j.jobname, j.username, d.status, coalesce(d.return_message, '')
               from cron.job_run_details d join cron.job j on j.jobid = d.jobid
              where d.status in ('succeeded', 'failed')
              order by d.start_time",
        )
        .fetch_all(&mut admin)
        .await
        .expect("read the runs");
        let ran = |job: &str| runs.iter().any(|(name, ..)| name == job);
        if ran("idempotency-sweep") && ran("idempotency-sweep-above-cap") {
            break runs;
        }
        assert!(
            scheduled.elapsed() < RUN_DEADLINE,
            "pg_cron ran no sweep within {RUN_DEADLINE:?} (runs: {runs:?}); the server's log:\n{}",
            cluster.log()
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    let waited = scheduled.elapsed();

    // Assert: the recipe's run succeeded, as the role that scheduled it, and
    // swept exactly the claims past retention; the one above the row cap
    // was refused, and its refusal is the run's message.
    let run_of = |job: &str| runs.iter().find(|(name, ..)| name == job).expect("a run");
    let (_, user, status, message) = run_of("idempotency-sweep");
    assert_eq!((user.as_str(), status.as_str()), ("scheduler", "succeeded"), "{message}; runs: {runs:?}");
    let (_, _, status, message) = run_of("idempotency-sweep-above-cap");
    assert_eq!(status, "failed", "{message}");
    assert!(message.contains("p_bound 1001 is above the row cap 1000"), "{message}");
    let left: Vec<String> = sqlx::query_scalar("select key from agent.idempotency_keys order by key")
        .fetch_all(&mut admin)
        .await
        .expect("the claims left");
    assert_eq!(left, KEPT, "every claim past retention swept, every other kept");
    // The run read its whole bound: the sweep warned that the backlog may be
    // larger, in the server's log (where a Supabase project's logs show it).
    let warning = format!("idempotency sweep read {EXPIRED} expired claims, its whole bound");
    let logged = Instant::now();
    while !cluster.log().contains(&warning) {
        assert!(logged.elapsed() < Duration::from_secs(10), "no {warning:?} in the server's log:\n{}", cluster.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The guide's check shows the run to the role that scheduled it, and
    // its unschedule stops the job.
    let shown = sqlx::raw_sql(CHECK).fetch_all(&mut scheduler).await.expect("the guide's check");
    assert!(!shown.is_empty(), "the check shows the run");
    assert!(shown.iter().all(|row| row.get::<String, _>("username") == "scheduler"), "only the role's own runs");
    let unscheduled: bool =
        sqlx::raw_sql(UNSCHEDULE).fetch_one(&mut scheduler).await.expect("the guide's unschedule").get(0);
    assert!(unscheduled);
    let jobs: Vec<String> = sqlx::query_scalar("select jobname from cron.job order by jobname")
        .fetch_all(&mut admin)
        .await
        .expect("the jobs left");
    assert_eq!(jobs, ["idempotency-sweep-above-cap"], "the recipe's job is gone");

    let _ = scheduler.close().await;
    let _ = admin.close().await;
    drop(cluster);
    eprintln!("{test} ({mode:?}): pg_cron ran the sweep {waited:.1?} after scheduling; {:.1?} in all", began.elapsed());
}

#[tokio::test]
async fn the_recipe_sweeps_through_pg_cron_over_a_client_connection() {
    the_recipe_sweeps_through_pg_cron(Mode::Connection, "the_recipe_sweeps_through_pg_cron_over_a_client_connection")
        .await;
}

#[tokio::test]
async fn the_recipe_sweeps_through_pg_cron_in_a_background_worker() {
    the_recipe_sweeps_through_pg_cron(
        Mode::BackgroundWorker,
        "the_recipe_sweeps_through_pg_cron_in_a_background_worker",
    )
    .await;
}
