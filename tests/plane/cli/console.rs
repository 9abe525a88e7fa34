//! `idem console` run as an operator runs it, against a local stack, its API
//! called over HTTP as its page calls it (the page itself runs in a real
//! Chromium in tests/console/): what the console refuses, and that a refusal
//! changes nothing; that what the plane refuses is the request's fault (4xx),
//! not a failure of the plane; and that every panel reads within a small row
//! cap. (What it refuses before serving anything, an address
//! beyond loopback among them, is in `usage`.)

use std::process::Stdio;
use std::time::Duration;

use reqwest::header::{HeaderMap, HOST, ORIGIN};
use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader};
use uuid::Uuid;

use idempotency_plane::local::LocalStack;
use idempotency_plane::postgrest::Repeat;

use crate::support::harness::{client, set_plane_row_cap, stack, within};

const SCOPE: &str = "webhook.console";
const TOKEN_HEADER: &str = "x-idem-console-token";

/// A running `idem console`, killed when dropped.
struct Console {
    _child: tokio::process::Child,
    url: String,
    http: reqwest::Client,
}

impl Console {
    /// Starts `idem console` on the plane `stack` serves; reads the page's URL
    /// from its first line.
    async fn start(stack: &LocalStack) -> Console {
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"))
            .arg("console")
            .env_remove("SUPABASE_URL")
            .env("IDEM_POSTGREST_URL", stack.url())
            .env("IDEM_SERVICE_KEY", stack.service_key())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn idem console");
        let stdout = child.stdout.take().expect("its stdout");
        let mut line = String::new();
        within(Duration::from_secs(30), "idem console's URL", BufReader::new(stdout).read_line(&mut line))
            .await
            .expect("read its first line");
        let url = line.trim().to_owned();
        assert!(url.starts_with("http://127.0.0.1:") && url.ends_with('/'), "the first line is its URL: {line:?}");
        Console { _child: child, url, http: reqwest::Client::new() }
    }

