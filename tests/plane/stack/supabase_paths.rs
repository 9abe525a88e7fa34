//! The local server as Supabase serves it: the same API at the root and
//! beneath `/rest/v1` (where supabase-js calls), and the schemas
//! `supabase/config.toml` exposes, `public` first, so a call that names no
//! schema misses the plane as it does on Supabase.

use idempotency_plane::local::{exposed_schemas, SUPABASE_REST_PATH};
use idempotency_plane::postgrest::{ClientConfig, Gateway, PostgrestClient};
use idempotency_plane::sweeper::Sweeper;
use idempotency_plane::{ClaimOutcome, Completion, Ending, IdempotencyService, PostgrestRepository, ReadOutcome};
use serde_json::{json, Value};

use crate::support::harness::*;

/// What a test compares of an answer: status, the headers a client reads,
/// the body as JSON.
#[derive(Debug, PartialEq)]
struct Answer {
    status: u16,
    content_type: Option<String>,
    content_range: Option<String>,
    content_profile: Option<String>,
    body: Value,
}

async fn post(url: &str, key: &str, profile: Option<&str>, prefer: Option<&str>, args: &Value) -> Answer {
    // `apikey` as supabase-js sends it: Supabase's gateway (beneath
    // /rest/v1) needs it, and PostgREST (the root) ignores it.
    let mut request = reqwest::Client::new().post(url).bearer_auth(key).header("apikey", key).json(args);
    if let Some(profile) = profile {
        request = request.header("content-profile", profile);
    }
    if let Some(prefer) = prefer {
        request = request.header("prefer", prefer);
    }
    let response = within(WAIT, "an RPC answer", request.send()).await.expect("an answer");
    let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let (content_type, content_range, content_profile) =
        (header("content-type"), header("content-range"), header("content-profile"));
    let status = response.status().as_u16();
    let body = response.json().await.expect("a JSON body");
    Answer { status, content_type, content_range, content_profile, body }
}

#[tokio::test]
async fn the_rest_v1_path_answers_every_call_as_the_root_does_headers_included() {
    let stack = stack().await;
    let org = org();
    let claim = claimed(service(&stack).claim(org, "tool.email.send", "run-1:step-1", &hash("a"), LEASE).await);
    expired_rows(&stack, 3).await;
    let key = stack.service_key();
    let get = json!({"p_organization_id": org, "p_scope": "tool.email.send", "p_key": "run-1:step-1"});
    let mut answers = Vec::new();

    for (function, prefer, args) in [
        ("idempotency_get", None, get.clone()),
        ("idempotency_expired", Some("count=exact"), json!({"p_limit": 10})),
        (
            "idempotency_get",
            Some("count=exact"),
            json!({"p_organization_id": org, "p_scope": "tool.email.send", "p_key": "none"}),
        ),
    ] {
        let root = post(&format!("{}/rpc/{function}", stack.url()), key, Some("agent"), prefer, &args).await;
        let nested = format!("{}{SUPABASE_REST_PATH}/rpc/{function}", stack.url());
        let beneath = post(&nested, key, Some("agent"), prefer, &args).await;
        assert_eq!(root.status, 200, "{function}: {root:?}");
        assert_eq!(beneath, root, "{function} {prefer:?}");
        answers.push(beneath);
    }
    assert_eq!(answers[0].body[0]["id"], json!(claim.id()), "{:?}", answers[0]);
    assert_eq!(answers[0].content_profile.as_deref(), Some("agent"), "{:?}", answers[0]);
    assert_eq!(answers[1].content_range.as_deref(), Some("0-2/3"), "a counted read: {:?}", answers[1]);
    assert_eq!(answers[2].content_range.as_deref(), Some("*/0"), "a counted empty read: {:?}", answers[2]);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_call_that_names_no_schema_goes_to_public_and_is_not_found_as_on_supabase() {
    let stack = stack().await;
    let key = stack.service_key();
    let args = json!({"p_organization_id": org(), "p_scope": "tool.email.send", "p_key": "k"});
    for base in [stack.url().to_owned(), format!("{}{SUPABASE_REST_PATH}", stack.url())] {
        let missed = post(&format!("{base}/rpc/idempotency_get"), key, None, None, &args).await;
        assert_eq!(missed.status, 404, "{base}: {missed:?}");
        assert_eq!(missed.body["code"], "PGRST202", "{base}: {missed:?}");
        let message = missed.body["message"].as_str().unwrap_or_default();
        assert!(message.contains("public.idempotency_get"), "{base}: {message}");

        // A schema outside config.toml's list is refused, naming the list.
        let refused = post(&format!("{base}/rpc/idempotency_get"), key, Some("nope"), None, &args).await;
        assert_eq!((refused.status, refused.body["code"].as_str()), (406, Some("PGRST106")), "{refused:?}");
        let listed = exposed_schemas().expect("the exposed schemas").join(", ");
        assert_eq!(refused.body["hint"], format!("Only the following schemas are exposed: {listed}"));
    }
    // graphql_public does not exist on plain PostgreSQL: it is served empty.
    let empty = post(&format!("{}/rpc/idempotency_get", stack.url()), key, Some("graphql_public"), None, &args).await;
    assert_eq!((empty.status, empty.body["code"].as_str()), (404, Some("PGRST202")), "{empty:?}");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn the_rust_client_works_beneath_rest_v1_as_at_the_root() {
    let stack = stack().await;
    for base in [format!("{}{SUPABASE_REST_PATH}", stack.url()), format!("{}{SUPABASE_REST_PATH}/", stack.url())] {
        let config = ClientConfig::new(&base, stack.service_key())
            .expect("a /rest/v1 URL")
            .with_gateway(Gateway::Supabase)
            .with_max_rows(stack.max_rows());
        let config = config.expect("the row cap");
        assert_eq!(
            config.base_url().join("rpc/idempotency_get").expect("a URL").as_str(),
            format!("{}{SUPABASE_REST_PATH}/rpc/idempotency_get", stack.url())
        );
        let client = PostgrestClient::new(config).expect("a client");
        let service = IdempotencyService::new(PostgrestRepository::new(client.clone()));
        let (org, request) = (org(), hash(&base));
        let claim = claimed(service.claim(org, "tool.email.send", "k", &request, LEASE).await);
        let ending = service.complete(&claim, Completion::response(json!({"sent": true}))).await;
        assert_eq!(ending.expect("complete"), Ending::Recorded);
        let replay = service.claim(org, "tool.email.send", "k", &request, LEASE).await.expect("a replay");
        assert!(matches!(replay, ClaimOutcome::Completed { .. }), "{replay:?}");
        let read = service.read(org, "tool.email.send", "k", &request).await.expect("a read");
        assert!(matches!(read, ReadOutcome::Completed { .. }), "{read:?}");

        // A counted read: the client checks Content-Range, so it must come through.
        expired_rows(&stack, 3).await;
        let report = Sweeper::new(client, 10).expect("a sweeper").pass().await.expect("a sweep beneath /rest/v1");
        assert_eq!((report.read, report.deleted, report.filled), (3, 3, false), "{report:?}");
    }
    stack.stop().await.unwrap();
}
