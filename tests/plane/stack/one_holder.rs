//! One holder, always: every path that can take a key (a batch, a single
//! claim, a re-drive) and the one that keeps it (the heartbeat) raced
//! against each other through the real server, trying to make two workers
//! hold one key or two batches wait on each other in a cycle.
//!
//! Retries are off in every racer: a deadlock (40P01) or a lock timeout
//! must fail the test, not be retried out of sight.

use std::collections::HashMap;
use std::time::Duration;

use idempotency_plane::local::LocalStack;
use idempotency_plane::postgrest::RetryConfig;
use idempotency_plane::repo::{
    BatchClaims, ClaimCall, ClaimDecision, ClaimItem, ClaimManyCall, ClaimRow, IdempotencyRepository, OrphanedWork,
    RedriveCall,
};
use idempotency_plane::PostgrestRepository;
use serde_json::json;
use uuid::Uuid;

use crate::support::harness::*;

/// A repository on the stack that never retries.
fn unretried(stack: &LocalStack) -> PostgrestRepository {
    let config = stack.client_config().expect("a config").with_retry(RetryConfig::disabled());
    PostgrestRepository::new(idempotency_plane::PostgrestClient::new(config).expect("a client"))
}

fn holds(row: &ClaimRow) -> bool {
    matches!(row.outcome, ClaimDecision::Claimed | ClaimDecision::Reclaimed)
}

/// Moves the leases of `keys` of `org` into the past (their work, if any,
/// due for re-drive), as if their holder had died.
async fn orphan(stack: &LocalStack, org: Uuid, keys: &[String]) {
    sqlx::query(
        "update agent.idempotency_keys
            set lease_expires_at = now() - interval '1 second',
                claimed_at = now() - interval '2 seconds',
                redrive_at = case when redrive_at is not null then now() - interval '1 second' end
          where organization_id = $1 and key = any($2)",
    )
    .bind(org)
    .bind(keys)
    .execute(stack.db())
    .await
    .expect("orphan the keys");
}

/// A key repeated in a batch is decided once, even when the batch waits on
/// another transaction's row for longer than its lease: the later
/// occurrence answers from the first (processing), never takes over its
/// own batch's claim, and the lease the batch won is timed from the end of
/// the batch, live when the answer is made.
#[tokio::test]
async fn a_key_twice_in_a_batch_that_waited_past_its_lease_is_held_by_one_item() {
    let stack = stack().await;
    let repo = unretried(&stack);
    let org = Uuid::new_v4();
    let h = hash("twice").as_str().to_owned();
    // X: claimed by a worker that died (its lease passed).
    let x_token = Uuid::new_v4();
    let x = ClaimCall { request: None, ..claim_call(org, "x", &h, x_token) };
    assert_eq!(repo.claim(&x).await.expect("claim x").outcome, ClaimDecision::Claimed);
    orphan(&stack, org, &["x".to_owned()]).await;

    // Another session holds X's row for 2.5 s.
    let mut other = stack.db().begin().await.expect("a transaction");
    sqlx::query("select 1 from agent.idempotency_keys where organization_id = $1 and key = 'x' for update")
        .bind(org)
        .execute(&mut *other)
        .await
        .expect("lock x");
    let hold = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(2_500)).await;
        // Read before the lock is let go: the batch goes on after it.
        let releasing = chrono::Utc::now();
        other.rollback().await.expect("release x");
        releasing
    });

    let tokens = [Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4()];
    let items: Vec<ClaimItem<'_>> = ["k", "x", "k"]
        .iter()
        .zip(tokens)
        .map(|(key, lease_token)| ClaimItem { key, request_hash: &h, lease_token, request: None })
        .collect();
    let call = ClaimManyCall { organization_id: org, scope: "queue.two", lease: Duration::from_secs(1), items: &items };
    let rows = repo.claim_many(&call).await.expect("the batch");
    let released = hold.await.expect("the holder");

    let outcomes: Vec<ClaimDecision> = rows.iter().map(|row| row.outcome).collect();
    use ClaimDecision::*;
    assert_eq!(outcomes, [Claimed, Reclaimed, Processing], "{rows:#?}");
    assert_eq!(rows[0].lease_token, Some(tokens[0]));
    assert_eq!(rows[2].lease_token, None, "a later occurrence holds nothing");
    assert_eq!(rows[2].id, rows[0].id, "one claim for the key");
    let stored: Uuid =
        sqlx::query_scalar("select lease_token from agent.idempotency_keys where organization_id = $1 and key = 'k'")
            .bind(org)
            .fetch_one(stack.db())
            .await
            .expect("k's token");
    assert_eq!(stored, tokens[0], "the key is held by its first occurrence");
    for row in &rows[..2] {
        assert!(row.lease_live, "a lease the batch won is live when answered: {row:?}");
        assert_eq!(row.lease_expires_at - row.claimed_at, chrono::TimeDelta::seconds(1));
        assert!(row.claimed_at >= released, "timed from the batch's end: {row:?}");
    }
    stack.stop().await.unwrap();
}

