//! The lease token is a fence: a worker whose lease passed cannot write.

use std::time::Duration;

use idempotency_plane::postgrest::ClientError;
use idempotency_plane::repo::{ClaimRequest, CompletionArgs};
use idempotency_plane::{ClaimOutcome, Completion, Ending, Error, IdempotencyRepository, InvalidInput};
use serde_json::json;

use crate::support::harness::*;

/// Worker A claims, stalls past its lease; worker B reclaims.
async fn stalled_and_replaced(
    service: &Service,
    stack: &idempotency_plane::local::LocalStack,
) -> (idempotency_plane::Claim, idempotency_plane::Claim) {
    let org = org();
    let h = hash("stall");
    let a = claimed(service.claim(org, "tool.email.send", "stall", &h, LEASE).await);
    pass_lease(stack, a.id()).await;
    let b = claimed(service.claim(org, "tool.email.send", "stall", &h, LEASE).await);
    assert!(b.reclaimed());
    (a, b)
}

#[tokio::test]
async fn a_worker_whose_lease_passed_cannot_complete_the_claim_afterwards() {
    let stack = stack().await;
    let service = service(&stack);
    let (a, b) = stalled_and_replaced(&service, &stack).await;

    // A wakes and completes with its stale answer: a silent no-op.
    let stale = service.complete(&a, Completion::response(json!({"from": "A"}))).await.unwrap();
    assert_eq!(stale, Ending::LeaseMovedOn);
    let (status, token): (String, uuid::Uuid) =
        sqlx::query_as("select status, lease_token from agent.idempotency_keys where id = $1")
            .bind(a.id())
            .fetch_one(stack.db())
            .await
            .unwrap();
    assert_eq!((status.as_str(), token), ("processing", b.lease_token()));

    // B's answer is the one stored, and A cannot overwrite it after either.
    assert_eq!(service.complete(&b, Completion::response(json!({"from": "B"}))).await.unwrap(), Ending::Recorded);
    assert_eq!(service.complete(&a, Completion::response(json!({"from": "A"}))).await.unwrap(), Ending::LeaseMovedOn);
    let response: serde_json::Value = sqlx::query_scalar("select response from agent.idempotency_keys where id = $1")
        .bind(a.id())
        .fetch_one(stack.db())
        .await
        .unwrap();
    assert_eq!(response, json!({"from": "B"}));
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_worker_whose_lease_passed_cannot_release_the_claim_another_worker_holds() {
    let stack = stack().await;
    let service = service(&stack);
    let (a, b) = stalled_and_replaced(&service, &stack).await;

    assert_eq!(service.release(&a).await.unwrap(), Ending::LeaseMovedOn);
    assert_eq!(count_rows(&stack).await, 1, "B's claim survives A's release");
    assert_eq!(service.complete(&b, Completion::resource("email.message", "m-9")).await.unwrap(), Ending::Recorded);
    // Nor can a completed claim be released by anyone: it is the journal.
    assert_eq!(service.release(&b).await.unwrap(), Ending::LeaseMovedOn);
    assert_eq!(count_rows(&stack).await, 1);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_claim_whose_lease_passed_is_still_readable_while_retain_until_holds() {
    let stack = stack().await;
    let service = service(&stack);
    let org = org();
    let h = hash("remember me");
    let claim = claimed(service.claim(org, "tool.email.send", "k", &h, LEASE).await);
    pass_lease(&stack, claim.id()).await;
    let record = service.repository().get(org, "tool.email.send", "k").await.unwrap().expect("still stored");
    assert!(!record.lease_live, "lease passed by the database clock");
    assert!(record.retain_until > chrono::Utc::now(), "retention still holds");
    assert_eq!(record.lease_token, None, "a read never answers the holder's token");

    // A completed claim whose lease moment is long gone is readable for its whole retention.
    let claim = claimed(service.claim(org, "tool.email.send", "k", &h, LEASE).await);
    assert_eq!(service.complete(&claim, Completion::response(json!("sent"))).await.unwrap(), Ending::Recorded);
    travel_back(&stack, claim.id(), Duration::from_secs(29 * 86_400)).await;
    let replay = service.claim(org, "tool.email.send", "k", &h, LEASE).await.unwrap();
    assert_eq!(replay, ClaimOutcome::Completed { response: Some(json!("sent")), resource: None, response_ref: None });
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_reclaim_moves_the_lease_and_never_shortens_retain_until() {
    let stack = stack().await;
    let service = service(&stack);
    let repo = service.repository();
    let org = org();
    let h = hash("floors");
    let claim = claimed(service.claim(org, "tool.email.send", "k", &h, LEASE).await);
    pass_lease(&stack, claim.id()).await;
    let before = repo.get(org, "tool.email.send", "k").await.unwrap().expect("row");

    // A reclaim that asks for a much shorter retention keeps the longer one.
    let token = uuid::Uuid::new_v4();
    let request = ClaimRequest {
        organization_id: org,
        scope: "tool.email.send",
        key: "k",
        request_hash: h.as_str(),
        lease_token: token,
        lease: Duration::from_secs(30),
        retain: Duration::from_secs(60),
    };
    let after = repo.reclaim(&request).await.unwrap().expect("reclaimed");
    assert_eq!(after.lease_token, Some(token));
    assert!(after.lease_live);
    assert!(after.lease_expires_at > before.lease_expires_at, "the lease moved");
    assert!(after.claimed_at > before.lease_expires_at, "the new holder's claim starts after the old lease ended");
    // Never shorter than it was, nor than the scope's 30 days: not the 60 s
    // asked for. (Equal to before only while the reclaim comes within 30 s
    // of the first claim, which a busy machine does not promise.)
    assert!(after.retain_until >= before.retain_until, "retention never shortens");
    assert!(
        after.retain_until >= after.lease_expires_at + chrono::TimeDelta::days(29),
        "the policy's retention, not the 60 s asked for: {}",
        after.retain_until
    );

    // A reclaim of a live lease does nothing.
    let again = ClaimRequest { lease_token: uuid::Uuid::new_v4(), ..request };
    assert!(repo.reclaim(&again).await.unwrap().is_none());
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_completion_with_neither_response_nor_resource_is_refused() {
    let stack = stack().await;
    let service = service(&stack);
    let org = org();
    let claim = claimed(service.claim(org, "tool.email.send", "k", &hash("x"), LEASE).await);

    // The service refuses before any request.
    let empty = service.complete(&claim, Completion::response(serde_json::Value::Null)).await;
    assert!(matches!(empty, Err(Error::Invalid(InvalidInput::EmptyCompletion))), "{empty:?}");

    // The database refuses too, whoever calls it: nothing at all, and JSON null.
    let repo = service.repository();
    for args in [
        CompletionArgs::default(),
        CompletionArgs { response: Some(&serde_json::Value::Null), ..CompletionArgs::default() },
        CompletionArgs { resource_id: Some("m-1"), ..CompletionArgs::default() },
    ] {
        let refused = repo.complete(claim.organization_id(), claim.id(), claim.lease_token(), args).await;
        match refused {
            Err(Error::Store(ClientError::Api { status: 400, error, .. })) => assert_eq!(error.code, "22023"),
            other => panic!("expected a 400 22023, got {other:?}"),
        }
    }
    let status: String = sqlx::query_scalar("select status from agent.idempotency_keys where id = $1")
        .bind(claim.id())
        .fetch_one(stack.db())
        .await
        .unwrap();
    assert_eq!(status, "processing", "the refused completions changed nothing");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn an_argument_can_only_lengthen_the_scopes_retention_and_a_reclaim_can_extend_it() {
    let stack = stack().await;
    let service = service(&stack);
    let repo = service.repository();
    let org = org();
    let h = hash("floor");
    let request = ClaimRequest {
        organization_id: org,
        scope: "tool.email.send",
        key: "k",
        request_hash: h.as_str(),
        lease_token: uuid::Uuid::new_v4(),
        lease: Duration::from_secs(60),
        retain: Duration::from_secs(1),
    };
    // A shorter retention than the scope's 30 days is ignored: the policy holds.
    let claimed = repo.try_claim(&request).await.unwrap().expect("claimed");
    assert_eq!(claimed.retain_until - claimed.lease_expires_at, chrono::TimeDelta::days(30));

    // A reclaim asking for a longer retention extends it: greatest() takes the new one.
    pass_lease(&stack, claimed.id).await;
    let longer =
        ClaimRequest { lease_token: uuid::Uuid::new_v4(), retain: Duration::from_secs(40 * 86_400), ..request };
    let reclaimed = repo.reclaim(&longer).await.unwrap().expect("reclaimed");
    assert_eq!(reclaimed.retain_until - reclaimed.lease_expires_at, chrono::TimeDelta::days(40));
    assert_eq!(reclaimed.lease_expires_at - reclaimed.claimed_at, chrono::TimeDelta::seconds(60));
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn the_answer_is_remembered_for_the_retention_counted_from_the_completion() {
    let stack = stack().await;
    let service = service(&stack);
    let org = org();
    let claim = claimed(service.claim(org, "webhook.nylas", "delivery-1", &hash("d"), LEASE).await);
    // The worker finished late in its day of retention.
    travel_back(&stack, claim.id(), Duration::from_secs(23 * 3600)).await;
    assert_eq!(service.complete(&claim, Completion::response(json!({"ack": true}))).await.unwrap(), Ending::Recorded);
    let remaining: f64 = sqlx::query_scalar(
        "select extract(epoch from retain_until - now())::float8 from agent.idempotency_keys where id = $1",
    )
    .bind(claim.id())
    .fetch_one(stack.db())
    .await
    .unwrap();
    // A whole day from the completion, not the hour left of the claim's day.
    assert!(remaining > 23.9 * 3600.0 && remaining <= 24.0 * 3600.0, "{remaining}");
    stack.stop().await.unwrap();
}
