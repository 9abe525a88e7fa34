//! The consumer: one batch read, claimed, run, journaled and archived.

use std::future::Future;

use serde_json::{json, Value};
use tracing::Instrument;
use uuid::Uuid;

use crate::callers::tool::vendor_key;
use crate::error::Error;
use crate::postgrest::codes;
use crate::repo::{BatchClaims, IdempotencyRepository, PlaneQueues};
use crate::repo::{QueueMessage, Queues, ReadBatch};
use crate::service::{
    Answer, Batch, BatchItem, BatchReport, Claim, EffectDriver, ItemEnding, RequestHash, Settle, Timing, MAX_KEY_CHARS,
};

/// How a consumer drains its queue.
#[derive(Debug, Clone)]
pub struct ConsumerOptions {
    /// The pgmq queue.
    pub queue: String,
    /// The tenant every message of the queue belongs to.
    pub organization_id: Uuid,
    /// Each effect's timeout, its journal's deadline and the lease they
    /// make. A message read is hidden for the lease and a second more.
    pub timing: Timing,
    /// The plane scope messages are claimed in: `queue.<queue>` by default.
    pub scope: String,
    /// Where a message goes whose effect failed for good (a journaled
    /// failure), whose key answers for another payload, that no key can be
    /// read from, or that was read more than `max_reads` times: sent there
    /// with its failure, then archived. Required: without it such a
    /// message would have nowhere to go but the archive, where nobody
    /// looks.
    pub dead_letter_queue: String,
    /// Reads after which a message that never ended is dead-lettered.
    pub max_reads: i32,
    /// Messages per read, at most the plane's row cap.
    pub batch_size: u32,
    /// Effects run at once.
    pub concurrency: usize,
    /// For a queue shared by tenants: the organizations whose messages
    /// this consumer takes (each message names its own `organization_id`;
    /// one that names none is `organization_id`'s). `None`: that one alone.
    /// Only the plane's queue functions read it ([`QueuePath::Plane`]).
    pub organizations: Option<Vec<Uuid>>,
    /// Which functions drain the queue.
    pub path: QueuePath,
}

/// Which functions a consumer drains its queue through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QueuePath {
    /// The plane's own queue functions when the plane has them, else
    /// Supabase's `pgmq_public` (decided by the first drain).
    #[default]
    Auto,
    /// The plane's queue functions (`agent.idempotency_queue_take` and
    /// `_settle`): a batch is read and claimed in one transaction and
    /// settled in another, two round trips plus the effects; a message is
    /// archived if and only if its ending is journaled; a failed command is
    /// one dead letter; failures can be sent back after a fix. They need
    /// the privileges `agent.idempotency_queue_privileges` lists.
    Plane,
    /// Supabase's `pgmq_public` functions through the Data API, for a
    /// plane without its queue functions: a read, a claim, a journal and an
    /// archive per message, each its own request.
    DataApi,
}

impl ConsumerOptions {
    /// Options for `queue`, whose dead letters go to `dead_letter_queue`,
    /// of `organization_id`: scope `queue.<queue>`, 5 reads, batches of
    /// 10, 10 effects at once.
    pub fn new(
        queue: impl Into<String>,
        dead_letter_queue: impl Into<String>,
        organization_id: Uuid,
        timing: Timing,
    ) -> Self {
        let queue = queue.into();
        ConsumerOptions {
            scope: format!("queue.{queue}"),
            queue,
            dead_letter_queue: dead_letter_queue.into(),
            organization_id,
            timing,
            max_reads: 5,
            batch_size: 10,
            concurrency: 10,
            organizations: None,
            path: QueuePath::Auto,
        }
    }
}

