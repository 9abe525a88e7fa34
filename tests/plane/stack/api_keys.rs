//! Supabase's `sb_` keys on the local stack, end to end: a client configured
//! as a hosted Edge Function is (only `SUPABASE_URL` and
//! `SUPABASE_SECRET_KEYS`) claims, completes and replays beneath `/rest/v1`,
//! where the stack's gateway maps each key to its role as Supabase's does;
//! and what Supabase's gateway refuses, this one refuses too.

use idempotency_plane::local::SUPABASE_REST_PATH;
use idempotency_plane::postgrest::{ClientConfig, KeyKind, PostgrestClient};
use idempotency_plane::{ClaimOutcome, Completion, Ending, IdempotencyService, PostgrestRepository};
use serde_json::{json, Value};

use crate::support::harness::*;

/// `POST <url>/rpc/idempotency_get` with exactly `headers`, answered as
/// `(status, sb-error-code, body)`.
async fn get(url: &str, headers: &[(&str, &str)]) -> (u16, Option<String>, Value) {
    get_with_query(url, "", headers).await
}

/// [`get`], with `query` (`?…`) after the function's path.
async fn get_with_query(url: &str, query: &str, headers: &[(&str, &str)]) -> (u16, Option<String>, Value) {
    let args = json!({"p_organization_id": org(), "p_scope": "tool.email.send", "p_key": "k"});
    let mut request = reqwest::Client::new().post(format!("{url}/rpc/idempotency_get{query}")).json(&args);
    request = request.header("content-profile", "agent");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = within(WAIT, "an answer", request.send()).await.expect("an answer");
    let status = response.status().as_u16();
    let code = response.headers().get("sb-error-code").and_then(|v| v.to_str().ok()).map(str::to_owned);
    (status, code, response.json().await.expect("a JSON body"))
}

#[tokio::test]
async fn a_worker_with_only_supabase_url_and_supabase_secret_keys_claims_completes_and_replays() {
    let stack = stack().await;
    let keys = json!({"default": stack.secret_key()}).to_string();
    let vars = [("SUPABASE_URL", stack.url().to_owned()), ("SUPABASE_SECRET_KEYS", keys)];
    let config = ClientConfig::from_vars(|name| vars.iter().find(|(n, _)| *n == name).map(|(_, v)| v.clone()))
        .expect("a configuration")
        .expect("a URL");
    assert_eq!((config.key_variable(), config.key_kind()), (Some("SUPABASE_SECRET_KEYS"), KeyKind::Secret));
    let service = IdempotencyService::new(PostgrestRepository::new(PostgrestClient::new(config).expect("a client")));
    let (org, request) = (org(), hash("sb keys"));
    let claim = claimed(service.claim(org, "tool.email.send", "sb-key", &request, LEASE).await);
    let ending = service.complete(&claim, Completion::response(json!({"sent": true}))).await;
    assert_eq!(ending.expect("complete"), Ending::Recorded);
    let replay = service.claim(org, "tool.email.send", "sb-key", &request, LEASE).await.expect("a replay");
    assert!(matches!(replay, ClaimOutcome::Completed { .. }), "{replay:?}");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn the_gateway_maps_each_key_to_its_role_and_refuses_what_supabases_refuses() {
    let stack = stack().await;
    let rest = format!("{}{SUPABASE_REST_PATH}", stack.url());
    let (secret, publishable) = (stack.secret_key(), stack.publishable_key());
    assert!(secret.starts_with("sb_secret_") && publishable.starts_with("sb_publishable_"));

    // The secret key in apikey alone is the service role; so is it in both
    // headers (as supabase-js sends it) and as the apikey query parameter.
    let ok = |(status, _, body): (u16, Option<String>, Value)| assert_eq!(status, 200, "{body}");
    ok(get(&rest, &[("apikey", secret)]).await);
    ok(get(&rest, &[("apikey", secret), ("authorization", &format!("Bearer {secret}"))]).await);
    ok(get_with_query(&rest, &format!("?apikey={secret}"), &[]).await);
    // However its name is percent-encoded, the parameter is taken off before
    // the server, which would read it as a filter.
    ok(get_with_query(&rest, &format!("?api%6Bey={secret}"), &[]).await);
    // A legacy key: the project's own JWT, as supabase-js sends it.
    let bearer = format!("Bearer {}", stack.service_key());
    ok(get(&rest, &[("apikey", stack.service_key()), ("authorization", &bearer)]).await);
    // The publishable key is anon, which may execute none of the plane's functions.
    let (status, _, body) = get(&rest, &[("apikey", publishable)]).await;
    assert_eq!(body["code"], "42501", "anon is refused by the database ({status}): {body}");
    // A user's JWT beside the publishable key is the user's role: left to the server.
    let authenticated = stack.token_for("authenticated");
    let (_, _, body) =
        get(&rest, &[("apikey", publishable), ("authorization", &format!("Bearer {authenticated}"))]).await;
    assert_eq!(body["code"], "42501", "authenticated executes nothing either: {body}");

    let refused = |expected: &'static str| {
        move |(status, code, body): (u16, Option<String>, Value)| {
            assert_eq!((status, code.as_deref()), (401, Some(expected)), "{body}");
            assert!(body["message"].is_string() && body["hint"].is_string(), "{body}");
        }
    };
    let missing = refused("UNAUTHORIZED_MISSING_API_KEY");
    missing(get(&rest, &[]).await);
    missing(get(&rest, &[("authorization", &format!("Bearer {secret}"))]).await);
    missing(get(&rest, &[("authorization", &format!("Bearer {}", stack.service_key()))]).await);
    let invalid = refused("UNAUTHORIZED_INVALID_API_KEY");
    invalid(get(&rest, &[("apikey", "sb_secret_not_this_projects_key0000")]).await);
    invalid(get(&rest, &[("apikey", "not-a-key"), ("authorization", &bearer)]).await);
    let other_role = stack.token_for("authenticated");
    invalid(get(&rest, &[("apikey", &other_role), ("authorization", &bearer)]).await);
    invalid(get(&rest, &[("apikey", secret), ("authorization", &format!("Bearer {publishable}"))]).await);
    refused("UNAUTHORIZED_FORBIDDEN_SECRET_KEY_IN_BROWSER")(
        get(&rest, &[("apikey", secret), ("user-agent", "Mozilla/5.0 (X11; Linux x86_64) Chrome/140.0")]).await,
    );

    // The root is plain PostgREST, which knows nothing of sb_ keys.
    let (status, _, body) = get(stack.url(), &[("authorization", &format!("Bearer {secret}"))]).await;
    assert_eq!((status, body["code"].as_str()), (401, Some("PGRST301")), "{body}");
    stack.stop().await.unwrap();
}
