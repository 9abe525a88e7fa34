//! The service's decisions, each case written once over any [`Plane`] and
//! run on the in-memory repository and, with feature `local`, on the stack:
//! claim, replay of a completed claim, in progress under a live lease,
//! conflict for other content, reclaim after the lease, release, the
//! journal, and typed refusals of bad input. Races across connections and
//! the database's clock stay in `crate::stack::claims`.

use std::time::Duration;

use idempotency_plane::repo::IdempotencyRecord;
use idempotency_plane::{ClaimOutcome, Completion, Ending, Error, InvalidInput, ReadOutcome, RequestHash};
use serde_json::json;

use super::{row, service};
use crate::support::backends::Plane;
use crate::support::{claimed, hash, org, LEASE};

async fn completed_duplicate_returns_stored_resource_and_result<P: Plane>(plane: &P) {
    let service = service(plane);
    let org = org();
    let h = hash("send a@b.c");

    let claim = claimed(service.claim(org, "tool.email.send", "run-1:step-1", &h, LEASE).await);
    let completion = Completion::response(json!({"message_id": "m-1"})).with_resource("nylas.message", "m-1");
    assert_eq!(service.complete(&claim, completion).await.unwrap(), Ending::Recorded);

    let claimed_again = service.claim(org, "tool.email.send", "run-1:step-1", &h, LEASE).await.unwrap();
    let ClaimOutcome::Completed { response, resource, response_ref: None } = claimed_again else {
        panic!("expected the stored answer, got {claimed_again:?}");
    };
    let read = service.read(org, "tool.email.send", "run-1:step-1", &h).await.unwrap();
    assert_eq!(
        read,
        ReadOutcome::Completed { response: response.clone(), resource: resource.clone(), response_ref: None }
    );
    assert_eq!(response, Some(json!({"message_id": "m-1"})));
    let resource = resource.expect("resource stored");
    assert_eq!((resource.resource_type.as_str(), resource.resource_id.as_str()), ("nylas.message", "m-1"));
    assert_eq!(plane.claims().await, 1);
}

async fn same_key_with_a_different_hash_is_a_conflict_also_after_the_lease_passed<P: Plane>(plane: &P) {
    let service = service(plane);
    let org = org();

    let claim = claimed(service.claim(org, "webhook.nylas", "delivery-9", &hash("body A"), LEASE).await);
    // Live lease: the hash is compared first, so this is a conflict, not processing.
    assert_eq!(
        service.claim(org, "webhook.nylas", "delivery-9", &hash("body B"), LEASE).await.unwrap(),
        ClaimOutcome::Conflict
    );
    assert_eq!(service.read(org, "webhook.nylas", "delivery-9", &hash("body B")).await.unwrap(), ReadOutcome::Conflict);

    // Lease passed: still a conflict, never a reclaim for different content.
    plane.pass_lease(claim.id()).await;
    assert_eq!(
        service.claim(org, "webhook.nylas", "delivery-9", &hash("body B"), LEASE).await.unwrap(),
        ClaimOutcome::Conflict
    );
    assert_eq!(service.read(org, "webhook.nylas", "delivery-9", &hash("body B")).await.unwrap(), ReadOutcome::Conflict);
    let stored = row(plane, org, "webhook.nylas", "delivery-9").await;
    assert_eq!(
        (stored.request_hash.as_str(), stored.lease_live, stored.lease_token),
        (hash("body A").as_str(), false, None),
        "the conflicting callers did not take the key (and a read shows no token)"
    );

    // Completed: still a conflict.
    let claim = claimed(service.claim(org, "webhook.nylas", "delivery-9", &hash("body A"), LEASE).await);
    assert_eq!(service.complete(&claim, Completion::response(json!({"ok": true}))).await.unwrap(), Ending::Recorded);
    assert_eq!(
        service.claim(org, "webhook.nylas", "delivery-9", &hash("body B"), LEASE).await.unwrap(),
        ClaimOutcome::Conflict
    );
}

async fn read_writes_no_row_and_answers_absent_for_a_passed_lease<P: Plane>(plane: &P) {
    let service = service(plane);
    let org = org();
    let h = hash("approve me");

    assert_eq!(service.read(org, "tool.crm.company.create", "run-3:step-1", &h).await.unwrap(), ReadOutcome::Absent);
    assert_eq!(plane.claims().await, 0, "read() never writes");

    let claim = claimed(service.claim(org, "tool.crm.company.create", "run-3:step-1", &h, LEASE).await);
    assert!(matches!(
        service.read(org, "tool.crm.company.create", "run-3:step-1", &h).await.unwrap(),
        ReadOutcome::Processing { .. }
    ));

    plane.pass_lease(claim.id()).await;
    let lease_of = |row: IdempotencyRecord| (row.id, row.lease_token, row.lease_expires_at);
    let before = lease_of(row(plane, org, "tool.crm.company.create", "run-3:step-1").await);
    assert_eq!(before.0, claim.id());
    assert_eq!(service.read(org, "tool.crm.company.create", "run-3:step-1", &h).await.unwrap(), ReadOutcome::Absent);
    let after = lease_of(row(plane, org, "tool.crm.company.create", "run-3:step-1").await);
    assert_eq!(before, after, "read() did not reclaim");
    assert_eq!(plane.claims().await, 1);
}

