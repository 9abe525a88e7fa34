//! What the plane's own queue functions do that Supabase's `pgmq_public`
//! path cannot: a batch read and claimed in one transaction and settled in
//! another (two round trips), a message archived if and only if its ending
//! is journaled, a failed command one dead letter however often it was
//! sent, a batch's duplicates ended with their first, a failure run again
//! after a fix, heartbeats that keep a long effect's message hidden, and
//! queues shared by tenants. Each test fails on the consumer before them.

use std::time::Duration;

use idempotency_plane::callers::queue::{ConsumerOptions, QueueConsumer, QueuePath, Queues};
use idempotency_plane::postgrest::RetryConfig;
use idempotency_plane::repo::{FailuresCall, JournaledFailures};
use idempotency_plane::service::{Answer, EffectDriver, IdempotencyService, Settle, Timing};
use idempotency_plane::{PostgrestRepository, ReadOutcome, RequestHash};
use serde_json::{json, Value};
use uuid::Uuid;

use super::{fixture, Fixture, DLQ, QUEUE};
use crate::support::harness::*;
use crate::support::proxy::RpcProxy;

const SCOPE: &str = "queue.rust_queue";

impl Fixture {
    /// Sends `text` as it is: JSON no client can read included.
    async fn send_text(&self, text: &str) {
        sqlx::query("select pgmq.send($1, $2::jsonb)")
            .bind(QUEUE)
            .bind(text)
            .execute(self.stack.db())
            .await
            .expect("a send");
    }

    /// A consumer in the plane whose options `change` sets, reaching the
    /// plane through `repo`.
    fn consumer_in_plane(
        &self,
        repo: PostgrestRepository,
        change: impl FnOnce(&mut ConsumerOptions),
    ) -> QueueConsumer<PostgrestRepository> {
        let mut options = ConsumerOptions::new(QUEUE, DLQ, self.org, super::timing());
        options.batch_size = 20;
        options.path = QueuePath::Plane;
        change(&mut options);
        let queues = Queues::new(self.stack.client_config().expect("a config")).expect("queues");
        QueueConsumer::new(EffectDriver::new(IdempotencyService::new(repo)), queues, options).expect("a consumer")
    }

    fn repository(&self) -> PostgrestRepository {
        PostgrestRepository::new(client(&self.stack))
    }

    /// A repository that never retries: a deadlock (40P01) or a lock
    /// timeout is an error the test sees, not one retried out of sight.
    fn unretried(&self) -> PostgrestRepository {
        let config = self.stack.client_config().expect("a config").with_retry(RetryConfig::disabled());
        PostgrestRepository::new(idempotency_plane::PostgrestClient::new(config).expect("a client"))
    }

    /// How many messages of the archive, and how often each was read.
    async fn archived_reads(&self) -> Vec<i32> {
        sqlx::query_scalar("select read_ct from pgmq.a_rust_queue order by msg_id")
            .fetch_all(self.stack.db())
            .await
            .expect("the archive")
    }

    /// The claim of `key` (of the fixture's organization): its status and
    /// whether it still carries its work.
    async fn claim_of(&self, org: Uuid, key: &str) -> (String, bool) {
        sqlx::query_as(
            "select status, request is not null from agent.idempotency_keys where organization_id = $1 and key = $2",
        )
        .bind(org)
        .bind(key)
        .fetch_one(self.stack.db())
        .await
        .expect("the claim")
    }
}

#[tokio::test]
async fn in_the_plane_a_message_no_client_can_read_is_dead_lettered_alone_and_its_batch_runs() {
    a_message_no_client_can_read_is_dead_lettered_alone_and_its_batch_runs(QueuePath::Plane).await;
}

#[tokio::test]
async fn through_pgmq_public_a_message_no_client_can_read_is_dead_lettered_alone_and_its_batch_runs() {
    a_message_no_client_can_read_is_dead_lettered_alone_and_its_batch_runs(QueuePath::DataApi).await;
}