    /// The session token the page carries.
    async fn token(&self) -> String {
        let page = self.http.get(&self.url).send().await.expect("the page").text().await.expect("its text");
        let (_, rest) = page.split_once(r#"name="idem-console-token" content=""#).expect("the token in the page");
        rest.split('"').next().expect("the token").to_owned()
    }

    fn at(&self, path: &str) -> String {
        format!("{}{}", self.url, path.trim_start_matches('/'))
    }

    async fn post(&self, path: &str, headers: HeaderMap, body: Value) -> (StatusCode, HeaderMap, Value) {
        let response = self.http.post(self.at(path)).headers(headers).json(&body).send().await.expect("an answer");
        let (status, headers) = (response.status(), response.headers().clone());
        (status, headers, response.json().await.unwrap_or(Value::Null))
    }

    async fn get(&self, path: &str, headers: HeaderMap) -> (StatusCode, HeaderMap, Value) {
        let response = self.http.get(self.at(path)).headers(headers).send().await.expect("an answer");
        let (status, headers) = (response.status(), response.headers().clone());
        (status, headers, response.json().await.unwrap_or(Value::Null))
    }
}

fn with_token(token: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(TOKEN_HEADER, token.parse().expect("a header value"));
    headers
}

fn assert_no_cors(headers: &HeaderMap, what: &str) {
    let cors: Vec<&str> =
        headers.keys().map(|name| name.as_str()).filter(|name| name.starts_with("access-control-")).collect();
    assert!(cors.is_empty(), "{what}: no CORS header, got {cors:?}");
}

async fn rpc(stack: &LocalStack, function: &'static str, args: Value) -> Value {
    client(stack).rpc(function, &args, Repeat::Unsafe).await.unwrap_or_else(|e| panic!("{function} {args}: {e}"))
}

/// Claims `key` in SCOPE for `org`, carrying work, held `lease_ms`: its id
/// and lease token.
async fn claim(stack: &LocalStack, org: Uuid, key: &str, lease_ms: u64) -> (Uuid, Uuid) {
    let token = Uuid::new_v4();
    let rows = rpc(
        stack,
        "idempotency_claim",
        json!({"p_organization_id": org, "p_scope": SCOPE, "p_key": key, "p_request_hash": "a".repeat(64),
               "p_lease_token": token, "p_lease_ms": lease_ms, "p_request": {"key": key}}),
    )
    .await;
    assert_eq!(rows[0]["outcome"], "claimed", "{rows}");
    (rows[0]["id"].as_str().and_then(|id| id.parse().ok()).expect("its id"), token)
}

/// The claim of `key` as the plane holds it.
async fn get(stack: &LocalStack, org: Uuid, key: &str) -> Value {
    let rows = rpc(stack, "idempotency_get", json!({"p_organization_id": org, "p_scope": SCOPE, "p_key": key})).await;
    rows[0].clone()
}

#[tokio::test]
async fn idem_console_refuses_a_request_without_its_token_another_host_or_origin_and_sends_no_cors() {
    let stack = stack().await;
    let org = Uuid::new_v4();
    let (id, token) = claim(&stack, org, "failed-1", 60_000).await;
    rpc(
        &stack,
        "idempotency_complete",
        json!({"p_claim_id": id, "p_lease_token": token, "p_response": {"ok": false, "error": "boom"},
               "p_organization_id": org}),
    )
    .await;
    let console = Console::start(&stack).await;
    let session = console.token().await;
    assert_eq!(session.len(), 64, "32 random bytes, as hex");

    // The page and its answers: framed by nobody, no CORS header.
    let page = console.http.get(&console.url).send().await.expect("the page");
    assert_eq!(page.headers()["x-frame-options"], "DENY");
    let csp = page.headers()["content-security-policy"].to_str().expect("ASCII");
    assert!(csp.contains("script-src 'self';") && csp.contains("frame-ancestors 'none'"), "{csp}");
    assert_no_cors(page.headers(), "the page");

    // With the token, the failure is listed.
    let (status, headers, listed) = console.get("/api/failures", with_token(&session)).await;
    assert_eq!(status, StatusCode::OK, "{listed}");
    assert_no_cors(&headers, "an API answer");
    assert_eq!(listed["rows"][0]["id"], id.to_string(), "{listed}");
    assert_eq!(listed["rows"][0]["error"], "boom");
    assert_eq!(listed["rows"][0]["redrivable"], true);

    // Without the token, or with another, an action is refused and changes nothing.
    let send_back = json!({"claim_ids": [id]});
    for headers in [HeaderMap::new(), with_token(&"0".repeat(64)), with_token(&session[..63])] {
        let (status, answer_headers, answer) = console.post("/api/send-back", headers, send_back.clone()).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{answer}");
        assert_no_cors(&answer_headers, "a refusal");
    }
    // From another origin, token or not: refused too.
    let mut foreign_origin = with_token(&session);
    foreign_origin.insert(ORIGIN, "http://evil.example".parse().expect("a header value"));
    let (status, _, _) = console.post("/api/send-back", foreign_origin, send_back.clone()).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    // Through another host name (DNS rebinding): refused, page and API alike.
    let port = console.url.trim_end_matches('/').rsplit(':').next().expect("a port").to_owned();
    let mut rebound = with_token(&session);
    rebound.insert(HOST, format!("evil.example:{port}").parse().expect("a header value"));
    let (status, _, _) = console.get("/", rebound.clone()).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "the page");
    let (status, _, _) = console.post("/api/send-back", rebound, send_back.clone()).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "an action");
    // A preflight gets no CORS header either.
    let preflight = console
        .http
        .request(reqwest::Method::OPTIONS, console.at("/api/send-back"))
        .header(ORIGIN, "http://evil.example")
        .header("access-control-request-method", "POST")
        .header("access-control-request-headers", TOKEN_HEADER)
        .send()
        .await
        .expect("an answer");
    assert_no_cors(preflight.headers(), "a preflight");

    let still = get(&stack, org, "failed-1").await;
    assert_eq!((still["status"].as_str(), still["response"]["error"].as_str()), (Some("completed"), Some("boom")));

    // With the token, the same action is done and says so.
    let (status, _, answer) = console.post("/api/send-back", with_token(&session), send_back.clone()).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["message"], "sent back 1");
    assert_eq!(get(&stack, org, "failed-1").await["status"], "processing", "an orphan again");
    // Twice: nothing more to send back, and the console says why.
    let (_, _, again) = console.post("/api/send-back", with_token(&session), send_back).await;
    assert_eq!(again["sent_back"], 0, "{again}");
    assert_eq!(again["not_sent_back"][0]["reason"], "orphaned", "{again}");
    stack.stop().await.expect("stop");
}

