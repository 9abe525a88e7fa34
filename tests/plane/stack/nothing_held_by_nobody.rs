//! Whatever a caller cannot receive, the plane does not do: a re-drive
//! whose answer was lost is repeated with the caller's tokens and answers
//! the same claims, at the same attempt; and no function that answers rows
//! takes a caller's row cap above the plane's own, so a server that cuts
//! answers at its cap never cuts rows the plane claimed or took over.

use idempotency_plane::local::LocalStackConfig;
use idempotency_plane::postgrest::{codes, RetryConfig};
use idempotency_plane::repo::{
    BatchClaims, ClaimItem, ClaimManyCall, FailuresCall, JournaledFailures, OrphanedWork, RedriveCall,
};
use idempotency_plane::{ClientError, Error, PostgrestRepository};
use serde_json::json;
use uuid::Uuid;

use crate::support::harness::*;
use crate::support::proxy::RpcProxy;

const SCOPE: &str = "queue.redrive";

/// Claims `n` keys of `org` with their work, then lets their worker die.
async fn orphans(stack: &idempotency_plane::local::LocalStack, org: Uuid, n: usize) {
    let repo = PostgrestRepository::new(client(stack));
    let h = hash("orphan").as_str().to_owned();
    let keys: Vec<String> = (0..n).map(|i| format!("o-{i}")).collect();
    let work = json!({"job": "orphan"});
    let items: Vec<ClaimItem<'_>> = keys
        .iter()
        .map(|key| ClaimItem { key, request_hash: &h, lease_token: Uuid::new_v4(), request: Some(&work) })
        .collect();
    let call = ClaimManyCall { organization_id: org, scope: SCOPE, lease: LEASE, items: &items };
    let claimed = repo.claim_many(&call).await.expect("the claims");
    for row in claimed {
        pass_lease(stack, row.id).await;
    }
}

/// Each claim's (token, reclaims) by key, as the database holds them.
async fn held(stack: &idempotency_plane::local::LocalStack, org: Uuid) -> Vec<(String, Uuid, i32)> {
    sqlx::query_as(
        "select key, lease_token, reclaims from agent.idempotency_keys where organization_id = $1 order by key",
    )
    .bind(org)
    .fetch_all(stack.db())
    .await
    .expect("the claims")
}