/// `1e400` is valid JSON, and no double holds it: a JavaScript reader takes
/// it for infinity, serde_json refuses it. Such a message used to fail
/// every drain of its queue before anything was claimed.
async fn a_message_no_client_can_read_is_dead_lettered_alone_and_its_batch_runs(path: QueuePath) {
    let f = fixture(path).await;
    let consumer = f.consumer(5);
    f.send(json!({"idempotency_key": "order-1", "payload": {"sku": 1}})).await;
    f.send_text(r#"{"idempotency_key": "poison-1", "payload": {"n": 1e400}}"#).await;
    f.send(json!({"idempotency_key": "order-2", "payload": {"sku": 2}})).await;

    let drained = f.drain(&consumer).await;
    assert_eq!((drained.read, drained.ran, drained.dead_lettered, drained.archived), (3, 2, 1, 3), "{drained:?}");
    assert_eq!(f.applied(), 2, "the rest of the batch ran");
    let letters = f.dead_letters().await;
    assert_eq!(letters.len(), 1, "{letters:#?}");
    let letter = &letters[0]["dead_letter"];
    assert_eq!(letter["failure"]["error"], "malformed_message");
    let text = letter["message_text"].as_str().expect("the message as text");
    assert!(text.contains("poison-1") && text.contains("10000000000"), "{text}");
    assert_eq!(f.drain(&consumer).await.read, 0, "nothing comes back");
    f.stack.stop().await.unwrap();
}

/// A batch costs two round trips whatever its messages: one take (read and
/// claim), one settle (journal, archive, dead-letter), against a read, a
/// claim, a journal and one archive or send per message before.
#[tokio::test]
async fn a_batch_of_every_outcome_costs_two_round_trips() {
    let f = fixture(QueuePath::Plane).await;
    let proxy = RpcProxy::start(f.stack.url()).await;
    let repo = PostgrestRepository::new(proxy.client(f.stack.service_key(), Default::default()));
    let consumer = f.consumer_in_plane(repo, |_| {});
    // A key completed before, to replay.
    f.send(json!({"idempotency_key": "done-1", "payload": {}})).await;
    f.drain(&f.consumer(5)).await;
    for message in [
        json!({"idempotency_key": "ok-1", "payload": {}}),
        json!({"idempotency_key": "ok-1", "payload": {}}),
        json!({"idempotency_key": "fails-1", "payload": {"status": 422}}),
        json!({"idempotency_key": "done-1", "payload": {}}),
        json!({"idempotency_key": "done-1", "payload": {"another": true}}),
        json!(["not an object"]),
        json!({"idempotency_key": "unknown-1", "payload": {"status": 503}}),
    ] {
        f.send(message).await;
    }
    let drained = f.drain(&consumer).await;
    assert_eq!(drained.read, 7, "{drained:?}");
    assert_eq!((drained.ran, drained.replayed, drained.dead_lettered, drained.left), (3, 2, 3, 1), "{drained:?}");
    assert_eq!(proxy.requests("idempotency_queue_take"), 1);
    assert_eq!(proxy.requests("idempotency_queue_settle"), 1);
    for other in ["read", "archive", "send", "idempotency_claim_many", "idempotency_complete_many"] {
        assert_eq!(proxy.requests(other), 0, "{other}");
    }
    f.stack.stop().await.unwrap();
}

/// A key twice in one batch, with the same payload: the second message is
/// a copy of the first, archived with it in the same drain (it used to be
/// left, hidden for a whole lease, and need another drain).
#[tokio::test]
async fn a_key_twice_in_one_batch_ends_with_its_first_in_the_same_drain() {
    let f = fixture(QueuePath::Plane).await;
    let consumer = f.consumer(5);
    f.send(json!({"idempotency_key": "order-1", "payload": {"sku": 7}})).await;
    f.send(json!({"idempotency_key": "order-1", "payload": {"sku": 7}})).await;
    f.send(json!({"payload": {"sku": 8}})).await;
    let drained = f.drain(&consumer).await;
    assert_eq!(
        (drained.read, drained.ran, drained.replayed, drained.archived, drained.left),
        (3, 2, 1, 3, 0),
        "{drained:?}"
    );
    assert_eq!(f.applied(), 2, "one effect per key");
    assert_eq!(f.drain(&consumer).await.read, 0, "nothing left to come back");
    f.stack.stop().await.unwrap();
}

/// A failed command is one dead letter, however often its producer sent
/// it: a copy in the same batch, or a later message, is archived beside
/// the first letter (each used to be a letter of its own).
#[tokio::test]
async fn a_failed_command_sent_three_times_is_one_dead_letter() {
    let f = fixture(QueuePath::Plane).await;
    let consumer = f.consumer(5);
    let refund = json!({"idempotency_key": "refund-1", "payload": {"status": 422}});
    f.send(refund.clone()).await;
    f.send(refund.clone()).await;
    let first = f.drain(&consumer).await;
    assert_eq!((first.ran, first.failed, first.dead_lettered, first.archived), (1, 1, 1, 2), "{first:?}");
    f.send(refund).await;
    let again = f.drain(&consumer).await;
    assert_eq!((again.ran, again.replayed, again.dead_lettered, again.archived), (0, 1, 0, 1), "{again:?}");
    let letters = f.dead_letters().await;
    assert_eq!(letters.len(), 1, "{letters:#?}");
    assert_eq!(letters[0]["idempotency_key"], "refund-1");
    assert_eq!(letters[0]["dead_letter"]["failure"]["error"], "process_failed");
    f.stack.stop().await.unwrap();
}

/// A job that failed for good is kept with its payload; once the bug is
/// fixed, an operator sends it back (`idem redrive --failed`, the plane's
/// `idempotency_redrive_failed`) and the consumer's next drain runs it once
/// more, exactly once, under the same vendor key. Before, the consumer
/// stored no work: nothing could be sent back.
#[tokio::test]
async fn a_failure_sent_back_after_a_fix_runs_once_more_on_the_next_drain() {
    let f = fixture(QueuePath::Plane).await;
    let consumer = f.consumer(5);
    f.send(json!({"idempotency_key": "invoice-1", "payload": {"status": 422, "amount": 12}})).await;
    let failed = f.drain(&consumer).await;
    assert_eq!((failed.failed, failed.dead_lettered), (1, 1), "{failed:?}");
    assert_eq!(f.claim_of(f.org, "invoice-1").await, ("completed".to_owned(), true), "a failure keeps its work");

    let repo = f.repository();
    let call = FailuresCall { scope: SCOPE, bound: 10, organization_id: Some(f.org), since: None, claim_ids: None };
    let failures = repo.failures(&call).await.expect("the failures");
    assert_eq!(failures.len(), 1);
    let ids = [failures[0].id];
    let sent = repo.redrive_failed(&FailuresCall { claim_ids: Some(&ids), ..call }).await.expect("sent back");
    assert_eq!(sent.len(), 1, "the failure can be sent back: its payload is kept");

    // The fix: the downstream now takes the invoice.
    let effects = f.effects.clone();
    let fixed = |payload: Value, context: idempotency_plane::callers::queue::MessageContext| {
        let effects = effects.clone();
        async move {
            assert_eq!(payload, json!({"status": 422, "amount": 12}), "the stored payload");
            assert!(context.message.is_none(), "re-driven work has no message");
            *effects.lock().expect("effects").entry(context.vendor_key).or_default() += 1;
            Settle::Journal(Answer::success(json!({"paid": true})))
        }
    };
    let rerun = consumer.drain(fixed).await.expect("a drain");
    assert_eq!((rerun.read, rerun.redriven, rerun.ran, rerun.failed), (0, 1, 1, 0), "{rerun:?}");
    let again = consumer.drain(fixed).await.expect("a drain");
    assert_eq!((again.redriven, again.ran), (0, 0), "run once: {again:?}");
    assert_eq!(f.applied(), 1);
    let hash = RequestHash::of_json(&json!({"status": 422, "amount": 12}));
    let read = service(&f.stack).read(f.org, SCOPE, "invoice-1", &hash).await.expect("a read");
    let ReadOutcome::Completed { response: Some(response), .. } = read else { panic!("completed: {read:?}") };
    assert_eq!(response["ok"], true, "the fixed run's answer is journaled");
    assert_eq!(f.claim_of(f.org, "invoice-1").await, ("completed".to_owned(), false), "a success drops its work");
    assert_eq!(f.dead_letters().await.len(), 1, "the failure's one letter, no other");
    f.stack.stop().await.unwrap();
}

/// Heartbeats keep a long effect's message hidden with its lease (pgmq's
/// visibility extended in the same transaction as the lease): another
/// consumer draining meanwhile reads nothing, and the message is read once.
/// Before, it came back a lease and a second after its read, while its
/// effect still ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn heartbeats_keep_a_long_effects_message_hidden() {
    let f = fixture(QueuePath::Plane).await;
    // A 3 s lease kept by heartbeats: a message is hidden 4 s per beat.
    let beating = Timing::new(Duration::from_secs(20), Duration::from_millis(1500), Duration::from_secs(1))
        .and_then(|timing| timing.with_heartbeats(Duration::from_secs(3)))
        .expect("a timing");
    let slow = f.consumer_in_plane(f.repository(), |options| options.timing = beating);
    let other = f.consumer_in_plane(f.repository(), |options| options.timing = beating);
    f.send(json!({"idempotency_key": "report-1", "payload": {}})).await;

    let effect = slow.drain(|_, _| async {
        tokio::time::sleep(Duration::from_secs(9)).await;
        Settle::Journal(Answer::success(json!({"built": true})))
    });
    let watcher = async {
        let mut seen = 0;
        let until = tokio::time::Instant::now() + Duration::from_secs(8);
        while tokio::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let drained = other.drain(|_, _| async { Settle::Unknown("never runs") }).await.expect("a drain");
            seen += drained.read;
        }
        seen
    };
    let (drained, seen) = tokio::join!(effect, watcher);
    let drained = drained.expect("the slow drain");
    assert_eq!((drained.ran, drained.archived), (1, 1), "{drained:?}");
    assert_eq!(seen, 0, "the message stayed hidden while its effect ran");
    assert_eq!(f.archived_reads().await, [1], "read once");
    f.stack.stop().await.unwrap();
}

