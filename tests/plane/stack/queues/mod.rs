//! The Rust queue consumer against real pgmq (installed from the pgmq
//! crate by the local stack) and the real plane, on both of its paths (the
//! plane's own queue functions, and Supabase's `pgmq_public` for a plane
//! without them): a message's effect happens once per idempotency key
//! however often it is sent or delivered; a message is archived only once
//! its answer is journaled; failures for good, conflicts and messages read
//! too often go to the dead-letter queue with their failure journaled;
//! concurrent consumers split a queue and run each effect once.
//! `in_plane` holds what only the plane's functions do.

mod in_plane;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_plane::callers::queue::{ConsumerOptions, Drained, QueueConsumer, QueuePath, Queues};
use idempotency_plane::local::{LocalStack, LocalStackConfig};
use idempotency_plane::service::{Answer, EffectDriver, Settle, Timing};
use idempotency_plane::{PostgrestRepository, ReadOutcome, RequestHash};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::support::harness::*;
use crate::support::proxy::RpcProxy;

/// The queue and its dead-letter queue (their tables, `pgmq.q_rust_queue`,
/// `pgmq.a_rust_queue` and `pgmq.q_rust_queue_dlq`, are read below).
const QUEUE: &str = "rust_queue";
const DLQ: &str = "rust_queue_dlq";

/// Effect 1 s, journal 1.5 s, margin 1 s: a lease of 3.5 s, so a message
/// read is hidden for 5 s.
fn timing() -> Timing {
    Timing::new(Duration::from_millis(1000), Duration::from_millis(1500), Duration::from_millis(1000))
        .expect("a valid timing")
}

struct Fixture {
    stack: LocalStack,
    queues: Queues,
    org: Uuid,
    /// Effects applied, by vendor key.
    effects: Arc<Mutex<HashMap<String, u32>>>,
    /// Which functions the consumers drain through.
    path: QueuePath,
}

async fn fixture(path: QueuePath) -> Fixture {
    let stack = stack_with(LocalStackConfig::default().with_queues([QUEUE, DLQ])).await;
    let queues = Queues::new(stack.client_config().expect("a config")).expect("queues");
    Fixture { stack, queues, org: Uuid::new_v4(), effects: Arc::default(), path }
}

impl Fixture {
    fn consumer(&self, max_reads: i32) -> QueueConsumer<PostgrestRepository> {
        self.consumer_of(max_reads, Queues::new(self.stack.client_config().expect("a config")).expect("queues"))
    }

    /// A consumer that reaches the queues through `queues`.
    fn consumer_of(&self, max_reads: i32, queues: Queues) -> QueueConsumer<PostgrestRepository> {
        let driver = EffectDriver::new(service(&self.stack));
        let mut options = ConsumerOptions::new(QUEUE, DLQ, self.org, timing());
        options.max_reads = max_reads;
        options.batch_size = 20;
        options.path = self.path;
        QueueConsumer::new(driver, queues, options).expect("a consumer")
    }

    /// Drains one batch; each payload's `status` says how its effect ends.
    async fn drain(&self, consumer: &QueueConsumer<PostgrestRepository>) -> Drained {
        let effects = self.effects.clone();
        consumer
            .drain(move |payload: Value, context| {
                let effects = effects.clone();
                async move {
                    match payload.get("status").and_then(Value::as_u64).unwrap_or(200) {
                        200 => {
                            *effects.lock().expect("effects").entry(context.vendor_key).or_default() += 1;
                            Settle::Journal(Answer::success(json!({"done": true})))
                        }
                        422 => Settle::Journal(Answer::failure("process_failed", json!({"status": 422}))),
                        _ => Settle::Unknown("the downstream answered 503"),
                    }
                }
            })
            .await
            .expect("a drain")
    }

    async fn send(&self, message: Value) {
        self.queues.send(QUEUE, &message).await.expect("a send");
    }

    async fn dead_letters(&self) -> Vec<Value> {
        sqlx::query_scalar::<_, Value>("select message from pgmq.q_rust_queue_dlq order by msg_id")
            .fetch_all(self.stack.db())
            .await
            .expect("the dead-letter queue")
    }

    async fn archived(&self) -> i64 {
        sqlx::query_scalar::<_, i64>("select count(*) from pgmq.a_rust_queue")
            .fetch_one(self.stack.db())
            .await
            .expect("the archive")
    }

