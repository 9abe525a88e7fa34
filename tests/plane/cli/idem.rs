//! The `idem` binary, run as a user runs it.

use std::process::Command;
use std::time::Duration;

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
    let unreachable = crate::support::transport::RefusedPort::new();
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
    assert_eq!(output.status.code(), Some(2), "a configuration error, found before any request: {stderr}");
    assert!(stderr.contains("IDEM_POSTGREST_URL") && stderr.contains("SUPABASE_SECRET_KEY"), "{stderr}");
}

/// Runs `idem <args>` against the plane at `url` with `key`, told the row cap
/// `max_rows` when given; killed if it runs past two minutes.
async fn idem(url: &str, key: &str, max_rows: Option<u32>, args: &[&str]) -> std::process::Output {
    idem_with(url, key, max_rows, &[], args).await
}

/// [`idem`] with the variables `env` set besides (no webhook handler's
/// variable is inherited from the test's environment).
async fn idem_with(
    url: &str,
    key: &str,
    max_rows: Option<u32>,
    env: &[(&str, &str)],
    args: &[&str],
) -> std::process::Output {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"));
    command
        .args(args)
        .env_remove("SUPABASE_URL")
        .env_remove("IDEM_WEBHOOK_BODY_LIMIT_BYTES")
        .env_remove("IDEM_WEBHOOK_SCOPE")
        .env("IDEM_POSTGREST_URL", url)
        .env("IDEM_SERVICE_KEY", key)
        .envs(env.iter().copied())
        .kill_on_drop(true);
    match max_rows {
        Some(rows) => command.env("IDEM_MAX_ROWS", rows.to_string()),
        None => command.env_remove("IDEM_MAX_ROWS"),
    };
    crate::support::harness::within(Duration::from_secs(120), "idem", command.output()).await.expect("run idem")
}

/// Runs `idem <args>` with `input` on stdin, against the plane at `url`.
async fn claim_with_stdin(url: &str, key: &str, args: &[&str], input: &str) -> std::process::Output {
    use tokio::io::AsyncWriteExt;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(args)
        .env_remove("SUPABASE_URL")
        .env("IDEM_POSTGREST_URL", url)
        .env("IDEM_SERVICE_KEY", key)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn idem");
    let mut stdin = child.stdin.take().expect("stdin");
    stdin.write_all(input.as_bytes()).await.expect("write stdin");
    drop(stdin);
    crate::support::harness::within(Duration::from_secs(120), "idem", child.wait_with_output()).await.expect("run idem")
}

