//! Work that outlives its worker, raced through the real server: concurrent
//! re-drivers split the orphans, a heartbeat keeps a claim from every rival,
//! and a slow holder that wakes up is fenced off.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use idempotency_plane::repo::{ClaimCall, ClaimDecision, CompletionArgs, OrphanedWork, RedriveCall};
use idempotency_plane::service::{Answer, Begun, Cut, Effect, EffectDriver, IdempotencyService, Settle, Timing};
use idempotency_plane::{IdempotencyRepository, PostgrestRepository};
use serde_json::json;
use uuid::Uuid;

use crate::support::harness::*;
use crate::support::{hash, org};

const SCOPE: &str = "webhook.stripe";

fn repository(stack: &idempotency_plane::local::LocalStack) -> Arc<PostgrestRepository> {
    Arc::new(PostgrestRepository::new(client(stack)))
}

/// `n` claims of `org` carrying work whose worker is gone: processing, lease
/// and re-drive time passed, as many claims would be after a crash.
async fn orphans(stack: &idempotency_plane::local::LocalStack, org: Uuid, n: i64) {
    sqlx::query(
        "insert into agent.idempotency_keys
           (organization_id, scope, key, request_hash, status, lease_token, claimed_at, lease_expires_at,
            retain_until, request, redrive_at)
         select $1, $2, 'evt-' || i, repeat('a', 64), 'processing', gen_random_uuid(),
                now() - interval '1 minute', now() - interval '1 second', now() + interval '1 day',
                jsonb_build_object('event', i), now() - interval '1 second'
           from generate_series(1, $3) as i",
    )
    .bind(org)
    .bind(SCOPE)
    .bind(n)
    .execute(stack.db())
    .await
    .expect("orphans");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_concurrent_redrivers_hand_each_of_a_thousand_orphans_to_exactly_one_of_them() {
    let stack = stack().await;
    let org = org();
    orphans(&stack, org, 1000).await;
    // Four re-drivers as four workers would be: each with a client of its
    // own, starting together.
    let start = Arc::new(tokio::sync::Barrier::new(4));
    let drivers: Vec<_> = (0..4)
        .map(|_| {
            let (repo, start) = (repository(&stack), start.clone());
            tokio::spawn(async move {
                start.wait().await;
                let mut mine = Vec::new();
                loop {
                    let call = RedriveCall {
                        scope: "webhook.*",
                        lease_tokens: crate::support::lease_tokens(10),
                        lease: Duration::from_secs(300),
                        organization_id: Some(org),
                    };
                    let taken = repo.redrive(&call).await.expect("a re-drive");
                    if taken.is_empty() {
                        return mine;
                    }
                    mine.extend(taken);
                }
            })
        })
        .collect();
    let mut handed = Vec::new();
    let mut per_driver = Vec::new();
    for driver in drivers {
        let mine = driver.await.expect("a re-driver");
        per_driver.push(mine.len());
        handed.extend(mine);
    }

    let ids: HashSet<Uuid> = handed.iter().map(|work| work.id).collect();
    println!("re-drivers took {per_driver:?} of 1000 orphans");
    assert_eq!((handed.len(), ids.len()), (1000, 1000), "each orphan handed out once: {per_driver:?}");
    assert!(handed.iter().all(|work| work.attempt == 2 && work.lease_token.is_some() && work.request.is_some()));
    let (taken_once,): (i64,) = sqlx::query_as(
        "select count(*) from agent.idempotency_keys where organization_id = $1 and reclaims = 1 and redrive_at > now()",
    )
    .bind(org)
    .fetch_one(stack.db())
    .await
    .unwrap();
    assert_eq!(taken_once, 1000, "every orphan was taken over exactly once");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_claim_kept_alive_by_heartbeats_for_three_leases_is_never_taken_and_is_re_driven_once_they_stop() {
    let stack = stack().await;
    let (org, repo) = (org(), repository(&stack));
    // A 2 s lease and a heartbeat every 400 ms: a beat may be late by 1.6 s
    // on a loaded machine before a rival could take the claim.
    let (h, token, lease) = (hash("heartbeats"), Uuid::new_v4(), Duration::from_secs(2));
    let work = json!({"render": "video-1"});
    let call = ClaimCall {
        organization_id: org,
        scope: SCOPE,
        key: "evt-long",
        request_hash: h.as_str(),
        lease_token: token,
        lease,
        request: Some(&work),
    };
    let claimed = repo.claim(&call).await.unwrap();
    assert_eq!(claimed.outcome, ClaimDecision::Claimed);

    // Three leases long: a heartbeat every 400 ms, while a rival claims the
    // key and a re-driver asks for orphans, every 50 ms each.
    let started = tokio::time::Instant::now();
    let rivals = {
        let (repo, h) = (repo.clone(), h.clone());
        tokio::spawn(async move {
            let (mut claims, mut redriven) = (Vec::new(), 0);
            while started.elapsed() < 3 * lease {
                let rival = ClaimCall {
                    organization_id: org,
                    scope: SCOPE,
                    key: "evt-long",
                    request_hash: h.as_str(),
                    lease_token: Uuid::new_v4(),
                    lease,
                    request: None,
                };
                claims.push(repo.claim(&rival).await.expect("a rival's claim").outcome);
                let call = RedriveCall {
                    scope: SCOPE,
                    lease_tokens: crate::support::lease_tokens(10),
                    lease,
                    organization_id: Some(org),
                };
                redriven += repo.redrive(&call).await.expect("a re-drive").len();
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            (claims, redriven)
        })
    };
    let mut beats = 0;
    while started.elapsed() < 3 * lease {
        tokio::time::sleep(Duration::from_millis(400)).await;
        repo.extend(org, claimed.id, token, lease).await.unwrap().expect("still ours");
        beats += 1;
    }
    let (claims, redriven) = rivals.await.expect("the rivals");
    println!("{beats} heartbeats; the rivals claimed {} times and re-drove {redriven}", claims.len());
    assert!(claims.len() >= 10, "the rivals kept trying: {}", claims.len());
    assert!(claims.iter().all(|outcome| *outcome == ClaimDecision::Processing), "{claims:?}");
    assert_eq!(redriven, 0, "a claim kept alive is no orphan");

    // The heartbeats stop, as when the worker is killed: once the lease
    // passes the work is re-driven, and the old holder is fenced off.
    let call = RedriveCall {
        scope: SCOPE,
        lease_tokens: crate::support::lease_tokens(10),
        lease: Duration::from_secs(60),
        organization_id: Some(org),
    };
    let taken = loop {
        let taken = repo.redrive(&call).await.unwrap();
        if !taken.is_empty() || started.elapsed() > 10 * lease {
            break taken;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        taken.iter().map(|w| (w.id, w.attempt, w.request.clone())).collect::<Vec<_>>(),
        [(claimed.id, 2, Some(work))]
    );
    assert_eq!(repo.extend(org, claimed.id, token, lease).await.unwrap(), None, "the old holder must stop");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_slow_holder_racing_a_redrive_at_its_lease_end_either_completes_or_is_fenced_never_both() {
    let stack = stack().await;
    let (org, repo) = (org(), repository(&stack));
    let answer = json!({"ok": true});
    let (mut completed, mut redriven) = (0, 0);
    for round in 0..40 {
        let key = format!("evt-race-{round}");
        let (h, token) = (hash(&key), Uuid::new_v4());
        let work = json!({"round": round});
        let call = ClaimCall {
            organization_id: org,
            scope: SCOPE,
            key: &key,
            request_hash: h.as_str(),
            lease_token: token,
            lease: Duration::from_secs(60),
            request: Some(&work),
        };
        let claimed = repo.claim(&call).await.unwrap();
        pass_lease(&stack, claimed.id).await;

        let redrive = RedriveCall {
            scope: SCOPE,
            lease_tokens: crate::support::lease_tokens(10),
            lease: Duration::from_secs(60),
            organization_id: Some(org),
        };
        let args = CompletionArgs { response: Some(&answer), ..CompletionArgs::default() };
        let (done, taken) = tokio::join!(repo.complete(org, claimed.id, token, args), repo.redrive(&redrive));
        let (done, taken) = (done.unwrap().is_some(), taken.unwrap());
        match (done, taken.as_slice()) {
            (true, []) => completed += 1,
            (false, [work]) if work.id == claimed.id => {
                redriven += 1;
                let fresh = work.lease_token.expect("the new holder's token");
                repo.complete(org, claimed.id, fresh, args).await.unwrap().expect("the new holder completes");
            }
            other => panic!("round {round}: the completion and the re-drive both won, or neither: {other:?}"),
        }
    }
    println!("the slow holder completed {completed} times; the re-drive took over {redriven} times");
    assert_eq!(completed + redriven, 40);
    stack.stop().await.unwrap();
}

/// The effect driver with heartbeats: a claim for a 3 s lease whose effect
/// runs 9 s (three leases) and whose deadlines allow 20.
fn beating() -> (Timing, Timing) {
    let whole = Timing::new(Duration::from_secs(15), Duration::from_secs(4), Duration::from_secs(1)).unwrap();
    (whole.with_heartbeats(Duration::from_secs(3)).unwrap(), whole)
}

#[tokio::test]
async fn an_effect_running_three_leases_under_heartbeats_is_never_taken_and_journals_its_answer() {
    let stack = stack().await;
    let (org, (timing, _)) = (org(), beating());
    assert_eq!(timing.lease(), Duration::from_secs(3), "a dead worker's claim is free after 3 s");
    let driver = EffectDriver::new(IdempotencyService::new(PostgrestRepository::new(client(&stack))));
    let h = hash("long effect");
    let effect =
        Effect { organization_id: org, scope: SCOPE, key: "evt-long", request_hash: &h, timing, request: None };
    let Begun::Held(held) = driver.begin(&effect).await.unwrap() else { panic!("claimed") };

    let rival = async {
        let rival = EffectDriver::new(IdempotencyService::new(PostgrestRepository::new(client(&stack))));
        let mut answers = Vec::new();
        let started = tokio::time::Instant::now();
        while started.elapsed() < Duration::from_secs(9) {
            answers.push(matches!(rival.begin(&effect).await.unwrap(), Begun::InFlight { .. }));
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        answers
    };
    let (ran, rivals) = tokio::join!(held.run(tokio::time::sleep(Duration::from_secs(9))), rival);
    assert_eq!(ran, Ok(()), "the effect ran to its end");
    assert!(rivals.len() >= 20 && rivals.iter().all(|in_flight| *in_flight), "{rivals:?}");
    let settled = held.settle(Settle::Journal(Answer::success(json!({"rendered": true})))).await;
    assert!(settled.is_journaled(), "{settled:?}");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn without_heartbeats_a_short_lease_is_taken_mid_effect_and_the_late_completion_is_fenced() {
    let stack = stack().await;
    let (org, repo) = (org(), repository(&stack));
    let (h, token) = (hash("no heartbeat"), Uuid::new_v4());
    let call = ClaimCall {
        organization_id: org,
        scope: SCOPE,
        key: "evt-no-beat",
        request_hash: h.as_str(),
        lease_token: token,
        lease: Duration::from_secs(3),
        request: None,
    };
    let first = repo.claim(&call).await.unwrap();
    // The same effect, three leases long, with no heartbeat: a rival takes
    // the claim once the lease passes, and runs the effect a second time.
    tokio::time::sleep(Duration::from_millis(3_300)).await;
    let second = repo.claim(&ClaimCall { lease_token: Uuid::new_v4(), ..call }).await.unwrap();
    assert_eq!(second.outcome, ClaimDecision::Reclaimed);
    let answer = json!({"rendered": true});
    let args = CompletionArgs { response: Some(&answer), ..CompletionArgs::default() };
    assert!(repo.complete(org, first.id, token, args).await.unwrap().is_none(), "the late completion is fenced");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_heartbeat_that_finds_the_claim_taken_over_stops_the_effect() {
    let stack = stack().await;
    let (org, (timing, _)) = (org(), beating());
    let driver = EffectDriver::new(IdempotencyService::new(PostgrestRepository::new(client(&stack))));
    let h = hash("taken over");
    let effect =
        Effect { organization_id: org, scope: SCOPE, key: "evt-taken", request_hash: &h, timing, request: None };
    let Begun::Held(held) = driver.begin(&effect).await.unwrap() else { panic!("claimed") };
    let claim_id = held.claim().id();

    // While the effect runs, its lease is made to pass and another worker
    // takes the claim over (as after a stall longer than the lease).
    let finished = std::sync::atomic::AtomicBool::new(false);
    let effect_body = async {
        tokio::time::sleep(Duration::from_secs(12)).await;
        finished.store(true, std::sync::atomic::Ordering::SeqCst);
    };
    let take_over = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        pass_lease(&stack, claim_id).await;
        let taker = EffectDriver::new(IdempotencyService::new(PostgrestRepository::new(client(&stack))));
        matches!(taker.begin(&effect).await.unwrap(), Begun::Held(_))
    };
    let started = tokio::time::Instant::now();
    let (ran, taken) = tokio::join!(held.run(effect_body), take_over);
    assert!(taken, "the other worker took the claim");
    assert_eq!(ran, Err(Cut::FenceLost));
    assert!(started.elapsed() < Duration::from_secs(3), "stopped at the next beat: {:?}", started.elapsed());
    assert!(!finished.load(std::sync::atomic::Ordering::SeqCst), "the effect was stopped where it stood");
    assert!(held.fence_lost());
    assert_eq!(held.settle(Settle::Journal(Answer::success(json!(1)))).await.as_str(), "lease_moved_on");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_claim_taken_over_while_its_holder_waited_between_runs_never_starts_the_next_run() {
    let stack = stack().await;
    let (org, (timing, _)) = (org(), beating());
    let driver = EffectDriver::new(IdempotencyService::new(PostgrestRepository::new(client(&stack))));
    let h = hash("idle between runs");
    let effect =
        Effect { organization_id: org, scope: SCOPE, key: "evt-idle", request_hash: &h, timing, request: None };
    let Begun::Held(held) = driver.begin(&effect).await.unwrap() else { panic!("claimed") };

    // A first run fails fast, as a retryable failure would; the holder then
    // waits before trying again, and nothing beats meanwhile. The lease
    // passes and another worker takes the claim over.
    assert_eq!(held.run(async {}).await, Ok(()));
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    pass_lease(&stack, held.claim().id()).await;
    let taker = EffectDriver::new(IdempotencyService::new(PostgrestRepository::new(client(&stack))));
    assert!(matches!(taker.begin(&effect).await.unwrap(), Begun::Held(_)), "the other worker took the claim");

    let started = std::sync::atomic::AtomicBool::new(false);
    let ran = held.run(async { started.store(true, std::sync::atomic::Ordering::SeqCst) }).await;
    assert_eq!(ran, Err(Cut::FenceLost));
    assert!(!started.load(std::sync::atomic::Ordering::SeqCst), "the second run never started its effect");
    assert!(held.fence_lost());
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_holder_that_waited_between_runs_confirms_its_lease_and_runs_again() {
    let stack = stack().await;
    let (org, (timing, _)) = (org(), beating());
    let driver = EffectDriver::new(IdempotencyService::new(PostgrestRepository::new(client(&stack))));
    let h = hash("idle, still ours");
    let effect =
        Effect { organization_id: org, scope: SCOPE, key: "evt-idle-ours", request_hash: &h, timing, request: None };
    let Begun::Held(held) = driver.begin(&effect).await.unwrap() else { panic!("claimed") };
    assert_eq!(held.run(async {}).await, Ok(()));
    // More than a lease of idling: the claim lapses, but nobody took it
    // over, so the confirming beat finds it still ours (the fence has not
    // moved).
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    assert_eq!(held.run(async { 7 }).await, Ok(7));
    assert!(!held.fence_lost());
    assert!(held.settle(Settle::Journal(Answer::success(json!(7)))).await.is_journaled());
    stack.stop().await.unwrap();
}