/// A queue shared by tenants: each message names its organization, claimed
/// under it when the consumer accepts it, dead-lettered when not; one that
/// names none is the consumer's own.
#[tokio::test]
async fn messages_of_tenants_sharing_a_queue_are_claimed_under_their_own_organization() {
    let f = fixture(QueuePath::Plane).await;
    let (other, stranger) = (Uuid::new_v4(), Uuid::new_v4());
    let consumer = f.consumer_in_plane(f.repository(), |options| options.organizations = Some(vec![f.org, other]));
    f.send(json!({"idempotency_key": "a-1", "payload": {}})).await;
    f.send(json!({"idempotency_key": "b-1", "organization_id": other, "payload": {}})).await;
    f.send(json!({"idempotency_key": "c-1", "organization_id": stranger, "payload": {}})).await;
    f.send(json!({"idempotency_key": "d-1", "organization_id": "not a uuid", "payload": {}})).await;
    let drained = f.drain(&consumer).await;
    assert_eq!((drained.ran, drained.dead_lettered, drained.archived), (2, 2, 4), "{drained:?}");
    assert_eq!(f.claim_of(f.org, "a-1").await.0, "completed");
    assert_eq!(f.claim_of(other, "b-1").await.0, "completed", "claimed under the message's organization");
    let letters = f.dead_letters().await;
    let reasons: Vec<&str> =
        letters.iter().filter_map(|letter| letter["dead_letter"]["failure"]["output"]["reason"].as_str()).collect();
    assert!(reasons.iter().any(|reason| reason.contains("not one this consumer accepts")), "{reasons:?}");
    assert!(reasons.iter().any(|reason| reason.contains("not a UUID")), "{reasons:?}");
    f.stack.stop().await.unwrap();
}

