//! The claim contract where only the real stack can show it: races across
//! connections, round trips, row locks and the database's clock. The
//! service's other decisions are in `crate::callers::service`, on both planes.

use std::sync::Arc;
use std::time::Duration;

use idempotency_plane::repo::IdempotencyRepository;
use idempotency_plane::{ClaimOutcome, Completion, Ending, Error};
use serde_json::json;

use crate::support::harness::*;

#[tokio::test]
async fn twenty_concurrent_claims_for_the_same_key_produce_one_owner() {
    let stack = stack().await;
    let service = Arc::new(service(&stack));
    let org = org();
    let h = hash("one effect");

    let attempts = (0..20).map(|_| {
        let (service, h) = (service.clone(), h.clone());
        tokio::spawn(async move { service.claim(org, "tool.email.send", "run-7:step-2", &h, LEASE).await })
    });
    let outcomes: Vec<ClaimOutcome> = futures::future::join_all(attempts)
        .await
        .into_iter()
        .map(|joined| joined.expect("task").expect("claim"))
        .collect();

    let owners = outcomes.iter().filter(|o| matches!(o, ClaimOutcome::Claimed(_))).count();
    let in_flight = outcomes.iter().filter(|o| matches!(o, ClaimOutcome::Processing { .. })).count();
    assert_eq!(owners, 1, "{outcomes:?}");
    assert_eq!(in_flight, 19, "every other caller sees the live lease: {outcomes:?}");
    assert_eq!(count_rows(&stack).await, 1);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_passed_lease_is_reclaimed_by_exactly_one_of_twenty_concurrent_callers() {
    let stack = stack().await;
    let service = Arc::new(service(&stack));
    let org = org();
    let h = hash("reclaim race");
    let crashed = claimed(service.claim(org, "tool.email.send", "race", &h, LEASE).await);
    pass_lease(&stack, crashed.id()).await;

    let attempts = (0..20).map(|_| {
        let (service, h) = (service.clone(), h.clone());
        tokio::spawn(async move { service.claim(org, "tool.email.send", "race", &h, LEASE).await })
    });
    let outcomes: Vec<ClaimOutcome> = futures::future::join_all(attempts)
        .await
        .into_iter()
        .map(|joined| joined.expect("task").expect("claim"))
        .collect();

    let winners: Vec<_> = outcomes
        .iter()
        .filter_map(|o| match o {
            ClaimOutcome::Claimed(c) => Some(c),
            _ => None,
        })
        .collect();
    assert_eq!(winners.len(), 1, "{outcomes:?}");
    assert!(winners[0].reclaimed());
    assert_eq!(outcomes.iter().filter(|o| matches!(o, ClaimOutcome::Processing { .. })).count(), 19);
    let token: uuid::Uuid = sqlx::query_scalar("select lease_token from agent.idempotency_keys where id = $1")
        .bind(crashed.id())
        .fetch_one(stack.db())
        .await
        .unwrap();
    assert_eq!(token, winners[0].lease_token());
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn retention_is_the_scopes_policy_counted_from_the_end_of_the_lease_by_the_database_clock() {
    let stack = stack().await;
    let service = service(&stack);
    let org = org();
    let lease = Duration::from_secs(90);
    for (scope, days) in [("tool.email.send", 30i64), ("webhook.nylas", 1), ("surface.saved_search.start", 1)] {
        let claim = claimed(service.claim(org, scope, "k", &hash("r"), lease).await);
        let (lease_ms, retain_ms): (f64, f64) = sqlx::query_as(
            "select extract(epoch from lease_expires_at - claimed_at)::float8 * 1000,
                    extract(epoch from retain_until - lease_expires_at)::float8 * 1000
               from agent.idempotency_keys where id = $1",
        )
        .bind(claim.id())
        .fetch_one(stack.db())
        .await
        .unwrap();
        assert_eq!(lease_ms, 90_000.0, "{scope}");
        assert_eq!(retain_ms, (days * 86_400_000) as f64, "{scope}");
    }
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn every_claim_outcome_costs_one_round_trip() {
    let stack = stack().await;
    let client = client(&stack);
    let service =
        idempotency_plane::IdempotencyService::new(idempotency_plane::PostgrestRepository::new(client.clone()));
    let org = org();
    let h = hash("trips");
    let trips = |before: u64| client.requests_sent() - before;

    let before = client.requests_sent();
    let claim = claimed(service.claim(org, "tool.email.send", "k", &h, LEASE).await);
    assert_eq!(trips(before), 1, "first claim");

    let before = client.requests_sent();
    let in_flight = service.claim(org, "tool.email.send", "k", &h, LEASE).await.unwrap();
    assert!(matches!(in_flight, ClaimOutcome::Processing { .. }), "{in_flight:?}");
    assert_eq!(trips(before), 1, "processing");
    let _ = service.complete(&claim, Completion::response(json!(1))).await.unwrap();

    let before = client.requests_sent();
    assert!(matches!(
        service.claim(org, "tool.email.send", "k", &h, LEASE).await.unwrap(),
        ClaimOutcome::Completed { .. }
    ));
    assert_eq!(trips(before), 1, "replay");

    let before = client.requests_sent();
    assert_eq!(
        service.claim(org, "tool.email.send", "k", &hash("other"), LEASE).await.unwrap(),
        ClaimOutcome::Conflict
    );
    assert_eq!(trips(before), 1, "conflict");

    let crashed = claimed(service.claim(org, "tool.email.send", "k2", &h, LEASE).await);
    pass_lease(&stack, crashed.id()).await;
    let before = client.requests_sent();
    assert!(claimed(service.claim(org, "tool.email.send", "k2", &h, LEASE).await).reclaimed());
    assert_eq!(trips(before), 1, "reclaim");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn the_replay_cache_answers_completed_claims_without_a_round_trip_and_never_caches_processing() {
    let stack = stack().await;
    let client = client(&stack);
    let service =
        idempotency_plane::IdempotencyService::new(idempotency_plane::PostgrestRepository::new(client.clone()))
            .with_replay_cache(100, 1 << 20, Duration::from_secs(60));
    let org = org();
    let h = hash("cached");

    let claim = claimed(service.claim(org, "tool.email.send", "done", &h, LEASE).await);
    let _ = service.complete(&claim, Completion::response(json!({"id": 9})).with_resource("t", "9")).await.unwrap();
    let before = client.requests_sent();
    for _ in 0..3 {
        let replay = service.claim(org, "tool.email.send", "done", &h, LEASE).await.unwrap();
        let ClaimOutcome::Completed { response, resource, .. } = replay else { panic!("{replay:?}") };
        assert_eq!(response, Some(json!({"id": 9})));
        assert_eq!(resource.map(|r| r.resource_id), Some("9".to_owned()));
        assert_eq!(service.read(org, "tool.email.send", "done", &h).await.unwrap().kind(), "completed");
        assert_eq!(
            service.claim(org, "tool.email.send", "done", &hash("x"), LEASE).await.unwrap(),
            ClaimOutcome::Conflict
        );
    }
    assert_eq!(client.requests_sent(), before, "replays and conflicts answered in process");

    // A processing claim always goes to the store.
    let _live = claimed(service.claim(org, "tool.email.send", "live", &h, LEASE).await);
    let before = client.requests_sent();
    for _ in 0..2 {
        assert!(matches!(
            service.claim(org, "tool.email.send", "live", &h, LEASE).await.unwrap(),
            ClaimOutcome::Processing { .. }
        ));
    }
    assert_eq!(client.requests_sent() - before, 2, "one round trip each, never cached");
    let (entries, bytes) = service.replay_cache_stats().expect("a cache");
    assert_eq!(entries, 1);
    assert!(bytes > 0);
    stack.stop().await.unwrap();
}

/// Holds the row lock of claim `id` in a transaction of its own until the
/// returned sender is dropped or sent to.
async fn hold_row_lock(
    stack: &idempotency_plane::local::LocalStack,
    id: uuid::Uuid,
) -> tokio::sync::oneshot::Sender<()> {
    let mut holder = stack.db().begin().await.expect("begin");
    sqlx::query("select 1 from agent.idempotency_keys where id = $1 for update")
        .bind(id)
        .execute(&mut *holder)
        .await
        .expect("lock the row");
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let _ = released.await;
        let _ = holder.commit().await;
    });
    release
}

/// Waits until a session of the stack's database waits on a lock, lets it
/// wait 200 ms more (a wait under 10 ms is not worth a second stamp: the
/// functions take it out of the lease), and answers the database clock then,
/// in seconds since the epoch.
async fn once_waiting_on_a_lock(stack: &idempotency_plane::local::LocalStack, what: &str) -> f64 {
    within(WAIT, what, async {
        while sqlx::query_scalar::<_, i64>(
            "select count(*) from pg_catalog.pg_stat_activity
              where datname = pg_catalog.current_database() and wait_event_type = 'Lock'",
        )
        .fetch_one(stack.db())
        .await
        .unwrap()
            == 0
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    sqlx::query_scalar("select extract(epoch from clock_timestamp())::float8").fetch_one(stack.db()).await.unwrap()
}

#[tokio::test]
async fn a_claim_that_waited_on_a_lock_clock_starts_its_lease_when_it_wins_the_row() {
    // Arrange: a dead worker's claim whose lease passed, its row locked by
    // another transaction.
    let stack = stack().await;
    let service = service(&stack);
    let org = org();
    let dead = claimed(service.claim(org, "tool.email.send", "k", &hash("x"), LEASE).await);
    pass_lease(&stack, dead.id()).await;
    let release = hold_row_lock(&stack, dead.id()).await;
    // Act: reclaim behind that lock; let the lock go a while after the
    // database shows the reclaim waiting on it, noting its clock just before.
    let claiming = {
        let service = service.clone();
        tokio::spawn(async move { service.claim(org, "tool.email.send", "k", &hash("x"), LEASE).await })
    };
    let released_at = once_waiting_on_a_lock(&stack, "the reclaim waits on the row lock").await;
    release.send(()).expect("release the lock");
    let claim = claimed(within(WAIT, "the reclaim", claiming).await.expect("task"));
    // Assert: the new lease starts after the lock was let go, by the
    // database clock, and runs its whole length from there.
    assert!(claim.reclaimed());
    let (claimed_at, lease_ms): (f64, f64) = sqlx::query_as(
        "select extract(epoch from claimed_at)::float8,
                extract(epoch from lease_expires_at - claimed_at)::float8 * 1000
           from agent.idempotency_keys where id = $1",
    )
    .bind(claim.id())
    .fetch_one(stack.db())
    .await
    .unwrap();
    assert!(claimed_at >= released_at, "the lease started {} s before the lock was let go", released_at - claimed_at);
    assert_eq!(lease_ms, LEASE.as_millis() as f64);
    let same = hash("x");
    let request = idempotency_plane::repo::ClaimRequest {
        organization_id: org,
        scope: "tool.email.send",
        key: "k",
        request_hash: same.as_str(),
        lease_token: uuid::Uuid::new_v4(),
        lease: LEASE,
        retain: LEASE,
    };
    assert_eq!(service.repository().reclaim(&request).await.unwrap(), None, "the new lease is live");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_first_claim_that_waited_on_another_insert_starts_its_lease_when_it_wins_and_keeps_the_whole_retention() {
    // Arrange: another transaction has inserted the same key and not committed.
    let stack = stack().await;
    let service = service(&stack);
    let org = org();
    let mut other = stack.db().begin().await.expect("begin");
    sqlx::query(
        "insert into agent.idempotency_keys
           (organization_id, scope, key, request_hash, status, lease_token, claimed_at, lease_expires_at, retain_until)
         values ($1, 'tool.email.send', 'k', repeat('0', 64), 'processing', gen_random_uuid(), now(), now(), now())",
    )
    .bind(org)
    .execute(&mut *other)
    .await
    .expect("the other insert");
    // Act: claim behind it; the other transaction rolls back a while after
    // the database shows the claim waiting.
    let claiming = {
        let service = service.clone();
        tokio::spawn(async move { service.claim(org, "tool.email.send", "k", &hash("x"), LEASE).await })
    };
    let rolled_back_at = once_waiting_on_a_lock(&stack, "the claim waits on the other insert").await;
    other.rollback().await.expect("roll back");
    let claim = claimed(within(WAIT, "the claim", claiming).await.expect("task"));
    // Assert: a first claim, its lease from when it won, and the scope's
    // whole retention counted from the lease's end.
    assert!(!claim.reclaimed());
    let (claimed_at, lease_ms, retain_ms): (f64, f64, f64) = sqlx::query_as(
        "select extract(epoch from claimed_at)::float8,
                extract(epoch from lease_expires_at - claimed_at)::float8 * 1000,
                extract(epoch from retain_until - lease_expires_at)::float8 * 1000
           from agent.idempotency_keys where id = $1",
    )
    .bind(claim.id())
    .fetch_one(stack.db())
    .await
    .unwrap();
    assert!(
        claimed_at >= rolled_back_at,
        "the lease started {} s before the key was free",
        rolled_back_at - claimed_at
    );
    assert_eq!(lease_ms, LEASE.as_millis() as f64);
    assert_eq!(retain_ms, 30.0 * 86_400_000.0, "tool.*: 30 days from the lease's end");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_call_behind_a_stuck_lock_gives_up_at_the_lock_timeout_with_a_typed_error_and_writes_nothing() {
    // Arrange: a claim whose row another transaction locks and keeps locked.
    let stack = stack().await;
    let service = service(&stack);
    let claim = claimed(service.claim(org(), "tool.email.send", "stuck", &hash("x"), LEASE).await);
    let release = hold_row_lock(&stack, claim.id()).await;
    let sent = service.repository().client().requests_sent();
    // Act
    let started = std::time::Instant::now();
    let stuck = service.complete(&claim, Completion::response(json!({"sent": true}))).await;
    let waited = started.elapsed();
    // Assert: the database's lock_timeout ended the wait (55P03, not the
    // client's own timeout), the client did not queue up behind the lock
    // again, and it is transient for the caller.
    match &stuck {
        Err(
            error @ Error::Store(idempotency_plane::ClientError::LockTimeout {
                function: "idempotency_complete", ..
            }),
        ) => {
            assert!(error.is_transient());
        }
        other => panic!("expected a lock timeout, got {other:?} after {waited:?}"),
    }
    assert_eq!(service.repository().client().requests_sent(), sent + 1, "not retried by the client");
    // Nothing was written: once the lock is gone the completion goes through.
    release.send(()).expect("release the lock");
    let ending = service.complete(&claim, Completion::response(json!({"sent": true}))).await.unwrap();
    assert_eq!(ending, Ending::Recorded);
    stack.stop().await.unwrap();
}
