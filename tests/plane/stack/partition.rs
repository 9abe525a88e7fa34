//! A worker cut off from its plane by a partition (a TCP forwarder that
//! stops forwarding and closes nothing, so every request hangs) while its
//! effect runs under heartbeats, and a second worker that reaches the plane
//! directly and takes the key over once the first one's lease has passed.
//! The first effect must be told to stop before the second starts, its
//! claim must be left to its lease (nothing journaled as its holder's), and
//! the answer the key keeps is the second worker's.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_plane::callers::tool::{ToolError, ToolKey, ToolResult, ToolRun};
use idempotency_plane::local::LocalStack;
use idempotency_plane::postgrest::{ClientConfig, RetryConfig};
use idempotency_plane::service::{
    effect_stop, Answer, Begun, Cut, Effect, EffectDriver, IdempotencyService, ReadOutcome, Settle, Timing,
};
use idempotency_plane::{PostgrestClient, PostgrestRepository};
use serde_json::json;
use tokio::time::Instant;
use uuid::Uuid;

use crate::callers::tool::{allow, spec, HORIZON};
use crate::support::harness::*;
use crate::support::tcp_forward::TcpForward;

/// The plane behind a forwarder the test can partition.
struct Partitionable {
    forward: TcpForward,
    url: String,
}

impl Partitionable {
    async fn start(stack: &LocalStack) -> Self {
        let port = url::Url::parse(stack.url()).expect("the stack's URL").port().expect("a port");
        let forward = TcpForward::start(port).await;
        let url = format!("http://127.0.0.1:{}", forward.port());
        Partitionable { forward, url }
    }

    /// A repository that reaches the plane through the forwarder: its
    /// requests hang once it stalls (a 10 s request timeout, no retries).
    fn repository(&self, stack: &LocalStack) -> PostgrestRepository {
        let config = ClientConfig::new(&self.url, stack.service_key().to_owned())
            .expect("a config")
            .with_request_timeout(Duration::from_secs(10))
            .with_retry(RetryConfig::disabled());
        PostgrestRepository::new(PostgrestClient::new(config).expect("a client"))
    }
}

/// Effect 30 s, journal 4 s, margin 1 s, kept alive by heartbeats on a 3 s
/// lease: a worker that stops is recovered 3 s after its last beat.
fn beating() -> Timing {
    Timing::new(Duration::from_secs(30), Duration::from_secs(4), Duration::from_secs(1))
        .and_then(|timing| timing.with_heartbeats(Duration::from_secs(3)))
        .expect("a timing")
}

/// What the first worker's effect saw: when it was told to stop, and
/// when its future was dropped.
#[derive(Default)]
struct Seen {
    stopped: Option<Instant>,
    dropped: Option<Instant>,
}

/// Records when the future holding it is dropped.
struct DropClock(Arc<Mutex<Seen>>);

impl Drop for DropClock {
    fn drop(&mut self) {
        self.0.lock().unwrap().dropped = Some(Instant::now());
    }
}

/// The first worker's effect: waits for its stop, notes when it came, and
/// then ignores it (as an effect deep in a vendor call would), so only the
/// drop at the lease's confirmed end ends it.
async fn stubborn_effect(seen: Arc<Mutex<Seen>>) {
    let _clock = DropClock(seen.clone());
    let stop = effect_stop().expect("an effect under a held claim has a stop");
    stop.cancelled().await;
    seen.lock().unwrap().stopped = Some(Instant::now());
    std::future::pending::<()>().await;
}