async fn a_crashed_workers_claim_is_reclaimed_by_the_next_caller_and_the_run_continues<P: Plane>(plane: &P) {
    let service = service(plane);
    let org = org();
    let h = hash("charge 10 EUR");

    // Worker A claims and dies without an ending; while its lease is live,
    // nobody else runs the effect.
    let crashed = claimed(service.claim(org, "tool.payments.charge", "run-5:step-4", &h, LEASE).await);
    assert!(matches!(
        service.claim(org, "tool.payments.charge", "run-5:step-4", &h, LEASE).await.unwrap(),
        ClaimOutcome::Processing { .. }
    ));
    // Its lease passes (time travel in SQL; idem demo lets real time pass).
    plane.pass_lease(crashed.id()).await;

    // The next caller reads absent (other content still a conflict), claims,
    // and owns it with a new token; the dead worker's ending is fenced off.
    assert_eq!(service.read(org, "tool.payments.charge", "run-5:step-4", &h).await.unwrap(), ReadOutcome::Absent);
    let other = hash("charge 20 EUR");
    assert_eq!(service.read(org, "tool.payments.charge", "run-5:step-4", &other).await.unwrap(), ReadOutcome::Conflict);
    let next = claimed(service.claim(org, "tool.payments.charge", "run-5:step-4", &h, LEASE).await);
    assert!(next.reclaimed());
    assert_eq!(next.id(), crashed.id());
    assert_ne!(next.lease_token(), crashed.lease_token());
    assert_eq!(service.complete(&crashed, Completion::response(json!(1))).await.unwrap(), Ending::LeaseMovedOn);
    let completion = Completion::response(json!(2)).with_resource("payment", "pay-1");
    assert_eq!(service.complete(&next, completion).await.unwrap(), Ending::Recorded);
    let replay = service.claim(org, "tool.payments.charge", "run-5:step-4", &h, LEASE).await.unwrap();
    assert!(matches!(replay, ClaimOutcome::Completed { response: Some(ref r), .. } if *r == json!(2)), "{replay:?}");
}

async fn a_live_lease_cannot_be_stolen<P: Plane>(plane: &P) {
    let service = service(plane);
    let org = org();
    let h = hash("x");
    let owner = claimed(service.claim(org, "tool.email.send", "k", &h, LEASE).await);
    for _ in 0..3 {
        let outcome = service.claim(org, "tool.email.send", "k", &h, LEASE).await.unwrap();
        let ClaimOutcome::Processing { lease_expires_at } = outcome else {
            panic!("a live lease answers processing, got {outcome:?}");
        };
        assert_eq!(lease_expires_at, owner.lease_expires_at());
    }
    // The owner still holds it: its ending is recorded.
    assert_eq!(service.complete(&owner, Completion::response(json!(1))).await.unwrap(), Ending::Recorded);
}

async fn a_released_claim_lets_the_next_attempt_execute<P: Plane>(plane: &P) {
    let service = service(plane);
    let org = org();
    let h = hash("vendor 429");
    let first = claimed(service.claim(org, "tool.email.send", "k", &h, LEASE).await);
    assert_eq!(service.release(&first).await.unwrap(), Ending::Recorded);
    assert_eq!(plane.claims().await, 0);
    let second = claimed(service.claim(org, "tool.email.send", "k", &h, LEASE).await);
    assert!(!second.reclaimed());
    assert_ne!(second.lease_token(), first.lease_token());
}

async fn bad_input_is_a_typed_error_and_writes_nothing<P: Plane>(plane: &P) {
    let service = service(plane);
    let org = org();
    let h = hash("x");
    let long_key = "k".repeat(513);

    let cases: Vec<(Result<ClaimOutcome, Error>, &str)> = vec![
        (service.claim(org, "tool.email.send", "", &h, LEASE).await, "empty key"),
        (service.claim(org, "tool.email.send", &long_key, &h, LEASE).await, "long key"),
        (service.claim(org, "", "k", &h, LEASE).await, "empty scope"),
        (service.claim(org, "payments.charge", "k", &h, LEASE).await, "unknown scope"),
        (service.claim(org, "tool.email.send", "k", &h, Duration::ZERO).await, "zero lease"),
        (service.claim(org, "tool.email.send", "k", &h, Duration::from_millis(999)).await, "sub-second lease"),
        (service.claim(org, &format!("tool.{}", "x".repeat(124)), "k", &h, LEASE).await, "long scope"),
        (service.claim(org, "tool.email.send", "a\0b", &h, LEASE).await, "NUL in key"),
        (service.claim(org, "tool.email.send", "k", &h, Duration::from_secs(86_401)).await, "long lease"),
    ];
    for (result, case) in cases {
        match result {
            Err(Error::Invalid(_)) | Err(Error::UnknownScope { .. }) => {}
            other => panic!("{case}: expected a typed input error, got {other:?}"),
        }
    }
    let read = service.read(org, "webhooks.typo", "k", &h).await;
    assert!(matches!(read, Err(Error::UnknownScope { .. })), "unknown scope on read: {read:?}");
    assert!(matches!("ABC".parse::<RequestHash>(), Err(InvalidInput::MalformedHash { .. })));
    assert_eq!(plane.claims().await, 0);
}

crate::support::on_every_plane!(
    completed_duplicate_returns_stored_resource_and_result,
    same_key_with_a_different_hash_is_a_conflict_also_after_the_lease_passed,
    read_writes_no_row_and_answers_absent_for_a_passed_lease,
    a_crashed_workers_claim_is_reclaimed_by_the_next_caller_and_the_run_continues,
    a_live_lease_cannot_be_stolen,
    a_released_claim_lets_the_next_attempt_execute,
    bad_input_is_a_typed_error_and_writes_nothing,
);