/// A tenant's job whose consumer stopped runs again from the plane, where
/// its claim keeps its payload but not its message; when it fails there,
/// its dead letter still names its organization, so a letter sent back to
/// the queue after a fix is claimed under that tenant again (it answers the
/// journaled failure) and never under the consumer's own organization as
/// a new command. Before, such a letter held only the key and the payload.
#[tokio::test]
async fn a_failure_of_work_run_from_the_plane_is_lettered_under_its_organization() {
    let f = fixture(QueuePath::Plane).await;
    let other = Uuid::new_v4();
    let proxy = RpcProxy::start(f.stack.url()).await;
    let repo = PostgrestRepository::new(proxy.client(f.stack.service_key(), Default::default()));
    let consumer = f.consumer_in_plane(repo, |options| options.organizations = Some(vec![f.org, other]));
    f.send(json!({"idempotency_key": "tenant-job", "organization_id": other, "payload": {"status": 422}})).await;
    proxy.drop_next("idempotency_queue_take", 1);
    assert!(consumer.drain(|_, _| async { Settle::Unknown("never run") }).await.is_err(), "the take's answer is lost");
    // The message stays hidden; only the claim's stored work can run it.
    sqlx::query("select pgmq.set_vt($1, msg_id, 600) from pgmq.q_rust_queue")
        .bind(QUEUE)
        .execute(f.stack.db())
        .await
        .expect("the message hidden");
    tokio::time::sleep(super::timing().lease() + Duration::from_millis(500)).await;
    let drained = f.drain(&consumer).await;
    assert_eq!((drained.read, drained.redriven, drained.failed, drained.dead_lettered), (0, 1, 1, 1), "{drained:?}");
    let letters = f.dead_letters().await;
    assert_eq!(letters.len(), 1, "{letters:#?}");
    assert_eq!(letters[0]["organization_id"], json!(other), "{letters:#?}");
    assert_eq!(letters[0]["idempotency_key"], "tenant-job");

    let mut resent = letters[0].clone();
    resent.as_object_mut().expect("a letter is an object").remove("dead_letter");
    f.send(resent).await;
    sqlx::query("delete from pgmq.q_rust_queue where message ->> 'idempotency_key' = 'tenant-job' and read_ct > 0")
        .execute(f.stack.db())
        .await
        .expect("the first message gone");
    let again = f.drain(&consumer).await;
    assert_eq!((again.read, again.ran, again.replayed, again.dead_lettered), (1, 0, 1, 0), "{again:?}");
    let owners: Vec<Uuid> =
        sqlx::query_scalar("select organization_id from agent.idempotency_keys where key = 'tenant-job'")
            .fetch_all(f.stack.db())
            .await
            .expect("the claims");
    assert_eq!(owners, vec![other], "one claim, the tenant's");
    f.stack.stop().await.unwrap();
}