fn claim_call<'a>(org: Uuid, key: &'a str, h: &'a str, lease_token: Uuid) -> ClaimCall<'a> {
    ClaimCall {
        organization_id: org,
        scope: "queue.two",
        key,
        request_hash: h,
        lease_token,
        lease: Duration::from_secs(1),
        request: None,
    }
}

/// Batches over the same keys in opposite orders, mixing every state a key
/// can be in (free, completed, held, orphaned with work) and items that
/// carry work with items that do not, raced round after round: no batch
/// ever fails (a deadlock would be 40P01), and each key is held by exactly
/// one item of all the batches when it could be taken, by none otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batches_in_opposite_orders_never_deadlock_and_never_share_a_key() {
    const ROUNDS: usize = 150;
    const KEYS: usize = 50;
    let stack = stack().await;
    let (a, b) = (unretried(&stack), unretried(&stack));
    let h = hash("opposite").as_str().to_owned();
    let work = json!({"job": 1});
    let keys: Vec<String> = (0..KEYS).map(|i| format!("k-{i:02}")).collect();
    for round in 0..ROUNDS {
        let org = Uuid::new_v4();
        // Before the race: a fifth of the keys completed, a fifth held live,
        // a fifth orphaned with their work; the rest are free.
        let before: Vec<ClaimItem<'_>> = keys
            .iter()
            .enumerate()
            .filter(|(i, _)| i % 5 != 0)
            .map(|(i, key)| ClaimItem {
                key,
                request_hash: &h,
                lease_token: Uuid::new_v4(),
                request: (i % 5 == 3).then_some(&work),
            })
            .collect();
        let call = ClaimManyCall { organization_id: org, scope: "queue.two", lease: LEASE, items: &before };
        let made = a.claim_many(&call).await.expect("the keys' states");
        let completions: Vec<_> = made
            .iter()
            .filter(|row| row.key.ends_with(['1', '6']))
            .map(|row| idempotency_plane::repo::CompletionItem {
                fence: idempotency_plane::repo::ClaimFence {
                    claim_id: row.id,
                    lease_token: row.lease_token.expect("held"),
                },
                completion: idempotency_plane::repo::CompletionArgs { response: Some(&work), ..Default::default() },
            })
            .collect();
        a.complete_many(org, &completions).await.expect("completed");
        let orphans: Vec<String> = keys.iter().filter(|key| key.ends_with(['3', '8'])).cloned().collect();
        orphan(&stack, org, &orphans).await;

        // The race: one batch in key order, the other in reverse, a few
        // items of each carrying work, each key of each batch once or twice.
        let racer = |repo: PostgrestRepository, reverse: bool| {
            let (keys, h, work) = (keys.clone(), h.clone(), work.clone());
            tokio::spawn(async move {
                let mut order: Vec<&String> = keys.iter().chain(keys.iter().step_by(7)).collect();
                if reverse {
                    order.reverse();
                }
                let items: Vec<ClaimItem<'_>> = order
                    .iter()
                    .enumerate()
                    .map(|(i, key)| ClaimItem {
                        key,
                        request_hash: &h,
                        lease_token: Uuid::new_v4(),
                        request: (i % 3 == usize::from(reverse)).then_some(&work),
                    })
                    .collect();
                let call = ClaimManyCall { organization_id: org, scope: "queue.two", lease: LEASE, items: &items };
                let rows = repo.claim_many(&call).await;
                rows.map(|rows| rows.into_iter().filter(holds).map(|row| row.key).collect::<Vec<_>>())
            })
        };
        let (first, second) = tokio::join!(racer(a.clone(), false), racer(b.clone(), true));
        let mut held: HashMap<String, usize> = HashMap::new();
        for answer in [first, second] {
            let answer = answer.expect("a racer");
            let won = answer.unwrap_or_else(|error| panic!("round {round}: a batch failed: {error}"));
            for key in won {
                *held.entry(key).or_default() += 1;
            }
        }
        for (i, key) in keys.iter().enumerate() {
            // Free (i % 5 == 0) and orphaned keys can be taken; the others not.
            let takeable = i % 5 == 0 || key.ends_with(['3', '8']);
            let count = held.get(key).copied().unwrap_or(0);
            assert_eq!(count, usize::from(takeable), "round {round}: key {key} held by {count} items");
        }
    }
    stack.stop().await.unwrap();
}

