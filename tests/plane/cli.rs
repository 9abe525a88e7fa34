//! The `idem` binary, run as a user runs it.

use std::process::Command;

#[test]
fn idem_demo_runs_every_effect_exactly_once_and_exits_zero() {
    let output = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["demo", "--workers", "8", "--keys", "12", "--calls-per-key", "3"])
        .env_remove("IDEM_POSTGREST_URL")
        .env_remove("SUPABASE_URL")
        .output()
        .expect("run idem demo");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "idem demo failed ({:?}):\n{stdout}\n{stderr}", output.status.code());
    assert!(stdout.contains("every effect happened exactly once"), "{stdout}");
    assert!(stdout.contains("LeaseMovedOn"), "the stalled worker was fenced off: {stdout}");
    assert!(!stdout.lines().any(|l| l.trim_start().starts_with("FAIL")), "{stdout}");
}

#[test]
fn idem_demo_stays_on_the_local_stack_when_a_deployment_is_exported() {
    // A deployment named in the environment (here one nobody answers at) is
    // not reason enough to write into it: only --remote is.
    let unreachable = crate::support::RefusedPort::new();
    let output = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["demo", "--workers", "4", "--keys", "4", "--calls-per-key", "2"])
        .env("SUPABASE_URL", unreachable.url())
        .env("IDEM_POSTGREST_URL", format!("{}/rest/v1", unreachable.url()))
        .env("SUPABASE_SECRET_KEY", "sb_secret_never_sent")
        .output()
        .expect("run idem demo");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "idem demo failed ({:?}):\n{stdout}\n{stderr}", output.status.code());
    assert!(stdout.contains("idem demo on the embedded local stack"), "{stdout}");
    assert!(stdout.contains("every effect happened exactly once"), "{stdout}");
}

#[test]
fn idem_demo_remote_without_a_deployment_names_what_to_set() {
    let output = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["demo", "--remote"])
        .env_remove("IDEM_POSTGREST_URL")
        .env_remove("SUPABASE_URL")
        .output()
        .expect("run idem demo --remote");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("IDEM_POSTGREST_URL") && stderr.contains("SUPABASE_SECRET_KEY"), "{stderr}");
}

/// Runs `idem <args>` against the plane at `url` with `key`, told the row cap
/// `max_rows` when given. Off the runtime's thread: the stack's server runs
/// on it and must keep answering.
async fn idem(url: &str, key: &str, max_rows: Option<u32>, args: &[&str]) -> std::process::Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_idem"));
    command.args(args).env_remove("SUPABASE_URL").env("IDEM_POSTGREST_URL", url).env("IDEM_SERVICE_KEY", key);
    match max_rows {
        Some(rows) => command.env("IDEM_MAX_ROWS", rows.to_string()),
        None => command.env_remove("IDEM_MAX_ROWS"),
    };
    tokio::task::spawn_blocking(move || command.output().expect("run idem")).await.expect("idem finished")
}