    fn applied(&self) -> u32 {
        self.effects.lock().expect("effects").values().sum()
    }
}

#[tokio::test]
async fn through_pgmq_public_a_message_sent_twice_and_delivered_again_has_its_effect_once() {
    let f = fixture(QueuePath::DataApi).await;
    let consumer = f.consumer(5);
    f.send(json!({"idempotency_key": "order-1", "payload": {"sku": 7}})).await;
    f.send(json!({"idempotency_key": "order-1", "payload": {"sku": 7}})).await;
    f.send(json!({"payload": {"sku": 8}})).await;

    let first = f.drain(&consumer).await;
    assert_eq!(
        (first.read, first.ran, first.archived, first.left, first.dead_lettered),
        (3, 2, 2, 1, 0),
        "the duplicate in the same batch finds the first holding its key: left"
    );
    tokio::time::sleep(Duration::from_secs(6)).await;
    let second = f.drain(&consumer).await;
    assert_eq!((second.read, second.replayed, second.archived, second.ran), (1, 1, 1, 0));
    assert_eq!(f.applied(), 2, "one effect per key");
    assert_eq!(f.archived().await, 3, "every message archived");
    assert_eq!(f.drain(&consumer).await.read, 0);
    f.stack.stop().await.unwrap();
}

#[tokio::test]
async fn in_the_plane_failures_conflicts_and_malformed_messages_go_to_the_dead_letter_queue() {
    failures_conflicts_and_malformed_messages_go_to_the_dead_letter_queue(QueuePath::Plane).await;
}

#[tokio::test]
async fn through_pgmq_public_failures_conflicts_and_malformed_messages_go_to_the_dead_letter_queue() {
    failures_conflicts_and_malformed_messages_go_to_the_dead_letter_queue(QueuePath::DataApi).await;
}

async fn failures_conflicts_and_malformed_messages_go_to_the_dead_letter_queue(path: QueuePath) {
    let f = fixture(path).await;
    let consumer = f.consumer(5);
    f.send(json!({"idempotency_key": "refund-1", "payload": {"status": 422}})).await;
    f.send(json!("not an object")).await;
    f.send(json!({"idempotency_key": 42, "payload": {}})).await;
    let drained = f.drain(&consumer).await;
    assert_eq!((drained.ran, drained.failed, drained.dead_lettered, drained.archived), (1, 1, 3, 3));

    // The failure is journaled: a duplicate replays it and is dead-lettered too.
    let service = service(&f.stack);
    let hash = RequestHash::of_json(&json!({"status": 422}));
    let read = service.read(f.org, &format!("queue.{QUEUE}"), "refund-1", &hash).await.expect("a read");
    assert!(matches!(read, ReadOutcome::Completed { .. }), "{read:?}");

    f.send(json!({"idempotency_key": "order-2", "payload": {"sku": 1}})).await;
    f.drain(&consumer).await;
    f.send(json!({"idempotency_key": "order-2", "payload": {"sku": 2}})).await;
    let conflict = f.drain(&consumer).await;
    assert_eq!((conflict.ran, conflict.dead_lettered), (0, 1), "another payload under a used key never runs");

    let letters = f.dead_letters().await;
    let reasons: Vec<&str> =
        letters.iter().filter_map(|letter| letter["dead_letter"]["failure"]["error"].as_str()).collect();
    assert_eq!(reasons.len(), 4, "{letters:#?}");
    for reason in ["process_failed", "malformed_message", "conflict"] {
        assert!(reasons.contains(&reason), "{reason} in {reasons:?}");
    }
    let refund = letters.iter().find(|letter| letter["idempotency_key"] == "refund-1").expect("the message itself");
    assert_eq!(refund["payload"], json!({"status": 422}), "the letter carries the message");
    assert_eq!(refund["dead_letter"]["failure"]["error"], "process_failed");
    f.stack.stop().await.unwrap();
}

#[tokio::test]
async fn in_the_plane_a_message_that_keeps_failing_is_dead_lettered_after_max_reads() {
    a_message_that_keeps_failing_is_dead_lettered_after_max_reads(QueuePath::Plane).await;
}

#[tokio::test]
async fn through_pgmq_public_a_message_that_keeps_failing_is_dead_lettered_after_max_reads() {
    a_message_that_keeps_failing_is_dead_lettered_after_max_reads(QueuePath::DataApi).await;
}