/// Who held each key, by the database's answers: a takeover (a batch's or a
/// single claim's, or a re-drive's) or the old holder's heartbeat. Orphans
/// whose lease passed are raced by a batch in key order, one in reverse,
/// single claims, a re-drive and their old holder's heartbeats: for every
/// key exactly one of them ends up holding it. A heartbeat that extended a
/// lease nobody had taken over keeps the key; one that lost the race is
/// told so.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_takeover_races_batches_heartbeats_and_a_redrive_and_one_holder_wins() {
    const ROUNDS: usize = 100;
    const KEYS: usize = 20;
    let stack = stack().await;
    let repos: Vec<PostgrestRepository> = (0..5).map(|_| unretried(&stack)).collect();
    let h = hash("takeover").as_str().to_owned();
    let work = json!({"job": 2});
    let keys: Vec<String> = (0..KEYS).map(|i| format!("t-{i:02}")).collect();
    for round in 0..ROUNDS {
        let org = Uuid::new_v4();
        // The old holder claimed every key with its work, then stalled.
        let items: Vec<ClaimItem<'_>> = keys
            .iter()
            .map(|key| ClaimItem { key, request_hash: &h, lease_token: Uuid::new_v4(), request: Some(&work) })
            .collect();
        let call = ClaimManyCall { organization_id: org, scope: "queue.two", lease: LEASE, items: &items };
        let old: Vec<ClaimRow> = repos[0].claim_many(&call).await.expect("the old holder's claims");
        orphan(&stack, org, &keys).await;

        let batch = |repo: PostgrestRepository, reverse: bool| {
            let (keys, h) = (keys.clone(), h.clone());
            tokio::spawn(async move {
                let mut order = keys.clone();
                if reverse {
                    order.reverse();
                }
                let items: Vec<ClaimItem<'_>> = order
                    .iter()
                    .map(|key| ClaimItem { key, request_hash: &h, lease_token: Uuid::new_v4(), request: None })
                    .collect();
                let call = ClaimManyCall { organization_id: org, scope: "queue.two", lease: LEASE, items: &items };
                let rows = repo.claim_many(&call).await.map_err(|error| format!("a batch: {error}"))?;
                Ok::<_, String>(rows.into_iter().filter(holds).map(|row| row.key).collect::<Vec<_>>())
            })
        };
        let singles = {
            let (repo, keys, h) = (repos[3].clone(), keys.clone(), h.clone());
            tokio::spawn(async move {
                let mut won = Vec::new();
                for key in keys.iter().rev().step_by(2) {
                    let call = ClaimCall { lease: LEASE, ..claim_call(org, key, &h, Uuid::new_v4()) };
                    let row = repo.claim(&call).await.map_err(|error| format!("a claim: {error}"))?;
                    if holds(&row) {
                        won.push(row.key);
                    }
                }
                Ok::<_, String>(won)
            })
        };
        let redrive = {
            let repo = repos[4].clone();
            tokio::spawn(async move {
                let call = RedriveCall {
                    scope: "queue.two",
                    lease_tokens: crate::support::lease_tokens(10),
                    lease: LEASE,
                    organization_id: Some(org),
                };
                let rows = repo.redrive(&call).await.map_err(|error| format!("a re-drive: {error}"))?;
                Ok::<_, String>(rows.into_iter().filter(|row| row.lease_token.is_some()).map(|row| row.key).collect())
            })
        };
        let heartbeats = {
            let (repo, old) = (repos[0].clone(), old.clone());
            tokio::spawn(async move {
                let mut kept = Vec::new();
                for row in old.iter().step_by(3) {
                    let token = row.lease_token.expect("held");
                    let extended = repo.extend(org, row.id, token, LEASE).await;
                    if extended.map_err(|error| format!("a heartbeat: {error}"))?.is_some() {
                        kept.push(row.key.clone());
                    }
                }
                Ok::<_, String>(kept)
            })
        };
        let (forward, backward, singles, redrive, heartbeats) =
            tokio::join!(batch(repos[1].clone(), false), batch(repos[2].clone(), true), singles, redrive, heartbeats);
        let mut holders: HashMap<String, Vec<&str>> = HashMap::new();
        for (who, answer) in [
            ("batch", forward),
            ("reverse batch", backward),
            ("single claim", singles),
            ("re-drive", redrive),
            ("heartbeat", heartbeats),
        ] {
            let won = answer.expect("a racer").unwrap_or_else(|error| panic!("round {round}: {error}"));
            for key in won {
                holders.entry(key).or_default().push(who);
            }
        }
        for key in &keys {
            let who = holders.get(key).cloned().unwrap_or_default();
            assert_eq!(who.len(), 1, "round {round}: key {key} held by {who:?}");
        }
        let tokens: i64 = sqlx::query_scalar(
            "select count(distinct lease_token) from agent.idempotency_keys where organization_id = $1",
        )
        .bind(org)
        .fetch_one(stack.db())
        .await
        .expect("tokens");
        assert_eq!(tokens, KEYS as i64, "round {round}: one token per key");
    }
    stack.stop().await.unwrap();
}