fn stdout(output: &std::process::Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[tokio::test]
async fn idem_doctor_passes_on_a_healthy_plane_and_names_what_is_wrong_otherwise() {
    let stack =
        crate::harness::stack_with(idempotency_plane::local::LocalStackConfig::default().with_max_rows(50)).await;
    let (url, key) = (stack.url(), stack.service_key());

    let healthy = idem(url, key, Some(50), &["doctor"]).await;
    let out = stdout(&healthy);
    assert!(healthy.status.success(), "{out}");
    assert!(out.contains("all checks passed"), "{out}");
    assert!(out.contains("ok    idempotency_try_claim"), "{out}");
    assert!(out.contains("truncates at 50 rows, as configured"), "{out}");

    // Told a cap the server does not have.
    let mismatch = idem(url, key, Some(80), &["doctor"]).await;
    let out = stdout(&mismatch);
    assert!(!mismatch.status.success(), "{out}");
    assert!(out.contains("FAIL  row cap: the server truncates at 50 rows, below the configured 80"), "{out}");

    // A key whose role cannot execute the functions.
    let wrong_role = idem(url, &stack.token_for("anon"), None, &["doctor"]).await;
    let out = stdout(&wrong_role);
    assert!(!wrong_role.status.success(), "{out}");
    assert!(out.contains("FAIL  reachable: the key's role cannot execute it"), "{out}");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn idem_sweep_reports_backlog_until_drained_and_refuses_a_bound_above_the_cap() {
    let stack =
        crate::harness::stack_with(idempotency_plane::local::LocalStackConfig::default().with_max_rows(10)).await;
    crate::harness::expired_rows(&stack, 25).await;
    let (url, key) = (stack.url(), stack.service_key());

    let refused = idem(url, key, Some(10), &["sweep", "--bound", "11"]).await;
    assert_eq!(refused.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("db-max-rows") && stderr.contains("PGRST_DB_MAX_ROWS"), "{stderr}");
    assert_eq!(crate::harness::count_rows(&stack).await, 25, "a refused bound deletes nothing");

    let mut codes = Vec::new();
    let mut reports = Vec::new();
    for _ in 0..4 {
        let pass = idem(url, key, Some(10), &["sweep", "--json"]).await;
        codes.push(pass.status.code());
        let report: serde_json::Value = serde_json::from_str(stdout(&pass).trim()).expect("one JSON report");
        reports.push((report["read"].as_u64(), report["deleted"].as_u64(), report["filled"].as_bool()));
    }
    assert_eq!(codes, [Some(3), Some(3), Some(0), Some(0)], "3 = backlog");
    assert_eq!(
        reports,
        [
            (Some(10), Some(10), Some(true)),
            (Some(10), Some(10), Some(true)),
            (Some(5), Some(5), Some(false)),
            (Some(0), Some(0), Some(false))
        ]
    );
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn idem_get_explains_a_claim_by_the_database_clock() {
    use crate::harness::*;
    let stack = stack().await;
    let org = org();
    let claim = claimed(service(&stack).claim(org, "tool.email.send", "run-1:step-2", &hash("x"), LEASE).await);
    pass_lease(&stack, claim.id()).await;
    let args = ["get", "--org", &org.to_string(), "--scope", "tool.email.send", "--key", "run-1:step-2"];
    let output = idem(stack.url(), stack.service_key(), None, &args).await;
    let out = stdout(&output);
    assert!(output.status.success(), "{out}");
    assert!(out.contains("the lease passed: its worker is gone"), "{out}");
    assert!(out.contains(&claim.lease_token().to_string()), "{out}");
    assert!(out.contains("lease        passed (by the database clock)"), "{out}");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn idem_doctor_writes_nothing_and_names_a_missing_function_and_a_higher_cap() {
    use sqlx::Executor;
    let stack =
        crate::harness::stack_with(idempotency_plane::local::LocalStackConfig::default().with_max_rows(50)).await;
    let (url, key) = (stack.url(), stack.service_key());
    let tables = "select (select count(*) from agent.idempotency_keys) + (select count(*) from agent.runs)
                       + (select count(*) from agent.provider_jobs)";

    // The server caps at 50; told 20, the probe of 21 rows comes back whole.
    let higher = idem(url, key, Some(20), &["doctor"]).await;
    let out = stdout(&higher);
    assert!(!higher.status.success(), "{out}");
    assert!(out.contains("FAIL  row cap: the server returned 21 rows for 21 asked"), "{out}");

    // A deployment that lost a function (the server's schema cache still lists it).
    stack.db().execute("drop function agent.idempotency_reclaim").await.unwrap();
    let broken = idem(url, key, Some(50), &["doctor"]).await;
    let out = stdout(&broken);
    assert!(!broken.status.success(), "{out}");
    assert!(out.contains("FAIL  idempotency_reclaim: missing"), "{out}");
    assert!(out.contains("ok    idempotency_try_claim"), "{out}");

    let rows: i64 = sqlx::query_scalar(tables).fetch_one(stack.db()).await.unwrap();
    assert_eq!(rows, 0, "doctor wrote nothing");
    stack.stop().await.unwrap();
}