#[tokio::test]
async fn a_redrive_whose_answer_was_lost_is_repeated_and_answers_the_same_claims_at_the_same_attempt() {
    let stack = stack().await;
    let org = org();
    orphans(&stack, org, 5).await;
    let proxy = RpcProxy::start(stack.url()).await;
    // The database takes the orphans over and commits; the answer never
    // comes. The client repeats the call (a re-drive is safe to repeat).
    proxy.drop_next("idempotency_redrive", 1);
    let repo = PostgrestRepository::new(proxy.client(stack.service_key(), RetryConfig::default()));
    let tokens = crate::support::lease_tokens(8);
    let call = RedriveCall { scope: SCOPE, lease_tokens: tokens, lease: LEASE, organization_id: Some(org) };
    let rows = repo.redrive(&call).await.expect("the repeated re-drive");
    assert_eq!(proxy.requests("idempotency_redrive"), 2, "asked twice: the first answer was lost");

    assert_eq!(rows.len(), 5, "every orphan the lost answer took is answered: {rows:#?}");
    for row in &rows {
        assert_eq!(row.attempt, 2, "the same attempt, not a second one: {row:?}");
        assert!(row.lease_token.is_some_and(|token| tokens.contains(&token)), "held under the caller's token");
    }
    for (key, token, reclaims) in held(&stack, org).await {
        assert!(tokens.contains(&token), "{key} is held by a token the caller has");
        assert_eq!(reclaims, 1, "{key} was taken over once");
        assert!(rows.iter().any(|row| row.key == key && row.lease_token == Some(token)), "{key} was answered");
    }

    // The caller may also repeat it itself, later: the same answer again,
    // and nothing more taken.
    let again = PostgrestRepository::new(client(&stack)).redrive(&call).await.expect("a repeat");
    let mut first: Vec<_> = rows.iter().map(|row| (row.id, row.lease_token, row.attempt)).collect();
    let mut second: Vec<_> = again.iter().map(|row| (row.id, row.lease_token, row.attempt)).collect();
    first.sort();
    second.sort();
    assert_eq!(first, second);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_redrive_repeated_with_fresh_tokens_takes_nothing_the_first_still_holds() {
    let stack = stack().await;
    let org = org();
    orphans(&stack, org, 3).await;
    let repo = PostgrestRepository::new(client(&stack));
    let call = |tokens| RedriveCall { scope: SCOPE, lease_tokens: tokens, lease: LEASE, organization_id: Some(org) };
    let first = crate::support::lease_tokens(2);
    assert_eq!(repo.redrive(&call(first)).await.expect("a re-drive").len(), 2);
    // Another re-driver, with tokens of its own: the one orphan left.
    let second = repo.redrive(&call(crate::support::lease_tokens(5))).await.expect("another");
    assert_eq!(second.len(), 1);
    // The first caller's repeat: its two, nothing of the second's.
    let repeated = repo.redrive(&call(first)).await.expect("a repeat");
    assert_eq!(repeated.len(), 2);
    assert!(repeated.iter().all(|row| row.lease_token.is_some_and(|t| first.contains(&t)) && row.attempt == 2));
    stack.stop().await.unwrap();
}

/// A client told a cap above the plane's (the server's): every function
/// that answers rows refuses it before anything is written.
#[tokio::test]
async fn a_row_cap_above_the_planes_is_refused_by_every_function_that_answers_rows_and_nothing_is_written() {
    let stack = stack_with(LocalStackConfig::default().with_max_rows(5)).await;
    let org = org();
    orphans(&stack, org, 3).await;
    let before = held(&stack, org).await;
    let told_ten = PostgrestRepository::new(
        idempotency_plane::PostgrestClient::new(
            stack
                .client_config()
                .expect("a config")
                .with_max_rows(10)
                .expect("a cap")
                .with_retry(RetryConfig::disabled()),
        )
        .expect("a client"),
    );
    let refused = |what: &str, result: Result<usize, Error>| match result {
        Err(Error::Store(ClientError::Api { status: 400, error, .. }))
            if error.code == codes::INVALID_PARAMETER_VALUE && error.message.contains("the plane's row cap 5") => {}
        other => panic!("{what}: expected the plane's refusal, got {other:?}"),
    };

    let h = hash("capped").as_str().to_owned();
    let keys: Vec<String> = (0..8).map(|i| format!("c-{i}")).collect();
    let items: Vec<ClaimItem<'_>> = keys
        .iter()
        .map(|key| ClaimItem { key, request_hash: &h, lease_token: Uuid::new_v4(), request: None })
        .collect();
    let batch = ClaimManyCall { organization_id: org, scope: SCOPE, lease: LEASE, items: &items };
    refused("a batch of 8", told_ten.claim_many(&batch).await.map(|rows| rows.len()));
    let tokens = crate::support::lease_tokens(8);
    let redrive = RedriveCall { scope: SCOPE, lease_tokens: tokens, lease: LEASE, organization_id: Some(org) };
    refused("a re-drive of 8", told_ten.redrive(&redrive).await.map(|rows| rows.len()));
    let failures = FailuresCall { scope: SCOPE, bound: 8, organization_id: Some(org), since: None, claim_ids: None };
    refused("8 failures", told_ten.failures(&failures).await.map(|rows| rows.len()));
    assert_eq!(held(&stack, org).await, before, "nothing was claimed or taken over");
    assert_eq!(count_rows(&stack).await, 3);

    // A client told the plane's cap is answered.
    let within = RedriveCall { lease_tokens: &tokens[..5], ..redrive };
    let told_five = PostgrestRepository::new(client(&stack));
    assert_eq!(told_five.redrive(&within).await.expect("within the cap").len(), 3);
    stack.stop().await.unwrap();
}

/// A re-drive never hands a caller more work than it reads in one answer:
/// the orphans beyond the client's response limit stay orphans, no
/// attempt spent, for its next call.
#[tokio::test]
async fn a_redrive_hands_out_no_more_work_than_the_client_reads_in_one_answer() {
    let stack = stack().await;
    let org = org();
    let repo = PostgrestRepository::new(client(&stack));
    let h = hash("big work").as_str().to_owned();
    let work = json!({"body": "x".repeat(20_000)});
    let keys: Vec<String> = (0..6).map(|i| format!("big-{i}")).collect();
    let items: Vec<ClaimItem<'_>> = keys
        .iter()
        .map(|key| ClaimItem { key, request_hash: &h, lease_token: Uuid::new_v4(), request: Some(&work) })
        .collect();
    let call = ClaimManyCall { organization_id: org, scope: SCOPE, lease: LEASE, items: &items };
    for row in repo.claim_many(&call).await.expect("the claims") {
        pass_lease(&stack, row.id).await;
    }
    // A client that reads answers of at most 64 KiB: 10 tokens leave
    // 54 KiB of work, two orphans of 20 KB each.
    let small = PostgrestRepository::new(
        idempotency_plane::PostgrestClient::new(
            stack.client_config().expect("a config").with_max_response_bytes(64 * 1024).expect("a limit"),
        )
        .expect("a client"),
    );
    let tokens = crate::support::lease_tokens(10);
    let redrive = RedriveCall { scope: SCOPE, lease_tokens: tokens, lease: LEASE, organization_id: Some(org) };
    let first = small.redrive(&redrive).await.expect("a re-drive that fits");
    assert_eq!(first.len(), 2, "as much work as fits the answer");
    let attempts: Vec<i32> = held(&stack, org).await.into_iter().map(|(_, _, reclaims)| reclaims).collect();
    assert_eq!(attempts.iter().filter(|reclaims| **reclaims == 0).count(), 4, "the rest spent no attempt");
    // Its next call, with fresh tokens, takes the next two.
    let next = RedriveCall { lease_tokens: crate::support::lease_tokens(10), ..redrive };
    assert_eq!(small.redrive(&next).await.expect("the next").len(), 2);
    stack.stop().await.unwrap();
}