/// The second worker: claims the key directly, every 100 ms, until it holds
/// it; answers when it held it.
async fn take_over(stack: &LocalStack, effect: &Effect<'_>) -> (Instant, EffectDriver<PostgrestRepository>) {
    let driver = EffectDriver::new(IdempotencyService::new(PostgrestRepository::new(client(stack))));
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match driver.begin(effect).await.expect("the second worker's claim") {
            Begun::Held(held) => {
                let started = Instant::now();
                assert!(held.claim().reclaimed(), "taken over, not claimed afresh");
                let ran = held.run(async { "the second worker's effect" }).await.expect("ran");
                let settled = held.settle(Settle::Journal(Answer::success(json!(ran)))).await;
                assert_eq!(settled.as_str(), "journaled");
                return (started, driver);
            }
            Begun::InFlight { .. } => {}
            other => panic!("the second worker met {other:?}"),
        }
        assert!(Instant::now() < deadline, "the second worker never took the key over");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_effect_cut_off_from_its_plane_is_told_to_stop_before_another_worker_takes_its_key() {
    let stack = stack().await;
    let plane = Partitionable::start(&stack).await;
    let first = EffectDriver::new(IdempotencyService::new(plane.repository(&stack)));
    let (org, h) = (org(), hash("partitioned"));
    let effect = Effect {
        organization_id: org,
        scope: "webhook.partition",
        key: "evt-1",
        request_hash: &h,
        timing: beating(),
        request: None,
    };
    let Begun::Held(held) = first.begin(&effect).await.expect("the first claim") else { panic!("claimed") };

    let seen = Arc::new(Mutex::new(Seen::default()));
    let partition = async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        plane.forward.stall();
        take_over(&stack, &effect).await
    };
    let (ran, (second_started, _)) = tokio::join!(held.run(stubborn_effect(seen.clone())), partition);

    assert_eq!(ran, Err(Cut::LeaseUnconfirmed));
    let (stopped, dropped) = {
        let seen = seen.lock().unwrap();
        (seen.stopped.expect("the first effect was told to stop"), seen.dropped.expect("the first effect was dropped"))
    };
    assert!(stopped < second_started, "told to stop {:?} before the second started", second_started - stopped);
    assert!(dropped >= stopped, "dropped after it was told to stop");
    // The first worker's ending: nothing written as its holder's.
    assert_eq!(held.settle(Settle::Unknown("the lease could not be confirmed")).await.as_str(), "left_to_lease");
    let kept = service(&stack).read(org, "webhook.partition", "evt-1", &h).await.expect("read");
    let ReadOutcome::Completed { response: Some(response), .. } = &kept else { panic!("completed: {kept:?}") };
    assert_eq!(response["output"], json!("the second worker's effect"), "the key keeps the second worker's answer");
    stack.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tool_cut_off_from_its_plane_is_told_to_stop_and_left_to_its_lease() {
    let stack = stack().await;
    let plane = Partitionable::start(&stack).await;
    let guard =
        idempotency_plane::callers::tool::ToolGuard::new(IdempotencyService::new(plane.repository(&stack)), HORIZON)
            .with_heartbeats(Duration::from_secs(3))
            .expect("a guard with heartbeats");
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "send"), json!({"to": "a@example.com"}));
    let seen = Arc::new(Mutex::new(Seen::default()));
    let tool = |call: idempotency_plane::callers::tool::ToolCall| {
        let seen = seen.clone();
        async move {
            let _clock = DropClock(seen.clone());
            call.stop().cancelled().await;
            seen.lock().unwrap().stopped = Some(Instant::now());
            std::future::pending::<ToolResult>().await
        }
    };
    let second = async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        plane.forward.stall();
        let guard = idempotency_plane::callers::tool::ToolGuard::new(service(&stack), HORIZON);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let started = Arc::new(Mutex::new(None));
            let run = guard
                .run(org, &spec(), &key, &args, allow, |_| {
                    let started = started.clone();
                    async move {
                        *started.lock().unwrap() = Some(Instant::now());
                        ToolResult::success(json!({"sent_by": "second"}))
                    }
                })
                .await;
            match run {
                Ok(ToolRun::Executed(result)) => {
                    assert_eq!(result.output, json!({"sent_by": "second"}));
                    return started.lock().unwrap().expect("the second tool ran");
                }
                Err(ToolError::ClaimInFlight { .. }) => {}
                other => panic!("the second worker met {other:?}"),
            }
            assert!(Instant::now() < deadline, "the second worker never took the call over");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let spec = spec();
    let (first, second_started) = tokio::join!(guard.run(org, &spec, &key, &args, allow, tool), second);

    assert!(matches!(first, Err(ToolError::LeaseUnconfirmed { .. })), "{first:?}");
    assert!(first.as_ref().is_err_and(ToolError::is_retryable));
    let (stopped, dropped) = {
        let seen = seen.lock().unwrap();
        (seen.stopped.expect("the first tool was told to stop"), seen.dropped)
    };
    assert!(dropped.is_some(), "the first tool was dropped");
    assert!(stopped < second_started, "told to stop {:?} before the second started", second_started - stopped);
    stack.stop().await.unwrap();
}

/// Four partitions of fifty workers each: in every round fifty workers,
/// each holding a key of its own under heartbeats, are cut off together
/// while fifty others reach the plane directly and take each key over as
/// soon as the plane lets them. Over the two hundred races every first
/// effect is told to stop before the effect that replaces it starts, none
/// is journaled, and every key keeps its second worker's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_effects_cut_off_in_four_partitions_each_stop_before_their_key_is_taken_over() {
    const ROUNDS: usize = 4;
    const KEYS: usize = 50;
    let stack = stack().await;
    let h = hash("fifty");
    let service = service(&stack);
    for round in 0..ROUNDS {
        let org = org();
        let plane = Partitionable::start(&stack).await;
        let first = EffectDriver::new(IdempotencyService::new(plane.repository(&stack)));
        let keys: Vec<String> = (0..KEYS).map(|i| format!("evt-{i:02}")).collect();
        let effect = |key: &'static str| Effect {
            organization_id: org,
            scope: "webhook.partition",
            key,
            request_hash: &h,
            timing: beating(),
            request: None,
        };
        let keys: &'static [String] = Box::leak(keys.into_boxed_slice());
        let mut held = Vec::new();
        for key in keys {
            let Begun::Held(one) = first.begin(&effect(key)).await.expect("a first claim") else { panic!("claimed") };
            held.push(one);
        }
        let seen: Vec<Arc<Mutex<Seen>>> = (0..KEYS).map(|_| Arc::new(Mutex::new(Seen::default()))).collect();
        let runs = futures_util::future::join_all(
            held.iter().zip(&seen).map(|(one, seen)| one.run(stubborn_effect(seen.clone()))),
        );
        let takeovers = async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            plane.forward.stall();
            futures_util::future::join_all(keys.iter().map(|key| {
                let stack = &stack;
                let effect = effect(key);
                async move { take_over(stack, &effect).await.0 }
            }))
            .await
        };
        let (ran, started) = tokio::join!(runs, takeovers);
        for (i, ran) in ran.into_iter().enumerate() {
            assert_eq!(ran, Err(Cut::LeaseUnconfirmed), "round {round}, key {i}");
            let stopped = seen[i].lock().unwrap().stopped.expect("told to stop");
            assert!(
                stopped < started[i],
                "round {round}, key {i}: told to stop {:?} after its takeover started",
                stopped - started[i]
            );
        }
        for one in held {
            assert_eq!(one.settle(Settle::Unknown("the lease could not be confirmed")).await.as_str(), "left_to_lease");
        }
        for key in keys {
            let kept = service.read(org, "webhook.partition", key, &h).await.expect("read");
            let ReadOutcome::Completed { response: Some(response), .. } = &kept else {
                panic!("round {round}, {key}: {kept:?}")
            };
            assert_eq!(response["output"], json!("the second worker's effect"), "round {round}, {key}");
        }
    }
    stack.stop().await.unwrap();
}