/// A settle whose answer is lost after the database acted is asked again
/// (it is safe to repeat): the effect ran once, its message is archived
/// once, and its failure is one dead letter.
#[tokio::test]
async fn a_settle_whose_answer_is_lost_is_repeated_and_sends_nothing_twice() {
    let f = fixture(QueuePath::Plane).await;
    let proxy = RpcProxy::start(f.stack.url()).await;
    let repo = PostgrestRepository::new(proxy.client(f.stack.service_key(), Default::default()));
    let consumer = f.consumer_in_plane(repo, |_| {});
    f.send(json!({"idempotency_key": "ok-1", "payload": {}})).await;
    f.send(json!({"idempotency_key": "refund-1", "payload": {"status": 422}})).await;
    proxy.drop_next("idempotency_queue_settle", 1);
    let drained = f.drain(&consumer).await;
    assert_eq!(proxy.answered("idempotency_queue_settle"), 2, "asked again after the lost answer");
    assert_eq!((drained.ran, drained.archived, drained.left), (2, 2, 0), "{drained:?}");
    assert_eq!(f.applied(), 1);
    assert_eq!(f.archived().await, 2);
    assert_eq!(f.dead_letters().await.len(), 1, "one letter");
    f.stack.stop().await.unwrap();
}

/// A take whose answer is lost after the database acted (the messages read
/// and claimed under tokens nobody received) is a consumer that stopped:
/// the messages come back a lease and a second later, are taken over, and
/// each effect runs once.
#[tokio::test]
async fn a_take_whose_answer_is_lost_leaves_its_messages_to_come_back_once() {
    let f = fixture(QueuePath::Plane).await;
    let proxy = RpcProxy::start(f.stack.url()).await;
    let repo = PostgrestRepository::new(proxy.client(f.stack.service_key(), Default::default()));
    let consumer = f.consumer_in_plane(repo, |_| {});
    for n in 0..3 {
        f.send(json!({"idempotency_key": format!("order-{n}"), "payload": {"n": n}})).await;
    }
    proxy.drop_next("idempotency_queue_take", 1);
    let effects = f.effects.clone();
    let lost = consumer
        .drain(move |_, context| {
            let effects = effects.clone();
            async move {
                *effects.lock().expect("effects").entry(context.vendor_key).or_default() += 1;
                Settle::Journal(Answer::success(json!({})))
            }
        })
        .await;
    assert!(lost.is_err(), "the take is not repeated: {lost:?}");
    assert_eq!(proxy.answered("idempotency_queue_take"), 1, "the database took the batch");
    assert_eq!(f.drain(&consumer).await.read, 0, "hidden while their claims' leases run");
    tokio::time::sleep(Duration::from_secs(6)).await;
    let drained = f.drain(&consumer).await;
    assert_eq!((drained.read, drained.ran, drained.archived), (3, 3, 3), "{drained:?}");
    assert_eq!(f.applied(), 3, "each once");
    f.stack.stop().await.unwrap();
}