/// What one message's effect is given.
#[derive(Debug, Clone)]
pub struct MessageContext {
    /// The message as read; `None` for work re-driven from the plane (its
    /// worker stopped, or an operator sent its failure back after a fix),
    /// whose message was archived or is still hidden.
    pub message: Option<QueueMessage>,
    /// The claim: its key is the message's idempotency key.
    pub claim: Claim,
    /// The tenant's key for this message, to send downstream as
    /// `Idempotency-Key` ([`vendor_key`]).
    pub vendor_key: String,
}

/// What one drain did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Drained {
    /// Messages read.
    pub read: usize,
    /// Messages whose effect this worker ran (whatever its ending).
    pub ran: usize,
    /// Messages whose effect had ended before: not run again.
    pub replayed: usize,
    /// Messages this worker ran that did not end journaled as a success.
    pub failed: usize,
    /// Messages archived: their answer is journaled, or they were sent to
    /// the dead-letter queue.
    pub archived: usize,
    /// Messages sent to the dead-letter queue.
    pub dead_lettered: usize,
    /// Messages left in the queue: they come back when their visibility passes.
    pub left: usize,
    /// Claims run again from the plane without a message: their worker
    /// stopped, or an operator sent their failure back after a fix.
    pub redriven: usize,
}

/// A message's idempotency key and payload: the producer's key when it
/// gave one; else the message id, which catches redeliveries but not a
/// producer's duplicates. `None` for a message no key can be read from.
fn key_and_payload(message: &QueueMessage) -> Option<(String, Value)> {
    let body = message.message.as_object()?;
    let payload = body.get("payload").cloned().unwrap_or(Value::Null);
    match body.get("idempotency_key") {
        Some(Value::String(key)) if !key.is_empty() && key.chars().count() <= MAX_KEY_CHARS && !key.contains('\0') => {
            Some((key.clone(), payload))
        }
        None | Some(Value::Null) => Some((format!("msg-{}", message.msg_id), payload)),
        Some(_) => None,
    }
}

/// A Supabase Queues consumer whose effects happen once per idempotency key.
#[derive(Debug)]
pub struct QueueConsumer<R> {
    pub(super) driver: EffectDriver<R>,
    queues: Queues,
    pub(super) options: ConsumerOptions,
    /// Under [`QueuePath::Auto`]: whether the plane has its queue
    /// functions, once a drain found out.
    in_plane: std::sync::OnceLock<bool>,
}

