//! What is another request under the same key, answered 422: another
//! body, resource, route, content type, or JSON number or member a lossy
//! parse would take for the first.

use std::sync::atomic::Ordering;

use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use uuid::Uuid;

use crate::support::harness::*;

use super::{api, assert_problem, bind, body, create_order, shared, Api, Orders, TENANT};

#[tokio::test]
async fn two_resources_of_one_route_under_one_key_are_two_requests() {
    let stack = stack().await;
    let orders = Orders::default();
    let app = Router::new()
        .route("/accounts/{id}/transfers", post(create_order))
        .route_layer(shared(service(&stack)))
        .with_state(orders.clone());
    let url = bind(app).await;
    let http = reqwest::Client::new();
    let transfer = |account: u32| {
        http.post(format!("{url}/accounts/{account}/transfers"))
            .header("idempotency-key", "t-1")
            .header("x-tenant", TENANT)
            .header("content-type", "application/json")
            .body(r#"{"amount":10}"#)
    };
    assert_eq!(transfer(1).send().await.unwrap().status(), 201);
    // Account 2 under the same key is not account 1's transfer replayed.
    let (status, headers, problem) = body(transfer(2).send().await.unwrap()).await;
    assert_problem(status, &headers, &problem, StatusCode::UNPROCESSABLE_ENTITY, "key-reused");
    assert_eq!(orders.runs.load(Ordering::SeqCst), 1);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn the_same_key_with_another_request_is_422_and_an_empty_body_is_a_request_of_its_own() {
    let stack = stack().await;
    let api = api(&stack).await;
    assert_eq!(api.post(Some("k-empty"), &[], "").send().await.unwrap().status(), 201);
    assert_eq!(api.post(Some("k-empty"), &[], "").send().await.unwrap().headers()["idempotent-replayed"], "true");
    let (status, headers, problem) = body(api.post(Some("k-empty"), &[], "{}").send().await.unwrap()).await;
    assert_problem(status, &headers, &problem, StatusCode::UNPROCESSABLE_ENTITY, "key-reused");
    assert_eq!(api.runs(), 1);
    // Another tenant's key of the same name is another key.
    let other = api.post_as(&Uuid::new_v4().to_string(), Some("k-empty"), &[], "{}").send().await.unwrap();
    assert_eq!(other.status(), 201);
    assert_eq!(api.runs(), 2);
    stack.stop().await.unwrap();
}

impl Api {
    fn post_typed(&self, content_type: &str, key: &str, body: &str) -> reqwest::RequestBuilder {
        self.post(Some(key), &[], body).header("content-type", content_type)
    }
}

/// Sends `first` then `second` under one fresh key: the first runs, the second is 422.
async fn second_is_key_reused(api: &Api, key: &str, first: (&str, &str), second: (&str, &str)) {
    let runs = api.runs();
    let (status, _, answer) = body(api.post_typed(first.0, key, first.1).send().await.unwrap()).await;
    assert_eq!(status, StatusCode::CREATED, "{first:?}: {answer}");
    let (status, headers, problem) = body(api.post_typed(second.0, key, second.1).send().await.unwrap()).await;
    assert!(headers.get("idempotent-replayed").is_none(), "{second:?} got {first:?}'s answer: {problem}");
    assert_problem(status, &headers, &problem, StatusCode::UNPROCESSABLE_ENTITY, "key-reused");
    assert_eq!(api.runs(), runs + 1);
}

#[tokio::test]
async fn json_numbers_one_double_cannot_tell_apart_are_two_requests() {
    let stack = stack().await;
    let api = api(&stack).await;
    let json = "application/json";
    let pairs = [
        // Floats, written with a fraction or an exponent, beyond a double's precision.
        (r#"{"amount":9007199254740993.0}"#, r#"{"amount":9007199254740992.0}"#),
        (r#"{"amount":9007199254740993e0}"#, r#"{"amount":9007199254740992e0}"#),
        (r#"{"rate":0.1000000000000000000001}"#, r#"{"rate":0.1}"#),
        (r#"{"rate":1e-400}"#, r#"{"rate":0}"#),
        (r#"{"n":-0}"#, r#"{"n":0}"#),
    ];
    for (i, (first, second)) in pairs.into_iter().enumerate() {
        second_is_key_reused(&api, &format!("number-{i}"), (json, first), (json, second)).await;
    }
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn duplicate_json_members_are_not_their_last_one() {
    let stack = stack().await;
    let api = api(&stack).await;
    let json = "application/json";
    second_is_key_reused(&api, "dup-1", (json, r#"{"a":1,"a":2}"#), (json, r#"{"a":2}"#)).await;
    second_is_key_reused(&api, "dup-2", (json, r#"{"a":2}"#), (json, r#"{"a":1,"a":2}"#)).await;
    // An escape spells the same name.
    second_is_key_reused(&api, "dup-3", (json, r#"{"a":1,"\u0061":2}"#), (json, r#"{"a":2}"#)).await;
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn the_same_bytes_under_another_content_type_are_another_request() {
    let stack = stack().await;
    let api = api(&stack).await;
    let body = r#"{"sku":"A"}"#;
    second_is_key_reused(&api, "ct-1", ("application/json", body), ("application/vnd.orders+json", body)).await;
    second_is_key_reused(&api, "ct-2", ("text/plain", body), ("application/octet-stream", body)).await;
    second_is_key_reused(&api, "ct-3", ("application/json", body), ("text/plain", body)).await;
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_route_longer_than_a_scope_is_protected() {
    let stack = stack().await;
    let orders = Orders::default();
    let long = format!("/v1/{}{{id}}/items", "a-very-long-segment-name/".repeat(8));
    let longer = format!("/v1/{}{{id}}/other", "a-very-long-segment-name/".repeat(8));
    let app = Router::new()
        .route(&long, post(create_order))
        .route(&longer, post(create_order))
        .route_layer(shared(service(&stack)))
        .with_state(orders.clone());
    let url = bind(app).await;
    let http = reqwest::Client::new();
    let send = |route: &str| {
        http.post(format!("{url}{}", route.replace("{id}", "7")))
            .header("idempotency-key", "long-1")
            .header("x-tenant", TENANT)
            .header("content-type", "application/json")
            .body("{}")
            .send()
    };
    let (status, _, first) = body(send(&long).await.unwrap()).await;
    assert_eq!(status, StatusCode::CREATED, "{first}");
    let (_, headers, replay) = body(send(&long).await.unwrap()).await;
    assert_eq!((&headers["idempotent-replayed"], replay), (&"true".parse().unwrap(), first));
    // Another long route with the same beginning is another scope, not a 422.
    assert_eq!(send(&longer).await.unwrap().status(), StatusCode::CREATED);
    let scopes: Vec<String> = sqlx::query_scalar("select scope from agent.idempotency_keys order by scope")
        .fetch_all(stack.db())
        .await
        .unwrap();
    assert_eq!(scopes.len(), 2);
    assert_ne!(scopes[0], scopes[1]);
    assert!(scopes.iter().all(|s| s.len() <= 128 && s.starts_with("http.post.v1.a-very-long")), "{scopes:?}");
    assert_eq!(orders.runs.load(Ordering::SeqCst), 2);
    stack.stop().await.unwrap();
}