/// A settle that comes after its messages came back races the take that
/// read them again: the take holds the messages and waits for the claims,
/// the settle would hold the claims and wait for the messages, unless every
/// queue function locks messages before claims, as they do. Round after
/// round, two hundred late settles race takes of their own messages, with
/// retries off: none fails (a deadlock would be 40P01), a settle that lost
/// its claim to the take archives nothing, and every message is archived
/// and every key ended once its new holder settled.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn late_settles_racing_takes_of_their_messages_never_deadlock_and_archive_only_what_they_journal() {
    use idempotency_plane::repo::{CompletionArgs, PlaneQueues, QueueClaim, QueueEnding, QueueTakeCall, TakeOutcome};
    const ROUNDS: usize = 5;
    const BATCHES: usize = 20;
    const PER_BATCH: usize = 10;
    let f = fixture(QueuePath::Plane).await;
    let done = json!({"ok": true, "output": {}});
    for round in 0..ROUNDS {
        for n in 0..BATCHES * PER_BATCH {
            f.send(json!({"idempotency_key": format!("r{round}-{n}"), "payload": {"n": n}})).await;
        }
        let take = |repo: PostgrestRepository| {
            let org = f.org;
            async move {
                let tokens: Vec<Uuid> = (0..PER_BATCH).map(|_| Uuid::new_v4()).collect();
                let call = QueueTakeCall {
                    queue: QUEUE,
                    dead_letter_queue: DLQ,
                    organization_id: Some(org),
                    organizations: None,
                    scope: SCOPE,
                    lease: Duration::from_secs(1),
                    lease_tokens: &tokens,
                    max_reads: 10,
                };
                repo.queue_take(&call).await
            }
        };
        let settle = |repo: PostgrestRepository, items: Vec<idempotency_plane::repo::TakenItem>| {
            let done = done.clone();
            async move {
                // A take with slots its read did not fill re-drives claims
                // whose lease passed: those come without a message.
                let ids: Vec<Vec<i64>> = items.iter().map(|item| item.msg_id.into_iter().collect()).collect();
                let endings: Vec<(QueueClaim<'_>, QueueEnding<'_>)> = items
                    .iter()
                    .zip(&ids)
                    .filter(|(item, _)| {
                        matches!(item.outcome, TakeOutcome::Claimed | TakeOutcome::Reclaimed | TakeOutcome::Redriven)
                    })
                    .map(|(item, ids)| {
                        let claim = QueueClaim {
                            organization_id: item.organization_id.expect("an organization"),
                            claim_id: item.id.expect("a claim"),
                            lease_token: item.lease_token.expect("a token"),
                            msg_ids: ids,
                        };
                        (claim, QueueEnding::Journal(CompletionArgs { response: Some(&done), ..Default::default() }))
                    })
                    .collect();
                repo.queue_settle(QUEUE, DLQ, &endings).await.map(|settled| (endings.len(), settled))
            }
        };
        // The first consumer takes everything, then stalls past the leases.
        let mut taken = Vec::new();
        for _ in 0..BATCHES {
            taken.push(take(f.unretried()).await.expect("a take"));
        }
        tokio::time::sleep(Duration::from_millis(2_100)).await;
        // Its settles arrive late, while a second consumer takes the same
        // messages again.
        let late = futures_util::future::join_all(taken.into_iter().map(|items| settle(f.unretried(), items)));
        let again = futures_util::future::join_all((0..BATCHES).map(|_| take(f.unretried())));
        let (late, again) = tokio::join!(late, again);
        let mut retaken = Vec::new();
        for answer in again {
            let items = answer.unwrap_or_else(|error| panic!("round {round}: a take failed: {error}"));
            retaken.push(items);
        }
        for answer in late {
            let (sent, settled) = answer.unwrap_or_else(|error| panic!("round {round}: a late settle failed: {error}"));
            assert_eq!(settled.len(), sent);
            for one in settled {
                assert!(one.journaled || one.archived == 0, "round {round}: archived only what it journaled");
            }
        }
        // The second consumer settles what it took over.
        for items in retaken {
            let (_, settled) = settle(f.unretried(), items).await.expect("a settle");
            assert!(settled.iter().all(|one| one.journaled), "round {round}: the new holder journals");
        }
        // A message whose claim a take re-drove (a slot its read did not
        // fill) while another take read it was left, hidden: it comes back
        // and is replayed, archived without running.
        for _ in 0..3 {
            let left: i64 = sqlx::query_scalar("select count(*) from pgmq.q_rust_queue")
                .fetch_one(f.stack.db())
                .await
                .expect("the queue");
            if left == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2_100)).await;
            for _ in 0..BATCHES {
                let items = take(f.unretried()).await.expect("a take");
                assert!(
                    items.iter().all(|item| item.outcome == TakeOutcome::Completed),
                    "round {round}: every key ended before: {items:?}"
                );
            }
        }
        let (unarchived, unended): (i64, i64) = sqlx::query_as(
            "select (select count(*) from pgmq.q_rust_queue),
                    (select count(*) from agent.idempotency_keys where organization_id = $1 and status <> 'completed')",
        )
        .bind(f.org)
        .fetch_one(f.stack.db())
        .await
        .expect("the state");
        assert_eq!((unarchived, unended), (0, 0), "round {round}: every message archived, every key ended");
    }
    let (archived, keys): (i64, i64) = sqlx::query_as(
        "select (select count(*) from pgmq.a_rust_queue), (select count(*) from agent.idempotency_keys where organization_id = $1)",
    )
    .bind(f.org)
    .fetch_one(f.stack.db())
    .await
    .expect("the archive");
    assert_eq!((archived, keys), ((ROUNDS * BATCHES * PER_BATCH) as i64, (ROUNDS * BATCHES * PER_BATCH) as i64));
    f.stack.stop().await.unwrap();
}