async fn a_message_that_keeps_failing_is_dead_lettered_after_max_reads(path: QueuePath) {
    let f = fixture(path).await;
    let consumer = f.consumer(2);
    f.send(json!({"idempotency_key": "flaky-1", "payload": {"status": 503}})).await;
    for read in 1..=2 {
        let drained = f.drain(&consumer).await;
        assert_eq!((drained.ran, drained.failed, drained.left), (1, 1, 1), "read {read}: left to come back");
        tokio::time::sleep(Duration::from_secs(6)).await;
    }
    let third = f.drain(&consumer).await;
    assert_eq!((third.dead_lettered, third.archived), (1, 1));
    let letters = f.dead_letters().await;
    assert_eq!(letters[0]["dead_letter"]["failure"]["error"], "dead_lettered");
    assert_eq!(letters[0]["dead_letter"]["reads"], 3);
    f.stack.stop().await.unwrap();
}

#[tokio::test]
async fn through_pgmq_public_an_archive_or_a_dead_letter_send_that_fails_leaves_the_message_for_its_next_delivery() {
    let f = fixture(QueuePath::DataApi).await;
    // The consumer reaches pgmq_public through a proxy that closes chosen
    // calls before they are forwarded: pgmq never sees them.
    let proxy = RpcProxy::start(f.stack.url()).await;
    let consumer = f.consumer_of(5, Queues::new(proxy.client_config(f.stack.service_key())).expect("queues"));
    f.send(json!({"idempotency_key": "order-9", "payload": {"sku": 9}})).await;
    f.send(json!({"idempotency_key": "refund-9", "payload": {"status": 422}})).await;
    proxy.drop_next_unsent("archive", 1_000);
    proxy.drop_next_unsent("send", 1_000);

    let first = f.drain(&consumer).await;
    assert_eq!(
        (first.ran, first.failed, first.archived, first.dead_lettered, first.left),
        (2, 1, 0, 0, 2),
        "neither archived nor dead-lettered: both left, their answers journaled"
    );
    assert_eq!((f.archived().await, f.dead_letters().await.len()), (0, 0));

    proxy.clear();
    tokio::time::sleep(Duration::from_secs(6)).await;
    let second = f.drain(&consumer).await;
    assert_eq!(
        (second.read, second.ran, second.replayed, second.archived, second.dead_lettered),
        (2, 0, 2, 2, 1),
        "the next delivery replays both answers: the success archived, the failure dead-lettered"
    );
    assert_eq!(f.applied(), 1, "the effect ran once");
    let letters = f.dead_letters().await;
    assert_eq!(letters.len(), 1, "{letters:#?}");
    assert_eq!(letters[0]["idempotency_key"], "refund-9");
    assert_eq!(f.drain(&consumer).await.read, 0);
    f.stack.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_the_plane_four_consumers_split_a_queue_and_run_each_effect_once() {
    four_consumers_split_a_queue_and_run_each_effect_once(QueuePath::Plane).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn through_pgmq_public_four_consumers_split_a_queue_and_run_each_effect_once() {
    four_consumers_split_a_queue_and_run_each_effect_once(QueuePath::DataApi).await;
}

async fn four_consumers_split_a_queue_and_run_each_effect_once(path: QueuePath) {
    let f = fixture(path).await;
    let keys = 200;
    for n in 0..keys {
        f.send(json!({"idempotency_key": format!("order-{n}"), "payload": {"n": n}})).await;
        if n % 5 == 0 {
            f.send(json!({"idempotency_key": format!("order-{n}"), "payload": {"n": n}})).await;
        }
    }
    let sent = keys + keys / 5;
    let f = Arc::new(f);
    let mut consumers = Vec::new();
    for _ in 0..4 {
        let f = f.clone();
        consumers.push(tokio::spawn(async move {
            let consumer = f.consumer(5);
            let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
            while f.archived().await < sent && tokio::time::Instant::now() < deadline {
                if f.drain(&consumer).await.read == 0 {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }));
    }
    for consumer in consumers {
        consumer.await.expect("a consumer");
    }
    assert_eq!(f.archived().await, sent, "every message archived");
    let effects = f.effects.lock().expect("effects").clone();
    assert_eq!(effects.len(), keys as usize, "every key applied");
    assert!(effects.values().all(|&count| count == 1), "each once: {effects:?}");
    match Arc::try_unwrap(f) {
        Ok(f) => f.stack.stop().await.unwrap(),
        Err(_) => panic!("a consumer still holds the stack"),
    }
}