#[tokio::test]
async fn idem_console_ends_a_stuck_claim_only_when_unchanged_since_shown() {
    let stack = stack().await;
    let org = Uuid::new_v4();
    let (id, lease_token) = claim(&stack, org, "stuck-1", 600_000).await;
    let console = Console::start(&stack).await;
    let session = console.token().await;

    let shown = |answer: &Value| -> String {
        let row = answer["rows"].as_array().and_then(|rows| rows.iter().find(|row| row["id"] == id.to_string()));
        row.and_then(|row| row["version"].as_str()).unwrap_or_else(|| panic!("the claim in {answer}")).to_owned()
    };
    let (_, _, processing) = console.get(&format!("/api/processing?scope={SCOPE}"), with_token(&session)).await;
    let version = shown(&processing);

    // Its worker extends the lease: the claim changed since it was shown.
    let extended = rpc(
        &stack,
        "idempotency_extend",
        json!({"p_claim_id": id, "p_lease_token": lease_token, "p_lease_ms": 900_000}),
    )
    .await;
    assert!(extended.is_string(), "the worker still holds it: {extended}");
    let (status, _, refused) =
        console.post("/api/abandon", with_token(&session), json!({"id": id, "version": version})).await;
    assert_eq!(status, StatusCode::CONFLICT, "{refused}");
    assert!(refused["message"].as_str().is_some_and(|m| m.starts_with("changed since shown: refresh")), "{refused}");
    let unchanged = get(&stack, org, "stuck-1").await;
    assert_eq!(unchanged["status"], "processing", "nothing written: {unchanged}");

    // Without the token: refused, nothing written.
    let (_, _, processing) = console.get(&format!("/api/processing?scope={SCOPE}"), with_token(&session)).await;
    let fresh = shown(&processing);
    assert_ne!(fresh, version, "the version moved with the claim");
    let (status, _, _) = console.post("/api/abandon", HeaderMap::new(), json!({"id": id, "version": fresh})).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert_eq!(get(&stack, org, "stuck-1").await["status"], "processing");

    // Shown afresh and unchanged: ended as a failure, the worker fenced off.
    let (status, _, ended) =
        console.post("/api/abandon", with_token(&session), json!({"id": id, "version": fresh})).await;
    assert_eq!(status, StatusCode::OK, "{ended}");
    assert_eq!(ended["message"], "ended webhook.console/stuck-1 as a failure (abandoned_by_operator)");
    let journaled = get(&stack, org, "stuck-1").await;
    assert_eq!(
        (journaled["status"].as_str(), journaled["response"]["error"].as_str()),
        (Some("completed"), Some("abandoned_by_operator"))
    );
    let late = rpc(
        &stack,
        "idempotency_complete",
        json!({"p_claim_id": id, "p_lease_token": lease_token, "p_response": {"ok": true}}),
    )
    .await;
    assert_eq!(late, json!([]), "the old holder's completion changes nothing");
    // A version that is not one the plane makes is refused before the plane.
    let (status, _, _) = console.post("/api/abandon", with_token(&session), json!({"id": id, "version": ""})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    stack.stop().await.expect("stop");
}

/// The version the console shows for claim `id` in SCOPE.
async fn shown_version(console: &Console, session: &str, id: Uuid) -> String {
    let (status, _, answer) = console.get(&format!("/api/processing?scope={SCOPE}"), with_token(session)).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    let row = answer["rows"].as_array().and_then(|rows| rows.iter().find(|row| row["id"] == id.to_string()));
    row.and_then(|row| row["version"].as_str()).unwrap_or_else(|| panic!("the claim in {answer}")).to_owned()
}

#[tokio::test]
async fn idem_console_answers_input_the_plane_refuses_with_400_or_404_and_changes_nothing() {
    let stack = stack().await;
    let org = Uuid::new_v4();
    let (id, _) = claim(&stack, org, "stuck-2", 600_000).await;
    let console = Console::start(&stack).await;
    let session = console.token().await;
    let version = shown_version(&console, &session, id).await;

    // A version the plane does not make: refused by the plane (22023), the
    // request's fault, with the plane's own words; nothing written.
    for malformed in ["not-a-version", &"z".repeat(64), &version[..63]] {
        let (status, _, refused) =
            console.post("/api/abandon", with_token(&session), json!({"id": id, "version": malformed})).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{malformed}: {refused}");
        let error = refused["error"].as_str().unwrap_or_default();
        assert!(error.contains("p_version must be the 64 hex digits"), "{error}");
    }
    // A scope that is not one: 400; one the plane does not know: 404.
    for (scope, expected, says) in [
        ("Not%20A%20Scope!", StatusCode::BAD_REQUEST, "p_scope must be a scope"),
        ("nowhere.console", StatusCode::NOT_FOUND, "unknown scope nowhere.console"),
    ] {
        let (status, _, refused) = console.get(&format!("/api/processing?scope={scope}"), with_token(&session)).await;
        assert_eq!(status, expected, "{scope}: {refused}");
        let error = refused["error"].as_str().unwrap_or_default();
        assert!(error.contains(says), "{scope}: {error}");
    }
    // Nothing changed: the claim is processing, at the version shown.
    assert_eq!(get(&stack, org, "stuck-2").await["status"], "processing");
    assert_eq!(shown_version(&console, &session, id).await, version);
    // And shown, it is ended as ever.
    let (status, _, ended) =
        console.post("/api/abandon", with_token(&session), json!({"id": id, "version": version})).await;
    assert_eq!(status, StatusCode::OK, "{ended}");
    stack.stop().await.expect("stop");
}

#[tokio::test]
async fn idem_console_reads_every_panel_within_a_small_plane_row_cap() {
    const CAP: u64 = 20;
    let stack = stack().await;
    let org = Uuid::new_v4();
    // A failure and a claim in flight, so that there is something to read.
    let (failed, token) = claim(&stack, org, "failed-2", 60_000).await;
    rpc(
        &stack,
        "idempotency_complete",
        json!({"p_claim_id": failed, "p_lease_token": token, "p_response": {"ok": false, "error": "boom"},
               "p_organization_id": org}),
    )
    .await;
    claim(&stack, org, "stuck-3", 600_000).await;
    // The plane's own cap, below the server's (and the configured one).
    set_plane_row_cap(&stack, CAP as i32).await;
    let console = Console::start(&stack).await;
    let session = console.token().await;

    let (status, _, about) = console.get("/api/about", with_token(&session)).await;
    assert_eq!(status, StatusCode::OK, "{about}");
    assert_eq!((about["row_cap"].as_u64(), about["panel_rows"].as_u64()), (Some(CAP), Some(CAP)), "{about}");
    for path in [
        "/api/in-flight",
        "/api/processing?scope=*",
        "/api/processing?scope=webhook.console",
        "/api/orphans",
        "/api/failures",
        "/api/failure-counts",
        "/api/sweep-backlog",
        "/api/activity?window=1h",
        "/api/activity?window=24h",
        "/api/activity?window=7d",
    ] {
        let (status, _, answer) = console.get(path, with_token(&session)).await;
        assert_eq!(status, StatusCode::OK, "{path}: {answer}");
        let bound = answer["bound"].as_u64().unwrap_or_else(|| panic!("{path}: its bound in {answer}"));
        let rows = answer["rows"].as_array().unwrap_or_else(|| panic!("{path}: its rows in {answer}"));
        assert!(bound <= CAP && rows.len() as u64 <= bound, "{path}: {bound} bound, {} rows", rows.len());
    }
    let (_, _, failures) = console.get("/api/failures", with_token(&session)).await;
    assert_eq!(failures["rows"][0]["id"], failed.to_string(), "{failures}");
    // The activity plots: coarser buckets, the whole window still shown.
    let (_, _, week) = console.get("/api/activity?window=7d", with_token(&session)).await;
    assert_eq!((week["bucket_s"].as_u64(), week["bound"].as_u64()), (Some(86_400), Some(9)), "{week}");
    let (_, _, hour) = console.get("/api/activity?window=1h", with_token(&session)).await;
    assert_eq!(hour["bucket_s"].as_u64(), Some(300), "{hour}");
    let claims: u64 = hour["rows"].as_array().into_iter().flatten().filter_map(|row| row["claims"].as_u64()).sum();
    assert_eq!(claims, 2, "{hour}");

    // Sending back stays within the cap too: more ids than it, refused.
    let ids: Vec<Uuid> = (0..=CAP).map(|_| Uuid::new_v4()).collect();
    let (status, _, refused) = console.post("/api/send-back", with_token(&session), json!({"claim_ids": ids})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{refused}");
    let (status, _, sent) = console.post("/api/send-back", with_token(&session), json!({"claim_ids": [failed]})).await;
    assert_eq!(status, StatusCode::OK, "{sent}");
    assert_eq!(sent["message"], "sent back 1");
    stack.stop().await.expect("stop");
}