/// An argument of a call: its name, a good value, whether it is required.
type Argument = (&'static str, String, bool);

/// The queue functions refuse each required argument given as SQL NULL
/// (what PostgREST binds for a JSON `null`; the embedded server sends `''`)
/// with 22023 naming it, as the service role; with every argument given,
/// each runs.
#[tokio::test]
async fn the_queue_functions_refuse_each_required_argument_as_sql_null_by_name() {
    let f = fixture(QueuePath::Plane).await;
    let token = Uuid::new_v4().to_string();
    let org = f.org.to_string();
    let items = json!([{"organization_id": f.org, "claim_id": Uuid::new_v4(), "lease_token": Uuid::new_v4(),
                        "msg_ids": [1], "ending": "journal", "response": {"ok": true}}])
    .to_string();
    let calls: [(&str, Vec<Argument>); 3] = [
        (
            "select * from agent.idempotency_queue_take($1, $2, $3::uuid, $4::bigint, $5::uuid[], $6::integer, $7, \
             $8::uuid[], $9::integer)",
            vec![
                ("p_queue", QUEUE.to_owned(), true),
                ("p_dead_letter_queue", DLQ.to_owned(), true),
                // Either names the organizations taken: one alone is enough.
                ("p_organization_id", org.clone(), false),
                ("p_lease_ms", "5000".to_owned(), true),
                ("p_lease_tokens", format!("{{{token}}}"), true),
                ("p_max_reads", "5".to_owned(), true),
                ("p_scope", SCOPE.to_owned(), false),
                ("p_organizations", format!("{{{org}}}"), false),
                ("p_row_cap", "1000".to_owned(), false),
            ],
        ),
        (
            "select * from agent.idempotency_queue_settle($1, $2, $3::jsonb, $4::integer)",
            vec![
                ("p_queue", QUEUE.to_owned(), true),
                ("p_dead_letter_queue", DLQ.to_owned(), true),
                ("p_items", items.clone(), true),
                ("p_row_cap", "1000".to_owned(), false),
            ],
        ),
        (
            "select * from agent.idempotency_queue_extend($1, $2::bigint, $3::jsonb, $4::integer)",
            vec![
                ("p_queue", QUEUE.to_owned(), true),
                ("p_lease_ms", "5000".to_owned(), true),
                ("p_items", items, true),
                ("p_row_cap", "1000".to_owned(), false),
            ],
        ),
    ];
    let mut conn = f.stack.db().acquire().await.expect("a connection");
    let mut wrong = Vec::new();
    for (sql, arguments) in &calls {
        for null in std::iter::once(None).chain((0..arguments.len()).map(Some)) {
            sqlx::query("begin").execute(&mut *conn).await.expect("begin");
            sqlx::query("set local role service_role").execute(&mut *conn).await.expect("the API role");
            let mut query = sqlx::query(*sql);
            for (i, (_, value, _)) in arguments.iter().enumerate() {
                query = query.bind((Some(i) != null).then_some(value.as_str()));
            }
            let result = query.execute(&mut *conn).await;
            sqlx::query("rollback").execute(&mut *conn).await.expect("rollback");
            let refused = result.err().map(|error| match error.as_database_error() {
                Some(db) => (db.code().map(|code| code.into_owned()).unwrap_or_default(), db.message().to_owned()),
                None => ("?".to_owned(), error.to_string()),
            });
            match (null.map(|i| &arguments[i]), refused) {
                (None | Some((_, _, false)), None) => {}
                (Some((name, _, true)), Some((code, message))) if code == "22023" && message.contains(name) => {}
                (argument, refused) => wrong.push(format!("{sql} with {argument:?} NULL: {refused:?}")),
            }
        }
    }
    drop(conn);
    assert!(wrong.is_empty(), "{wrong:#?}");
    let neither = sqlx::query(
        "select * from agent.idempotency_queue_take($1, $2, null::uuid, 5000, array[gen_random_uuid()], 5, null, null::uuid[])",
    )
    .bind(QUEUE)
    .bind(DLQ)
    .execute(f.stack.db())
    .await
    .expect_err("no organization at all");
    let refused = neither.as_database_error().expect("a database error");
    assert_eq!(refused.code().as_deref(), Some("22023"));
    assert!(refused.message().contains("p_organization_id or p_organizations"), "{}", refused.message());
    let hash: Option<String> = sqlx::query_scalar("select agent.idempotency_request_hash(null)")
        .fetch_one(f.stack.db())
        .await
        .expect("a hash of NULL");
    assert_eq!(hash, None, "no hash of nothing");
    f.stack.stop().await.unwrap();
}

/// A settle or an extend with one malformed item anywhere is refused whole
/// with 22023 naming the item and what is wrong with it, and changes
/// nothing: no claim journaled or extended, no message archived or
/// dead-lettered. The same items, well formed, then settle.
#[tokio::test]
async fn a_malformed_item_refuses_the_whole_settle_or_extend_naming_it_and_changes_nothing() {
    let f = fixture(QueuePath::Plane).await;
    for n in 0..3 {
        f.send(json!({"idempotency_key": format!("item-{n}"), "payload": {"n": n}})).await;
    }
    let taken: Vec<(i64, Uuid, Uuid)> = sqlx::query_as(
        "select msg_id, id, lease_token from agent.idempotency_queue_take($1, $2, $3, 60000,
           array[gen_random_uuid(), gen_random_uuid(), gen_random_uuid()]) order by msg_id",
    )
    .bind(QUEUE)
    .bind(DLQ)
    .bind(f.org)
    .fetch_all(f.stack.db())
    .await
    .expect("a take");
    assert_eq!(taken.len(), 3);
    let good: Vec<Value> = taken
        .iter()
        .map(|(msg_id, id, token)| {
            json!({"organization_id": f.org, "claim_id": id, "lease_token": token, "msg_ids": [msg_id],
                   "ending": "journal", "response": {"ok": true}})
        })
        .collect();
    let with = |change: &dyn Fn(&mut Value)| {
        let mut items = good.clone();
        change(&mut items[2]);
        Value::Array(items)
    };

    // Each case: item 2 bad in one way, whether extend checks it too, and
    // what the refusal must name.
    let mut cases: Vec<(Value, bool, String)> = Vec::new();
    for field in ["organization_id", "claim_id", "lease_token"] {
        for bad in [Value::Null, json!("not-a-uuid"), json!(7)] {
            cases.push((with(&|item| item[field] = bad.clone()), true, format!("p_items[2].{field}")));
        }
        let absent = |item: &mut Value| {
            if let Some(item) = item.as_object_mut() {
                item.remove(field);
            }
        };
        cases.push((with(&absent), true, format!("p_items[2].{field}")));
    }
    for bad in [Value::Null, json!("1"), json!([0]), json!([1.5]), json!(["1"]), json!([-3])] {
        cases.push((with(&|item| item["msg_ids"] = bad.clone()), true, "p_items[2].msg_ids".into()));
    }
    for bad in [Value::Null, json!("finish"), json!(1)] {
        cases.push((with(&|item| item["ending"] = bad.clone()), false, "p_items[2].ending".into()));
    }
    cases.push((with(&|item| item["response"] = Value::Null), false, "p_items[2] is journaled with neither".into()));
    cases.push((with(&|item| item["resource_type"] = json!(7)), false, "p_items[2].resource_type".into()));
    cases.push((with(&|item| *item = Value::Null), true, "p_items[2]".into()));
    cases.push((with(&|item| *item = json!("item-2")), true, "p_items[2]".into()));

    let leases = "select status, lease_expires_at from agent.idempotency_keys where organization_id = $1 order by key";
    let before: Vec<(String, chrono::DateTime<chrono::Utc>)> =
        sqlx::query_as(leases).bind(f.org).fetch_all(f.stack.db()).await.expect("the claims");
    // Each function with its second argument: the dead-letter queue, or the lease.
    let settle = ("select * from agent.idempotency_queue_settle($1, $2, $3::jsonb)", DLQ);
    let extend = ("select * from agent.idempotency_queue_extend($1, $2::bigint, $3::jsonb)", "60000");
    let mut conn = f.stack.db().acquire().await.expect("a connection");
    let mut wrong = Vec::new();
    for (items, extend_checks, named) in &cases {
        for (sql, second) in std::iter::once(settle).chain(extend_checks.then_some(extend)) {
            sqlx::query("begin").execute(&mut *conn).await.expect("begin");
            sqlx::query("set local role service_role").execute(&mut *conn).await.expect("the API role");
            let result = sqlx::query(sql).bind(QUEUE).bind(second).bind(items).execute(&mut *conn).await;
            sqlx::query("commit").execute(&mut *conn).await.expect("commit");
            match result.err().as_ref().and_then(|error| error.as_database_error()) {
                Some(db) if db.code().as_deref() == Some("22023") && db.message().contains(named.as_str()) => {}
                other => wrong.push(format!("{sql} with {items}: expected 22023 naming {named}, got {other:?}")),
            }
        }
    }
    drop(conn);
    assert!(wrong.is_empty(), "{wrong:#?}");
    let after: Vec<(String, chrono::DateTime<chrono::Utc>)> =
        sqlx::query_as(leases).bind(f.org).fetch_all(f.stack.db()).await.expect("the claims");
    assert_eq!(after, before, "no claim journaled or extended");
    assert!(after.iter().all(|(status, _)| status == "processing"), "{after:?}");
    assert_eq!((f.archived().await, f.dead_letters().await.len()), (0, 0), "no message archived or dead-lettered");

    let settled: Vec<(bool, i32)> =
        sqlx::query_as("select journaled, archived from agent.idempotency_queue_settle($1, $2, $3::jsonb)")
            .bind(QUEUE)
            .bind(DLQ)
            .bind(Value::Array(good))
            .fetch_all(f.stack.db())
            .await
            .expect("a settle");
    assert_eq!(settled, vec![(true, 1); 3]);
    assert_eq!(f.archived().await, 3);
    f.stack.stop().await.unwrap();
}
