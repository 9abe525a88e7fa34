//! What a key's repeat answers: the first answer replayed, byte for byte,
//! to its own caller only, once the handler ran once however many came at
//! once, and never with a credential header.

use std::collections::HashSet;
use std::sync::Arc;

use axum::http::StatusCode;

use crate::support::harness::*;

use super::{api, assert_problem, body, keyed, serve, shared, TENANT};

#[tokio::test]
async fn a_repeat_after_completion_replays_status_headers_and_body_and_the_handler_runs_once() {
    let stack = stack().await;
    let api = api(&stack).await;
    let first = api.post(Some("order-1"), &[], r#"{"sku":"A","qty":2}"#).send().await.unwrap();
    assert_eq!(first.status(), 201);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let location = first.headers()["location"].clone();
    let first = first.text().await.unwrap();
    // The same JSON with its keys in another order and other spacing.
    let again = api.post(Some("order-1"), &[], r#"{ "qty": 2, "sku": "A" }"#).send().await.unwrap();
    assert_eq!(again.status(), 201);
    let headers = again.headers().clone();
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(headers["location"], location);
    assert_eq!(headers["content-type"], "application/json");
    assert!(headers.get("x-not-kept").is_none(), "only the kept headers are replayed");
    assert_eq!(again.text().await.unwrap(), first, "the body, byte for byte");
    assert_eq!(api.runs(), 1);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn twenty_concurrent_requests_with_one_key_run_the_handler_once() {
    let stack = stack().await;
    let api = Arc::new(api(&stack).await);
    let requests: Vec<_> = (0..20)
        .map(|_| {
            let api = api.clone();
            tokio::spawn(async move {
                body(api.post(Some("burst"), &[("x-delay-ms", "300")], r#"{"sku":"B"}"#).send().await.unwrap()).await
            })
        })
        .collect();
    let mut ids = HashSet::new();
    let mut in_flight = 0;
    for request in requests {
        let (status, headers, answer) = request.await.unwrap();
        match status {
            StatusCode::CREATED => {
                ids.insert(answer["id"].as_str().unwrap().to_owned());
            }
            StatusCode::CONFLICT => {
                assert_problem(status, &headers, &answer, StatusCode::CONFLICT, "in-flight");
                assert_eq!(headers["retry-after"], "1");
                in_flight += 1;
            }
            other => panic!("unexpected {other}: {answer}"),
        }
    }
    assert_eq!(api.runs(), 1, "the handler ran once");
    assert_eq!(ids.len(), 1, "every 201 is the one order");
    assert!(in_flight > 0, "some arrived while it ran");
    // Once done, every repeat is the replay.
    let (status, headers, answer) = body(api.post(Some("burst"), &[], r#"{"sku":"B"}"#).send().await.unwrap()).await;
    assert_eq!((status, &headers["idempotent-replayed"]), (StatusCode::CREATED, &"true".parse().unwrap()));
    assert!(ids.contains(answer["id"].as_str().unwrap()));
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn two_callers_of_one_tenant_sharing_a_key_never_get_each_others_answer() {
    let stack = stack().await;
    let api = serve(keyed(service(&stack))).await;
    let as_user = |user: &'static str| api.post(Some("shared-name"), &[("x-user", user)], r#"{"sku":"A"}"#);
    let (status, _, alice) = body(as_user("alice").send().await.unwrap()).await;
    assert_eq!(status, StatusCode::CREATED);
    // Bob, same tenant, same key, same body: his own request, not alice's answer.
    let (status, headers, bob) = body(as_user("bob").send().await.unwrap()).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(headers.get("idempotent-replayed").is_none(), "bob got alice's answer: {bob}");
    assert_ne!(alice["id"], bob["id"]);
    assert_eq!(api.runs(), 2, "bob's handler ran");
    // Each replays their own.
    for (user, first) in [("alice", &alice), ("bob", &bob)] {
        let (_, headers, replay) = body(as_user(user).send().await.unwrap()).await;
        assert_eq!((&headers["idempotent-replayed"], &replay), (&"true".parse().unwrap(), first), "{user}");
    }
    assert_eq!(api.runs(), 2);
    // No caller where keys are per caller: 401, nothing run or written.
    let anonymous = api
        .http
        .post(format!("{}/orders", api.url))
        .header("idempotency-key", "shared-name")
        .header("x-tenant", TENANT)
        .header("content-type", "application/json")
        .body(r#"{"sku":"A"}"#);
    let (status, headers, problem) = body(anonymous.send().await.unwrap()).await;
    assert_problem(status, &headers, &problem, StatusCode::UNAUTHORIZED, "no-principal");
    assert_eq!((api.runs(), count_rows(&stack).await), (2, 2));
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn keys_shared_across_callers_answer_every_caller_of_the_tenant_alike() {
    let stack = stack().await;
    let api = serve(shared(service(&stack))).await;
    let (_, _, alice) = body(api.post(Some("team-key"), &[("x-user", "alice")], "{}").send().await.unwrap()).await;
    let (_, headers, bob) = body(api.post(Some("team-key"), &[("x-user", "bob")], "{}").send().await.unwrap()).await;
    assert_eq!((&headers["idempotent-replayed"], bob), (&"true".parse().unwrap(), alice), "as configured");
    assert_eq!(api.runs(), 1);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_replay_never_carries_a_credential_header_even_when_one_was_journaled() {
    let stack = stack().await;
    let api = api(&stack).await;
    assert_eq!(api.post(Some("cookie"), &[], "{}").send().await.unwrap().status(), 201);
    // A journal written by an older layer that kept them.
    sqlx::query(
        "update agent.idempotency_keys
            set response = jsonb_set(response, '{output,headers}', response->'output'->'headers'
                || '[[\"set-cookie\",\"session=alice\"],[\"authorization\",\"Bearer alice\"],[\"www-authenticate\",\"Basic\"]]'::jsonb)",
    )
    .execute(stack.db())
    .await
    .unwrap();
    let replay = api.post(Some("cookie"), &[], "{}").send().await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    for name in ["set-cookie", "authorization", "www-authenticate"] {
        assert!(replay.headers().get(name).is_none(), "{name} replayed");
    }
    assert!(replay.headers().get("location").is_some(), "the kept headers still are");
    stack.stop().await.unwrap();
}

/// The first caller gets exactly what every replay says, whatever the
/// answer's body holds: a NUL byte, bytes that are not UTF-8, JSON whose
/// members are in no sorted order (kept as its bytes, not reordered), JSON
/// naming a lone UTF-16 surrogate, and a body above the journal's limit
/// (omitted for the first caller too).
#[tokio::test]
async fn the_first_answer_is_exactly_what_every_replay_says() {
    use axum::body::Bytes;
    use axum::routing::post;

    let stack = stack().await;
    // Answers the request's own bytes, with the request's content type.
    async fn echo(headers: axum::http::HeaderMap, bytes: Bytes) -> axum::response::Response {
        use axum::response::IntoResponse;
        let content_type = headers.get("content-type").cloned();
        let mut answer = (StatusCode::CREATED, bytes).into_response();
        if let Some(content_type) = content_type {
            answer.headers_mut().insert("content-type", content_type);
        }
        answer.headers_mut().insert("etag", axum::http::HeaderValue::from_static("\"v1\""));
        answer
    }
    let layer = keyed(service(&stack).with_response_limit(1024));
    let app = axum::Router::new().route("/echo", post(echo)).route_layer(layer);
    let url = super::bind(app).await;
    let http = reqwest::Client::new();
    let send = |key: &str, content_type: &str, body: Vec<u8>| {
        http.post(format!("{url}/echo"))
            .header("idempotency-key", key)
            .header("x-tenant", TENANT)
            .header("x-user", "user-1")
            .header("content-type", content_type)
            .body(body)
            .send()
    };
    let cases: [(&str, &str, Vec<u8>); 5] = [
        ("nul", "text/plain", b"a\0b".to_vec()),
        // A string cut inside an emoji by the service that made it: JSON
        // whose escape names a lone UTF-16 surrogate, which jsonb refuses.
        ("lone-surrogate", "application/json", br#"{"preview": "Hello \ud83d"}"#.to_vec()),
        ("not-utf8", "application/octet-stream", vec![0xff, 0x00, 0xfe]),
        ("unsorted-json", "application/json", br#"{"z": 1,  "a": [2, {"y":3,"b":4}]}"#.to_vec()),
        ("oversized", "text/plain", vec![b'x'; 4096]),
    ];
    for (key, content_type, sent) in cases {
        let first = send(key, content_type, sent.clone()).await.unwrap();
        let again = send(key, content_type, sent.clone()).await.unwrap();
        assert_eq!((first.status(), again.status()), (StatusCode::CREATED, StatusCode::CREATED), "{key}");
        assert!(first.headers().get("idempotent-replayed").is_none(), "{key}");
        assert_eq!(again.headers()["idempotent-replayed"], "true", "{key}");
        for name in ["content-type", "idempotent-body-omitted"] {
            assert_eq!(first.headers().get(name), again.headers().get(name), "{key}: {name}");
        }
        // An ETag describes the handler's bytes: the first caller gets it
        // with them, never with an omitted body (a replay keeps none).
        let etag = if key == "oversized" { None } else { Some("\"v1\"") };
        assert_eq!(first.headers().get("etag").map(|v| v.to_str().unwrap()), etag, "{key}");
        let (first, again) = (first.bytes().await.unwrap(), again.bytes().await.unwrap());
        assert_eq!(first, again, "{key}: the first body differs from its replay");
        let expected: &[u8] = if key == "oversized" { b"" } else { &sent };
        assert_eq!(&first[..], expected, "{key}");
    }
    stack.stop().await.unwrap();
}