#[tokio::test]
async fn idem_claim_only_reads_unless_told_to_hold_and_takes_the_plane_from_flags() {
    let stack = crate::support::harness::stack().await;
    let org = uuid::Uuid::new_v4().to_string();
    let base = ["--org", org.as_str(), "--scope", "tool.email.send", "--key", "k-1"];
    let flags = ["--url", stack.url(), "--service-key", stack.service_key()];
    let with = |extra: &[&'static str]| -> Vec<String> {
        let mut args = vec!["claim".to_owned()];
        args.extend(extra.iter().map(|a| (*a).to_owned()));
        args.extend(base.iter().chain(flags.iter()).map(|a| (*a).to_owned()));
        args
    };
    let run = |args: Vec<String>| async move {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        // The environment names no plane: the flags alone do.
        claim_with_stdin("", "", &refs, r#"{"to":"a@example.com"}"#).await
    };
    let line = |output: &std::process::Output| -> serde_json::Value {
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        serde_json::from_str(stdout(output).trim()).expect("one JSON line")
    };
    let asked = line(&run(with(&[])).await);
    assert_eq!((asked["outcome"].as_str(), asked["would_run"].as_bool()), (Some("absent"), Some(true)), "{asked}");
    // Asking wrote nothing: the first real claim takes the key, and holds it.
    let held = line(&run(with(&["--hold"])).await);
    assert_eq!((held["outcome"].as_str(), held["held"].as_bool()), (Some("claimed"), Some(true)), "{held}");
    let asked = line(&run(with(&[])).await);
    assert_eq!(asked["outcome"].as_str(), Some("processing"), "{asked}");
    assert_eq!(crate::support::harness::count_rows(&stack).await, 1);
    stack.stop().await.unwrap();
}

fn stdout(output: &std::process::Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[tokio::test]
async fn idem_doctor_passes_on_a_healthy_plane_and_names_what_is_wrong_otherwise() {
    let stack =
        crate::support::harness::stack_with(idempotency_plane::local::LocalStackConfig::default().with_max_rows(50))
            .await;
    let (url, key) = (stack.url(), stack.service_key());

    let healthy = idem(url, key, Some(50), &["doctor"]).await;
    let out = stdout(&healthy);
    assert!(healthy.status.success(), "{out}");
    assert!(out.contains("all checks passed"), "{out}");
    assert!(out.contains("ok    idempotency_try_claim"), "{out}");
    assert!(out.contains("truncates at 50 rows, as configured"), "{out}");
    assert!(out.contains("ok    plane row cap: the plane holds answers to 50 rows, the server's cap"), "{out}");
    assert!(
        out.contains(
            "ok    public functions: no function of schema agent is executable by PUBLIC, anon or authenticated"
        ),
        "{out}"
    );

    // Told a cap the server does not have.
    let mismatch = idem(url, key, Some(80), &["doctor"]).await;
    let out = stdout(&mismatch);
    assert!(!mismatch.status.success(), "{out}");
    assert!(out.contains("FAIL  row cap: the server truncates at 50 rows, below the configured 80"), "{out}");

    // A plane whose own cap is not the server's: it would claim rows the
    // server cuts from the answer.
    crate::support::harness::set_plane_row_cap(&stack, 80).await;
    let plane_above = idem(url, key, Some(50), &["doctor"]).await;
    let out = stdout(&plane_above);
    assert!(!plane_above.status.success(), "{out}");
    assert!(
        out.contains("FAIL  plane row cap: the plane holds answers to 80 rows but the server cuts them at 50"),
        "{out}"
    );
    crate::support::harness::set_plane_row_cap(&stack, 50).await;

    // A key whose role cannot execute the functions.
    let wrong_role = idem(url, &stack.token_for("anon"), None, &["doctor"]).await;
    let out = stdout(&wrong_role);
    assert!(!wrong_role.status.success(), "{out}");
    assert!(out.contains("FAIL  reachable: the key's role may not execute the plane's functions"), "{out}");
    stack.stop().await.unwrap();
}

/// On Supabase, supautils runs no user event trigger for a superuser, so a
/// function a superuser creates in schema agent keeps PostgreSQL's default:
/// PUBLIC may execute it. Here the trigger is disabled around the create,
/// which leaves the function exactly so.
#[tokio::test]
async fn idem_doctor_names_a_function_public_may_execute_and_its_owner() {
    use sqlx::Executor;
    let stack = crate::support::harness::stack().await;
    let (url, key) = (stack.url(), stack.service_key());
    stack
        .db()
        .execute(
            "alter event trigger idempotency_private_functions disable;
             create function agent.report_totals(p_day date) returns integer language sql as 'select 1';
             alter event trigger idempotency_private_functions enable;",
        )
        .await
        .unwrap();
    let owner: String = sqlx::query_scalar("select current_user::text").fetch_one(stack.db()).await.unwrap();

    let exposed = idem(url, key, None, &["doctor"]).await;
    let out = stdout(&exposed);
    assert!(!exposed.status.success(), "{out}");
    assert!(
        out.contains(&format!(
            "FAIL  public functions: agent.report_totals(p_day date) owned by {owner} \
             (executable by PUBLIC, anon, authenticated)"
        )),
        "{out}"
    );
    // The plane's own functions are all still as they were.
    assert!(out.contains("ok    idempotency_claim"), "{out}");

    // Revoked from PUBLIC, then granted to authenticated on purpose: still
    // reachable by every signed-in user.
    stack
        .db()
        .execute("revoke execute on function agent.report_totals(date) from public; grant execute on function agent.report_totals(date) to authenticated")
        .await
        .unwrap();
    let granted = idem(url, key, None, &["doctor"]).await;
    let out = stdout(&granted);
    assert!(!granted.status.success(), "{out}");
    assert!(
        out.contains("agent.report_totals(p_day date) owned by") && out.contains("(executable by authenticated)"),
        "{out}"
    );

    stack.db().execute("revoke execute on function agent.report_totals(date) from authenticated").await.unwrap();
    let private = idem(url, key, None, &["doctor"]).await;
    let out = stdout(&private);
    assert!(private.status.success(), "{out}");
    assert!(out.contains("ok    public functions"), "{out}");
    stack.stop().await.unwrap();
}

/// One body limit: the webhook handler takes bodies up to its limit
/// (`IDEM_WEBHOOK_BODY_LIMIT_BYTES`, default 256 KiB), and every policy
/// row under its scope must store one that large with its claim (at most
/// 4 × ⌈n / 3⌉ + 18 bytes); a row that keeps less answers such a delivery
/// 413 on every delivery, forever, and the doctor names it.
#[tokio::test]
async fn idem_doctor_fails_when_a_webhook_scope_cannot_store_what_the_handler_takes() {
    use sqlx::Executor;
    let stack = crate::support::harness::stack().await;
    let (url, key) = (stack.url(), stack.service_key());
    let check = |out: &str| -> String {
        out.lines().find(|line| line.contains("webhook body limit:")).unwrap_or_default().to_owned()
    };

    // As shipped: webhook.* keeps 384 KiB, the default 256 KiB fits.
    let shipped = idem(url, key, None, &["doctor"]).await;
    let out = stdout(&shipped);
    assert!(shipped.status.success(), "{out}");
    assert_eq!(
        check(&out),
        "ok    webhook body limit: the handler takes bodies up to 262144 bytes (IDEM_WEBHOOK_BODY_LIMIT_BYTES), \
         stored as at most 349546 bytes of work; webhook.* keeps 393216",
        "{out}"
    );

    // A handler told 1 MiB: the scope cannot store what it takes.
    let raised = idem_with(url, key, None, &[("IDEM_WEBHOOK_BODY_LIMIT_BYTES", "1048576")], &["doctor"]).await;
    let out = stdout(&raised);
    assert!(!raised.status.success(), "{out}");
    assert_eq!(
        check(&out),
        "FAIL  webhook body limit: the handler takes bodies up to 1048576 bytes (IDEM_WEBHOOK_BODY_LIMIT_BYTES), \
         stored as up to 1398122 bytes of work, but webhook.* keeps 393216: a signed delivery above 294897 bytes \
         may be answered 413 on every delivery. Raise max_request_bytes to at least 1398122 in a migration, or \
         lower the handler's limit to 294897",
        "{out}"
    );

    // A scope under the family that keeps the old 64 KiB: named, alone.
    stack
        .db()
        .execute("insert into agent.idempotency_scopes values ('webhook.github', interval '1 day', 65536, 65536, 5)")
        .await
        .unwrap();
    let narrow = idem(url, key, None, &["doctor", "--json"]).await;
    let report: serde_json::Value = serde_json::from_str(stdout(&narrow).trim()).expect("one JSON object");
    assert_eq!(report["ok"], false);
    let line = report["checks"]
        .as_array()
        .and_then(|checks| checks.iter().find(|c| c["check"] == "webhook body limit"))
        .expect("the check")
        .clone();
    assert_eq!(line["ok"], false);
    let detail = line["detail"].as_str().unwrap_or_default();
    assert!(detail.contains("but webhook.github keeps 65536: a signed delivery above 49137 bytes"), "{detail}");
    assert!(!detail.contains("webhook.* keeps"), "the family stores it: {detail}");

    // The handler of that scope told its own, smaller limit, by flags.
    let agreed =
        idem(url, key, None, &["doctor", "--webhook-scope", "webhook.github", "--webhook-body-limit", "49137"]).await;
    let out = stdout(&agreed);
    assert!(agreed.status.success(), "{out}");
    assert_eq!(
        check(&out),
        "ok    webhook body limit: the handler takes bodies up to 49137 bytes (IDEM_WEBHOOK_BODY_LIMIT_BYTES), \
         stored as at most 65534 bytes of work; webhook.github keeps 65536",
        "{out}"
    );
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn idem_doctor_reports_orphaned_work_per_scope_and_fails_when_nothing_re_drives_it() {
    let stack = crate::support::harness::stack().await;
    let (url, key) = (stack.url(), stack.service_key());
    let healthy = idem(url, key, None, &["doctor"]).await;
    assert!(stdout(&healthy).contains("ok    orphans: no claim waits for a re-drive"), "{}", stdout(&healthy));

    // Work whose worker is gone: two orphans of webhook.stripe, one waiting
    // a minute, one an hour; and one of tool.x waiting a minute.
    let orphan = |scope: &'static str, key: &'static str, waited: &'static str| {
        sqlx::query(
            "insert into agent.idempotency_keys
               (organization_id, scope, key, request_hash, status, lease_token, claimed_at, lease_expires_at,
                retain_until, request, redrive_at)
             values (gen_random_uuid(), $1, $2, repeat('a', 64), 'processing', gen_random_uuid(),
                     now() - $3::interval - interval '1 minute', now() - $3::interval, now() + interval '31 days',
                     '{\"n\": 1}', now() - $3::interval)",
        )
        .bind(scope)
        .bind(key)
        .bind(waited)
        .execute(stack.db())
    };
    orphan("webhook.stripe", "evt-1", "1 minute").await.unwrap();
    orphan("tool.x", "k-1", "1 minute").await.unwrap();
    let waiting = idem(url, key, None, &["doctor"]).await;
    let out = stdout(&waiting);
    assert!(waiting.status.success(), "waiting a minute is waiting for the next re-drive: {out}");
    assert!(
        out.contains("ok    orphans: tool.x 1 (oldest waiting 6") || out.contains("ok    orphans: webhook.stripe 1"),
        "{out}"
    );
    assert!(out.contains("waiting for the next re-drive"), "{out}");

    orphan("webhook.stripe", "evt-2", "1 hour").await.unwrap();
    let stale = idem(url, key, None, &["doctor"]).await;
    let out = stdout(&stale);
    assert!(!stale.status.success(), "{out}");
    assert!(out.contains("FAIL  orphans: webhook.stripe 2 (oldest waiting 36"), "most orphans first: {out}");
    assert!(out.contains("tool.x 1") && out.contains("nothing re-drives it"), "{out}");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn idem_failures_lists_journaled_failures_and_redrive_failed_sends_the_chosen_back_once() {
    let stack = crate::support::harness::stack().await;
    let (url, key) = (stack.url(), stack.service_key());
    let org = uuid::Uuid::new_v4();
    // Two failures carrying their work (one a dead letter), one without,
    // and one success.
    let journal = |key: &'static str, response: &'static str, work: Option<&'static str>| {
        sqlx::query(
            "insert into agent.idempotency_keys
               (organization_id, scope, key, request_hash, status, lease_token, lease_expires_at, retain_until,
                response, request)
             values ($1, 'webhook.stripe', $2, repeat('a', 64), 'completed', gen_random_uuid(), now(),
                     now() + interval '1 day', $3::jsonb, $4::jsonb)
             returning id",
        )
        .bind(org)
        .bind(key)
        .bind(response)
        .bind(work)
        .fetch_one(stack.db())
    };
    let failed: uuid::Uuid = sqlx::Row::get(
        &journal("evt-1", r#"{"ok":false,"error":"downstream 500","output":null}"#, Some(r#"{"body_text":"{}"}"#))
            .await
            .unwrap(),
        0,
    );
    let id_of = |row: sqlx::postgres::PgRow| -> uuid::Uuid { sqlx::Row::get(&row, 0) };
    let lettered = id_of(
        journal("evt-2", r#"{"ok":false,"error":"dead_lettered","output":{"attempts":5}}"#, Some("{}")).await.unwrap(),
    );
    let workless = id_of(journal("evt-3", r#"{"ok":false,"error":"bad","output":null}"#, None).await.unwrap());
    let succeeded = id_of(journal("evt-4", r#"{"ok":true,"output":1}"#, Some("{}")).await.unwrap());

    // `idem get` on a failure says it failed, with its error and attempts,
    // and whether it can be sent back: with the command, or why not.
    let org_text = org.to_string();
    let get = |claim_key: &'static str, json: bool| {
        let org_text = org_text.clone();
        async move {
            let mut args = vec!["get", "--org", &org_text, "--scope", "webhook.stripe", "--key", claim_key];
            if json {
                args.push("--json");
            }
            idem(url, key, None, &args).await
        }
    };
    let sendable = get("evt-2", false).await;
    assert_eq!(sendable.status.code(), Some(0), "{}", String::from_utf8_lossy(&sendable.stderr));
    let said = stdout(&sendable);
    assert!(said.contains("failed — every repeat replays this failure"), "{said}");
    assert!(said.contains("error        dead_lettered") && said.contains("attempts     1"), "{said}");
    assert!(
        said.contains(&format!(
            "send back    yes, once the cause is fixed: idem redrive --failed --scope webhook.stripe --id {lettered}"
        )),
        "{said}"
    );
    let stuck = stdout(&get("evt-3", false).await);
    assert!(stuck.contains("send back    no: its work was not kept"), "{stuck}");
    let as_json: serde_json::Value = serde_json::from_str(stdout(&get("evt-3", true).await).trim()).expect("JSON");
    assert_eq!(
        (&as_json["state"], &as_json["error"], &as_json["redrivable"], &as_json["redrive_verdict"]),
        (
            &serde_json::json!("failed"),
            &serde_json::json!("bad"),
            &serde_json::json!(false),
            &serde_json::json!("no_work")
        ),
        "{as_json}"
    );
    let fine = stdout(&get("evt-4", false).await);
    assert!(fine.contains("completed — every repeat replays") && !fine.contains("send back"), "{fine}");

    let listed = idem(url, key, None, &["failures", "--scope", "webhook.*", "--org", &org_text, "--json"]).await;
    assert_eq!(listed.status.code(), Some(0), "{}", String::from_utf8_lossy(&listed.stderr));
    let rows: Vec<serde_json::Value> =
        stdout(&listed).lines().map(|line| serde_json::from_str(line).expect("a JSON line")).collect();
    let mut keys: Vec<(&str, &str, bool)> = rows
        .iter()
        .map(|row| (row["key"].as_str().unwrap(), row["error"].as_str().unwrap(), row["redrivable"].as_bool().unwrap()))
        .collect();
    keys.sort();
    assert_eq!(keys, [("evt-1", "downstream 500", true), ("evt-2", "dead_lettered", true), ("evt-3", "bad", false)]);
    let page =
        idem(url, key, None, &["failures", "--scope", "webhook.stripe", "--org", &org_text, "--bound", "2"]).await;
    assert_eq!(page.status.code(), Some(3), "a page that filled its bound: {}", stdout(&page));
    assert!(stdout(&page).contains("2 journaled failures of webhook.stripe (bound 2)"), "{}", stdout(&page));
    // Without --scope: every scope's failures, a tool's beside the webhooks'.
    sqlx::query(
        "insert into agent.idempotency_keys
           (organization_id, scope, key, request_hash, status, lease_token, lease_expires_at, retain_until, response)
         values ($1, 'tool.x', 'step-1', repeat('a', 64), 'completed', gen_random_uuid(), now(),
                 now() + interval '1 day', '{\"ok\":false,\"error\":\"tool failed\",\"output\":null}')",
    )
    .bind(org)
    .execute(stack.db())
    .await
    .unwrap();
    let every = idem(url, key, None, &["failures", "--org", &org_text]).await;
    assert_eq!(every.status.code(), Some(0), "{}", String::from_utf8_lossy(&every.stderr));
    assert!(stdout(&every).contains("4 journaled failures of every scope"), "{}", stdout(&every));
    assert!(
        stdout(&every).contains("tool.x/step-1") && stdout(&every).contains("webhook.stripe/evt-1"),
        "{}",
        stdout(&every)
    );

    let failed_text = failed.to_string();
    let sent = idem(url, key, None, &["redrive", "--failed", "--scope", "webhook.stripe", "--id", &failed_text]).await;
    assert_eq!(sent.status.code(), Some(0), "{}", String::from_utf8_lossy(&sent.stderr));
    assert!(stdout(&sent).contains("1 failure(s) sent back to re-drive"), "{}", stdout(&sent));
    assert!(stdout(&sent).contains("downstream 500"), "it names what it replaced: {}", stdout(&sent));
    let again = idem(url, key, None, &["redrive", "--failed", "--scope", "webhook.stripe", "--id", &failed_text]).await;
    assert!(stdout(&again).contains("0 failure(s) sent back"), "once: {}", stdout(&again));
    assert_eq!(again.status.code(), Some(1), "a named failure not sent back is an error");
    let why = String::from_utf8_lossy(&again.stderr);
    assert!(
        why.contains(&format!("not sent back: {failed} (webhook.stripe/evt-1): processing with its lease passed")),
        "{why}"
    );
    // Every --id not sent back is named with its reason; no --scope is
    // needed when the ids name the failures.
    let absent = uuid::Uuid::new_v4();
    let named: Vec<String> = [workless, succeeded, absent].iter().map(ToString::to_string).collect();
    let mut args = vec!["redrive", "--failed"];
    for id in &named {
        args.extend(["--id", id.as_str()]);
    }
    let refused = idem(url, key, None, &args).await;
    assert_eq!(refused.status.code(), Some(1), "{}", stdout(&refused));
    let why = String::from_utf8_lossy(&refused.stderr);
    for expected in [
        format!("not sent back: {workless} (webhook.stripe/evt-3): its work was not kept"),
        format!("not sent back: {succeeded} (webhook.stripe/evt-4): it succeeded"),
        format!("not sent back: {absent}: no claim has this id"),
    ] {
        assert!(why.contains(&expected), "{expected:?} in {why}");
    }
    let outside = idem(url, key, None, &["redrive", "--failed", "--scope", "tool.*", "--id", &named[0]]).await;
    assert_eq!(outside.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&outside.stderr).contains("it is in another scope than --scope"));
    let (status, replaced): (String, serde_json::Value) =
        sqlx::query_as("select status, replaced from agent.idempotency_keys where id = $1")
            .bind(failed)
            .fetch_one(stack.db())
            .await
            .unwrap();
    assert_eq!(status, "processing", "an orphan again, for the next re-drive");
    assert_eq!(replaced[0]["response"]["error"], "downstream 500", "kept for the audit: {replaced}");

    // Every failure of the scope since an instant: the dead letter; the one
    // without work stays.
    let since = (chrono::Utc::now() - chrono::TimeDelta::hours(1)).to_rfc3339();
    let all =
        idem(url, key, None, &["redrive", "--failed", "--scope", "webhook.*", "--org", &org_text, "--since", &since])
            .await;
    assert!(stdout(&all).contains("1 failure(s) sent back"), "{}", stdout(&all));
    let left = idem(url, key, None, &["failures", "--scope", "webhook.*", "--org", &org_text, "--json"]).await;
    assert_eq!(stdout(&left).lines().count(), 1, "{}", stdout(&left));
    // And every scope's, sent back at once: the tool's has no work to run again.
    let everywhere =
        idem(url, key, None, &["redrive", "--failed", "--scope", "*", "--org", &org_text, "--since", &since]).await;
    assert!(stdout(&everywhere).contains("0 failure(s) sent back"), "{}", stdout(&everywhere));

    // Refused before any request: nothing chosen, a schedule, a bound above the cap.
    for args in [
        vec!["redrive", "--failed", "--scope", "webhook.stripe"],
        vec!["redrive", "--failed", "--scope", "webhook.stripe", "--since", &since, "--every", "1m"],
        vec!["redrive", "--failed", "--since", &since],
        vec!["failures", "--scope", "webhook.*", "--bound", "5000"],
        vec!["failures", "--scope", "webhook.*", "--since", "yesterday"],
    ] {
        let refused = idem(url, key, None, &args).await;
        assert_eq!(refused.status.code(), Some(2), "{args:?}: {}", String::from_utf8_lossy(&refused.stderr));
    }
    let unknown = idem(url, key, None, &["failures", "--scope", "nope.*"]).await;
    let said = String::from_utf8_lossy(&unknown.stderr);
    assert_eq!(unknown.status.code(), Some(1), "the plane refused it: {said}");
    assert!(said.contains("unknown scope \"nope.*\""), "{said}");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn idem_sweep_reports_backlog_until_drained_and_refuses_a_bound_above_the_cap() {
    let stack =
        crate::support::harness::stack_with(idempotency_plane::local::LocalStackConfig::default().with_max_rows(10))
            .await;
    crate::support::harness::expired_rows(&stack, 25).await;
    let (url, key) = (stack.url(), stack.service_key());

    let refused = idem(url, key, Some(10), &["sweep", "--bound", "11"]).await;
    assert_eq!(refused.status.code(), Some(2), "refused before any request: a usage error");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("db-max-rows") && stderr.contains("PGRST_DB_MAX_ROWS"), "{stderr}");
    assert_eq!(crate::support::harness::count_rows(&stack).await, 25, "a refused bound deletes nothing");

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
    use crate::support::harness::*;
    let stack = stack().await;
    let org = org();
    let claim = claimed(service(&stack).claim(org, "tool.email.send", "run-1:step-2", &hash("x"), LEASE).await);
    pass_lease(&stack, claim.id()).await;
    let args = ["get", "--org", &org.to_string(), "--scope", "tool.email.send", "--key", "run-1:step-2"];
    let output = idem(stack.url(), stack.service_key(), None, &args).await;
    let out = stdout(&output);
    assert!(output.status.success(), "{out}");
    assert!(out.contains("the lease passed: its worker is gone"), "{out}");
    let token = claim.lease_token().to_string();
    assert!(!out.contains(&token[..8]), "the lease token is the worker's secret, not even its start shown: {out}");
    assert!(out.contains("lease        passed (by the database clock)"), "{out}");

    // The same as JSON, for a script; and an absent claim.
    let json_args = [&args[..], &["--json"]].concat();
    let output = idem(stack.url(), stack.service_key(), None, &json_args).await;
    let out = stdout(&output);
    assert!(output.status.success(), "{out}");
    assert!(!out.contains(&token[..8]), "{out}");
    let got: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
    assert_eq!(got["state"], "lease_passed");
    assert_eq!(got["id"], claim.id().to_string());
    assert_eq!(got["lease_live"], false);
    assert!(got.get("lease_token").is_none() && got.get("lease_token_prefix").is_none(), "{got}");
    let absent = ["get", "--org", &org.to_string(), "--scope", "tool.email.send", "--key", "never", "--json"];
    let output = idem(stack.url(), stack.service_key(), None, &absent).await;
    assert_eq!(stdout(&output).trim(), r#"{"state":"absent"}"#);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn exit_codes_are_distinct_zero_ok_one_failure_two_usage_three_backlog() {
    let stack =
        crate::support::harness::stack_with(idempotency_plane::local::LocalStackConfig::default().with_max_rows(10))
            .await;
    let (url, key) = (stack.url(), stack.service_key());
    let code = |output: std::process::Output| output.status.code();

    assert_eq!(code(idem(url, key, Some(10), &["sweep"]).await), Some(0), "ok: nothing waiting");
    crate::support::harness::expired_rows(&stack, 12).await;
    assert_eq!(code(idem(url, key, Some(10), &["sweep"]).await), Some(3), "backlog: the read filled its bound");
    // Usage errors: nothing is attempted.
    for args in [&["sweep", "--bound", "ten"][..], &["sweep", "--every", "1w"], &["get", "--org", "x"], &["frobnicate"]]
    {
        assert_eq!(code(idem(url, key, Some(10), args).await), Some(2), "{args:?}");
    }
    // Configuration errors are usage errors too, found before any request.
    assert_eq!(code(idem(url, key, Some(10), &["sweep", "--bound", "11"]).await), Some(2), "above the row cap");
    assert_eq!(code(idem("not a url", key, Some(10), &["sweep"]).await), Some(2), "an unusable URL");
    let unconfigured = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["sweep"])
        .env_remove("IDEM_POSTGREST_URL")
        .env_remove("SUPABASE_URL")
        .output()
        .expect("run idem");
    assert_eq!(unconfigured.status.code(), Some(2), "no plane configured");
    let not_json = claim_with_stdin(
        url,
        key,
        &["claim", "--org", &uuid::Uuid::new_v4().to_string(), "--scope", "tool.email.send", "--key", "k"],
        "{not json",
    )
    .await;
    assert_eq!(not_json.status.code(), Some(2), "stdin that is not JSON");
    assert_eq!(code(idem(url, key, Some(10), &["sweep", "--help"]).await), Some(0), "--help is no error");
    assert_eq!(crate::support::harness::count_rows(&stack).await, 2, "usage errors deleted nothing");
    // Failures: a plane that does not answer, a failed doctor check.
    let gone = crate::support::transport::RefusedPort::new();
    assert_eq!(code(idem(&gone.url(), key, Some(10), &["sweep"]).await), Some(1), "unreachable");
    assert_eq!(code(idem(url, key, Some(80), &["doctor"]).await), Some(1), "a failed check");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn idem_doctor_json_lists_every_check() {
    let stack =
        crate::support::harness::stack_with(idempotency_plane::local::LocalStackConfig::default().with_max_rows(50))
            .await;
    let output = idem(stack.url(), stack.service_key(), Some(50), &["doctor", "--json"]).await;
    let out = stdout(&output);
    assert!(output.status.success(), "{out}");
    let report: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object, nothing else");
    assert_eq!(report["ok"], true);
    let checks = report["checks"].as_array().expect("checks");
    let names: Vec<&str> = checks.iter().filter_map(|c| c["check"].as_str()).collect();
    assert!(
        names.contains(&"reachable") && names.contains(&"row cap") && names.contains(&"plane row cap"),
        "{names:?}"
    );
    assert!(names.contains(&"idempotency_claim"), "{names:?}");
    assert!(checks.iter().all(|c| c["ok"] == true && c["detail"].is_string()), "{checks:?}");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn idem_sweep_serves_prometheus_metrics_while_it_sweeps() {
    let stack =
        crate::support::harness::stack_with(idempotency_plane::local::LocalStackConfig::default().with_max_rows(10))
            .await;
    crate::support::harness::expired_rows(&stack, 25).await;
    let http = reqwest::Client::new();
    // An ephemeral port the sweeper binds itself; if another process takes
    // it in between, the sweeper exits at once and the next port is tried.
    let mut attempts = 0;
    let (mut sweeper, metrics_url) = loop {
        attempts += 1;
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let addr = format!("127.0.0.1:{port}");
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["sweep", "--every", "1s", "--json", "--metrics-addr", &addr])
            .env_remove("SUPABASE_URL")
            .env("IDEM_POSTGREST_URL", stack.url())
            .env("IDEM_SERVICE_KEY", stack.service_key())
            .env("IDEM_MAX_ROWS", "10")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start idem sweep");
        tokio::time::sleep(Duration::from_millis(200)).await;
        match child.try_wait().expect("poll idem sweep") {
            None => break (child, format!("http://{addr}/metrics")),
            Some(status) if attempts < 5 => eprintln!("idem sweep exited ({status}) on {addr}; another port"),
            Some(status) => panic!("idem sweep could not start its metrics endpoint: {status}"),
        }
    };
    // Scrape until the passes have drained the backlog.
    let mut body = String::new();
    crate::support::harness::within(crate::support::harness::WAIT, "three passes drain the backlog", async {
        loop {
            if let Ok(answer) = http.get(&metrics_url).send().await {
                assert!(answer.status().is_success());
                body = answer.text().await.unwrap();
                if body.contains("idempotency_sweep_deleted_total 25") {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    sweeper.kill().await.expect("stop idem sweep");
    for expected in [
        "# TYPE idempotency_sweep_deleted_total counter",
        "# HELP idempotency_sweep_deleted_total Expired claims deleted by the sweeper.",
        "idempotency_sweep_read_total 25",
        "idempotency_sweep_filled_total 2",
        "# TYPE idempotency_rpc_duration_seconds histogram",
        "# HELP idempotency_rpc_duration_seconds SQL function calls over PostgREST",
        "idempotency_rpc_duration_seconds_bucket{function=\"idempotency_expired\",le=\"0.005\"}",
        "idempotency_rpc_duration_seconds_count{function=\"idempotency_retire_expired\"}",
    ] {
        assert!(body.contains(expected), "missing {expected:?} in:\n{body}");
    }
    assert_eq!(crate::support::harness::count_rows(&stack).await, 0);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn idem_doctor_writes_nothing_and_names_a_missing_function_and_a_higher_cap() {
    use sqlx::Executor;
    let stack =
        crate::support::harness::stack_with(idempotency_plane::local::LocalStackConfig::default().with_max_rows(50))
            .await;
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

#[tokio::test]
async fn idem_doctor_explains_a_gateway_401_in_one_line() {
    use wiremock::matchers::method;
    use wiremock::{Mock, MockServer, ResponseTemplate};
    // Supabase's gateway, refusing a request that carries no apikey.
    let gateway = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(401).set_body_json(serde_json::json!({
            "message": "No API key found in request",
            "hint": "No `apikey` request header or url param was found."
        })))
        .mount(&gateway)
        .await;
    let output = idem(&gateway.uri(), "a-jwt-the-gateway-never-sees", None, &["doctor"]).await;
    let out = stdout(&output);
    assert_eq!(output.status.code(), Some(1), "{out}");
    let line = out.lines().find(|l| l.starts_with("FAIL  reachable:")).expect("the reachability line");
    assert!(line.contains("no apikey sent"), "{line}");
    assert!(!out.contains("a-jwt-the-gateway-never-sees"), "the key is never printed");
}

/// A plane URL may carry a password (a proxy's basic auth): `idem doctor`
/// reports the URL without it, and a plain `http://` URL to a host that is
/// not loopback is refused before any request carries the service key.
#[tokio::test]
async fn idem_doctor_never_prints_a_urls_password_and_plain_http_goes_to_loopback_only() {
    let stack = crate::support::harness::stack().await;
    let with_password = stack.url().replacen("http://", "http://operator:hunter2@", 1);
    let output = idem(&with_password, stack.service_key(), None, &["doctor"]).await;
    let printed = format!("{}{}", stdout(&output), String::from_utf8_lossy(&output.stderr));
    assert!(printed.contains("operator:***@127.0.0.1"), "{printed}");
    assert!(!printed.contains("hunter2"), "{printed}");

    let output = idem("http://plane.example:3000", stack.service_key(), None, &["doctor"]).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "a usage error: {stderr}");
    assert!(stderr.contains("unencrypted") && stderr.contains("IDEM_ALLOW_PLAIN_HTTP=plane.example"), "{stderr}");
    stack.stop().await.unwrap();
}

/// `idem get` and `idem claim` find the claims the front doors make: the
/// `Idempotency-Key` middleware stores a caller's key scoped to its
/// principal, and the webhook gate hashes a body's raw bytes.
#[tokio::test]
async fn idem_get_and_claim_know_each_front_doors_key_and_hash() {
    use crate::support::harness::*;
    use idempotency_plane::service::caller_scoped_key;
    use idempotency_plane::{Completion, RequestHash};
    let stack = stack().await;
    let org = org();
    let org_text = org.to_string();
    let service = service(&stack);
    // The middleware's claim for alice's key k-1 (its hash is a fingerprint of the request).
    let stored = caller_scoped_key("alice", "k-1");
    claimed(service.claim(org, "http.post.orders", &stored, &hash("request"), LEASE).await);
    let get = ["get", "--org", org_text.as_str(), "--scope", "http.post.orders", "--key", "k-1"];
    let output = idem(stack.url(), stack.service_key(), None, &get).await;
    assert!(output.status.success());
    assert!(stdout(&output).contains("absent") && stdout(&output).contains("give --principal"), "{}", stdout(&output));
    let output = idem(stack.url(), stack.service_key(), None, &[&get[..], &["--principal", "alice"]].concat()).await;
    let out = stdout(&output);
    assert!(out.contains("processing — a worker holds a live lease") && out.contains(&stored), "{out}");
    // A stored key is not scoped twice: refused as a usage error.
    let twice =
        ["get", "--org", org_text.as_str(), "--scope", "http.post.orders", "--key", &stored, "--principal", "alice"];
    assert_eq!(idem(stack.url(), stack.service_key(), None, &twice).await.status.code(), Some(2));
    // idem claim takes no principal: a body cannot rebuild the middleware's fingerprint.
    let claim =
        ["claim", "--org", org_text.as_str(), "--scope", "http.post.orders", "--key", "k-1", "--principal", "alice"];
    assert_eq!(claim_with_stdin(stack.url(), stack.service_key(), &claim, "{}").await.status.code(), Some(2));

    // The gate's claim of a delivery, journaled: its hash is the body's bytes as delivered.
    let body = "{\"event_id\": \"Ev1\",  \"type\": \"message\"}\n";
    let claim =
        claimed(service.claim(org, "webhook.slack", "Ev1", &RequestHash::of_bytes(body.as_bytes()), LEASE).await);
    let ending = service.complete(&claim, Completion::response(serde_json::json!({"ok": true}))).await;
    assert_eq!(ending.expect("journaled"), idempotency_plane::Ending::Recorded);
    let args = ["claim", "--org", org_text.as_str(), "--scope", "webhook.slack", "--key", "Ev1"];
    let raw = claim_with_stdin(stack.url(), stack.service_key(), &[&args[..], &["--raw-body"]].concat(), body).await;
    let line: serde_json::Value = serde_json::from_str(stdout(&raw).trim()).expect("one JSON line");
    assert_eq!(line["outcome"], "completed", "the redelivery replays: {line}");
    let as_json = claim_with_stdin(stack.url(), stack.service_key(), &args, body).await;
    let line: serde_json::Value = serde_json::from_str(stdout(&as_json).trim()).expect("one JSON line");
    assert_eq!(line["outcome"], "conflict", "hashed as a JSON value, the body is another request: {line}");
    let not_json = claim_with_stdin(stack.url(), stack.service_key(), &args, "token=abc&event=1").await;
    assert_eq!(not_json.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&not_json.stderr).contains("--raw-body"), "the error names the flag");
    stack.stop().await.unwrap();
}