impl<R: IdempotencyRepository + BatchClaims + PlaneQueues + 'static> QueueConsumer<R> {
    /// A consumer of `options.queue`, claiming through `driver`.
    pub fn new(driver: EffectDriver<R>, queues: Queues, options: ConsumerOptions) -> Result<Self, Error> {
        let cap = driver.service().repository().max_batch();
        if options.batch_size == 0 || u64::from(options.batch_size) > cap {
            return Err(Error::Store(crate::postgrest::ClientError::BoundAboveCap {
                bound: u64::from(options.batch_size),
                cap,
            }));
        }
        Ok(QueueConsumer { driver, queues, options, in_plane: std::sync::OnceLock::new() })
    }

    /// Drains one batch: reads up to `batch_size` messages, hidden for the
    /// claim's whole lease and a second; claims them in one round trip
    /// under each message's idempotency key; runs `process` for the
    /// messages this worker now holds (not for one read more than
    /// `max_reads` times: that one is journaled as the failure
    /// `dead_lettered`); journals their endings in one round trip; then
    /// archives exactly the messages whose answer is journaled as a success
    /// (or replayed one), and sends to the dead-letter queue, then
    /// archives, those whose answer is a failure or whose key answers for
    /// another payload. Every other message is left, to come back when its
    /// visibility passes. An error only when the batch could not be read or
    /// claimed at all.
    pub async fn drain<F, Fut>(&self, process: F) -> Result<Drained, Error>
    where
        F: Fn(Value, MessageContext) -> Fut,
        Fut: Future<Output = Settle>,
    {
        let span = tracing::info_span!(
            "idempotency.queue.drain",
            queue = %self.options.queue, idempotency.scope = %self.options.scope,
            read = tracing::field::Empty, ran = tracing::field::Empty, redriven = tracing::field::Empty,
            error.type = tracing::field::Empty, otel.status_code = tracing::field::Empty
        );
        let drained = self.drain_in_span(process).instrument(span.clone()).await;
        match &drained {
            Ok(drained) => {
                span.record("read", crate::telemetry::span_count(drained.read));
                span.record("ran", crate::telemetry::span_count(drained.ran));
                span.record("redriven", crate::telemetry::span_count(drained.redriven));
            }
            Err(error) => crate::telemetry::record_error(&span, error.kind()),
        }
        drained
    }

    /// [`drain`](Self::drain), inside its span: the take's traceparent is
    /// that span's.
    async fn drain_in_span<F, Fut>(&self, process: F) -> Result<Drained, Error>
    where
        F: Fn(Value, MessageContext) -> Fut,
        Fut: Future<Output = Settle>,
    {
        let in_plane = match self.options.path {
            QueuePath::Plane => true,
            QueuePath::DataApi => false,
            QueuePath::Auto => match self.in_plane.get() {
                Some(in_plane) => *in_plane,
                None => match self.drain_in_plane(&process).await {
                    Err(Error::Store(error)) if error.code() == Some(codes::PGRST202) => {
                        tracing::info!(queue = %self.options.queue, "the plane has no queue functions; draining through pgmq_public");
                        let _ = self.in_plane.set(false);
                        false
                    }
                    drained => {
                        if drained.is_ok() {
                            let _ = self.in_plane.set(true);
                        }
                        return drained;
                    }
                },
            },
        };
        if in_plane {
            return self.drain_in_plane(&process).await;
        }
        self.drain_through_data_api(process).await
    }

    /// [`drain`](Self::drain) through Supabase's `pgmq_public`.
    async fn drain_through_data_api<F, Fut>(&self, process: F) -> Result<Drained, Error>
    where
        F: Fn(Value, MessageContext) -> Fut,
        Fut: Future<Output = Settle>,
    {
        let options = &self.options;
        // Hidden for the whole lease and a second more, as the TypeScript
        // consumer hides it.
        let lease_seconds = options.timing.lease().as_millis().div_ceil(1000) + 1;
        let visibility = u32::try_from(lease_seconds).unwrap_or(u32::MAX);
        let ReadBatch { messages, unreadable } =
            self.queues.read(&options.queue, visibility, options.batch_size).await?;
        let mut drained = Drained { read: messages.len() + unreadable.len(), ..Drained::default() };
        // A message no client can read is dead-lettered alone, as its text;
        // the rest of its batch runs.
        for message in &unreadable {
            let letter = json!({"dead_letter": {
                "queue": options.queue, "msg_id": message.msg_id, "reads": message.read_ct,
                "message_text": message.text,
                "failure": {"ok": false, "error": "malformed_message", "output": {"reason": message.reason}},
            }});
            self.send_letter(message.msg_id, &letter, "malformed_message", &mut drained).await;
        }
        let mut malformed = Vec::new();
        let mut batch = Vec::new();
        for message in messages {
            match key_and_payload(&message) {
                Some((key, payload)) => {
                    let hash = RequestHash::of_json(&payload);
                    batch.push((message, key, payload, hash));
                }
                None => malformed.push(message),
            }
        }
        for message in &malformed {
            let failure = Answer::failure("malformed_message", Value::Null);
            self.dead_letter(message, &failure, &mut drained).await;
        }
        if batch.is_empty() {
            return Ok(drained);
        }
        let items: Vec<BatchItem<'_>> =
            batch.iter().map(|(_, key, _, hash)| BatchItem { key, request_hash: hash, request: None }).collect();
        let spec = Batch {
            organization_id: options.organization_id,
            scope: &options.scope,
            timing: options.timing,
            items: &items,
        };
        let batch = &batch;
        let process = &process;
        let report: BatchReport = self
            .driver
            .drive_many(&spec, options.concurrency, |index, claim| async move {
                let (message, _, payload, _) = &batch[index];
                if message.read_ct > options.max_reads {
                    let reads = json!({"reads": message.read_ct, "max_reads": options.max_reads});
                    return Settle::Journal(Answer::failure("dead_lettered", reads));
                }
                let vendor_key = vendor_key(claim.organization_id(), claim.scope(), claim.key());
                let context = MessageContext { message: Some(message.clone()), claim, vendor_key };
                process(payload.clone(), context).await
            })
            .await?;
        for (item, (message, key, _, _)) in report.items.iter().zip(batch) {
            match item {
                ItemEnding::Ran(settled) => {
                    drained.ran += 1;
                    if !settled.journaled().is_some_and(|answer| answer.ok) {
                        drained.failed += 1;
                    }
                }
                ItemEnding::Replayed(_) => drained.replayed += 1,
                ItemEnding::InFlight { .. } | ItemEnding::Conflict => {}
            }
            match (item.answer(), item) {
                (Some(answer), _) if answer.ok => self.archive(message.msg_id, &mut drained).await,
                (Some(answer), _) => self.dead_letter(message, answer, &mut drained).await,
                (None, ItemEnding::Conflict) => {
                    let failure = Answer::failure("conflict", json!({"key": key}));
                    self.dead_letter(message, &failure, &mut drained).await;
                }
                (None, _) => drained.left += 1,
            }
        }
        tracing::info!(
            queue = %options.queue, scope = %options.scope, read = drained.read, ran = drained.ran,
            replayed = drained.replayed, failed = drained.failed, archived = drained.archived,
            dead_lettered = drained.dead_lettered, left = drained.left, "queue drained"
        );
        Ok(drained)
    }

    /// Archives `message`; one that fails to archive is left, and comes back
    /// to replay its answer.
    async fn archive(&self, msg_id: i64, drained: &mut Drained) {
        match self.queues.archive(&self.options.queue, msg_id).await {
            Ok(true) => drained.archived += 1,
            // Not in the queue any more: another consumer archived it.
            Ok(false) => {}
            Err(error) => {
                drained.left += 1;
                tracing::warn!(queue = %self.options.queue, msg_id, %error, "archiving failed; the message comes back and replays");
            }
        }
    }

    /// Sends `message` with `failure` to the dead-letter queue, then
    /// archives it. A worker stopped between the two sends it again on the
    /// message's next delivery: a dead-letter queue may hold a message
    /// twice, under one idempotency key.
    async fn dead_letter(&self, message: &QueueMessage, failure: &Answer, drained: &mut Drained) {
        let mut letter = match &message.message {
            Value::Object(body) => body.clone(),
            _ => serde_json::Map::new(),
        };
        letter.insert(
            "dead_letter".into(),
            json!({"queue": self.options.queue, "msg_id": message.msg_id, "reads": message.read_ct,
                   "message": message.message,
                   "failure": {"ok": failure.ok, "error": failure.error, "output": failure.output}}),
        );
        let reason = failure.error.as_deref().unwrap_or("failed");
        self.send_letter(message.msg_id, &Value::Object(letter), reason, drained).await;
    }

    /// Sends `letter` for message `msg_id` to the dead-letter queue, then
    /// archives the message; one whose letter could not be sent is left.
    async fn send_letter(&self, msg_id: i64, letter: &Value, reason: &str, drained: &mut Drained) {
        if let Err(error) = self.queues.send(&self.options.dead_letter_queue, letter).await {
            drained.left += 1;
            tracing::warn!(queue = %self.options.queue, msg_id, %error, "sending to the dead-letter queue failed; the message comes back");
            return;
        }
        drained.dead_lettered += 1;
        tracing::warn!(queue = %self.options.queue, msg_id, drop_reason = reason, "dead-lettered");
        self.archive(msg_id, drained).await;
    }
}
