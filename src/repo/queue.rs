//! A pgmq queue taken and settled by the plane itself: messages read and
//! claimed in one transaction, endings journaled and messages archived in
//! one transaction (`agent.idempotency_queue_take`, `_settle`, `_extend`).

use std::future::Future;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::Value;
use uuid::Uuid;

use super::CompletionArgs;
use crate::error::Error;

/// One take: up to one message per lease token, read from `queue` and
/// claimed under each message's idempotency key in `scope`.
#[derive(Debug, Clone, Copy)]
pub struct QueueTakeCall<'a> {
    /// The pgmq queue read.
    pub queue: &'a str,
    /// Where messages no client can read, conflicts and failed commands go.
    pub dead_letter_queue: &'a str,
    /// The organization of a message that names none.
    pub organization_id: Option<Uuid>,
    /// The organizations whose messages this consumer takes, when a queue
    /// is shared by tenants (each message's `organization_id`); by default
    /// `organization_id` alone.
    pub organizations: Option<&'a [Uuid]>,
    /// The plane scope the messages are claimed in.
    pub scope: &'a str,
    /// Each claim's lease; a message is hidden for it and a second more.
    pub lease: Duration,
    /// One fresh token per message (or re-driven claim) the take may hold:
    /// their number is the batch's size, at most the row cap.
    pub lease_tokens: &'a [Uuid],
    /// Reads after which a claimed message is journaled as the failure
    /// `dead_lettered` instead of run.
    pub max_reads: i32,
}

/// What a take did with one message, or with one claim it re-drove.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TakeOutcome {
    /// Claimed afresh: run it under the answered lease token.
    Claimed,
    /// Taken over from a worker whose lease passed: run it again.
    Reclaimed,
    /// No message: the scope's work whose worker stopped, or that an
    /// operator sent back after a fix, taken over: run its payload.
    Redriven,
    /// Its answer was journaled before (or now: read too often, or
    /// re-driven as often as its scope allows): archived, never run again.
    Completed,
    /// A later message of this batch under the key of an earlier one, with
    /// the same payload: it ends with that message (`copy_of`).
    Copy,
    /// Held by another worker: left in the queue, to come back.
    Processing,
    /// Its key answers for another payload: dead-lettered and archived.
    Conflict,
    /// No client could read or hash it (`reason` says why):
    /// dead-lettered alone and archived.
    Malformed,
}

/// One row of a take's answer, in message order, re-driven claims last.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct TakenItem {
    /// The message's id; `None` for a re-driven claim.
    pub msg_id: Option<i64>,
    /// How often the message was read, this read included.
    pub read_ct: Option<i32>,
    /// When the message was sent.
    pub enqueued_at: Option<DateTime<Utc>>,
    /// The message, for one to run (claimed or reclaimed).
    pub message: Option<Value>,
    /// The message's organization.
    pub organization_id: Option<Uuid>,
    /// The message's idempotency key.
    pub key: Option<String>,
    /// What the take did.
    pub outcome: TakeOutcome,
    /// For a copy, the message it ends with.
    pub copy_of: Option<i64>,
    /// The claim.
    pub id: Option<Uuid>,
    /// The fence of a claim this take holds.
    pub lease_token: Option<Uuid>,
    /// When its lease ends.
    pub lease_expires_at: Option<DateTime<Utc>>,
    /// When the claim may be swept.
    pub retain_until: Option<DateTime<Utc>>,
    /// Whether the lease is live as the answer is made.
    pub lease_live: Option<bool>,
    /// A re-driven claim's attempt: 2 for its first re-drive.
    pub attempt: Option<i32>,
    /// A re-driven claim's payload.
    pub payload: Option<Value>,
    /// A replayed answer.
    pub response: Option<Value>,
    /// Whether the take archived the message.
    pub archived: bool,
    /// Whether the take sent it to the dead-letter queue.
    pub dead_lettered: bool,
    /// Why a message is malformed.
    pub reason: Option<String>,
    /// How many rows the answer holds: a cut answer is told from a whole one.
    pub taken: i64,
    /// For a claim to run (claimed, reclaimed, redriven): the W3C
    /// traceparent of the worker that first claimed it, when it sent one;
    /// the span that runs it again links to that trace. `None` from a plane
    /// older than this field.
    #[serde(default)]
    pub traceparent: Option<String>,
}

/// How a settle ends one claim.
#[derive(Debug, Clone, Copy)]
pub enum QueueEnding<'a> {
    /// Journal this answer, and archive the messages once it is journaled.
    Journal(CompletionArgs<'a>),
    /// Nothing happened: free the claim; its messages come back.
    Release,
    /// The outcome is unknown: leave the claim to its lease and the
    /// messages to their visibility.
    Leave,
}

/// One claim of a settle or a heartbeat, with its messages.
#[derive(Debug, Clone, Copy)]
pub struct QueueClaim<'a> {
    /// The claim's organization.
    pub organization_id: Uuid,
    /// The claim.
    pub claim_id: Uuid,
    /// The token that must still hold it.
    pub lease_token: Uuid,
    /// Its message and the message's copies; empty for a re-driven claim.
    pub msg_ids: &'a [i64],
}

/// What a settle did with one claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct QueueSettled {
    /// Whether its ending was journaled (by this call or, after a lost
    /// answer, by the one it repeats).
    pub journaled: bool,
    /// How many of its messages were archived.
    pub archived: i32,
    /// Whether this call sent its failure to the dead-letter queue.
    pub dead_lettered: bool,
}

/// The plane's queue functions. Implemented over PostgREST; a database
/// where pgmq or the plane's privileges on a queue are missing answers
/// errors naming what is missing.
pub trait PlaneQueues: Send + Sync {
    /// Reads and claims a batch in one transaction. Not repeated after a
    /// lost answer: what it took waits for its lease, as a stopped
    /// worker's would.
    fn queue_take(&self, call: &QueueTakeCall<'_>) -> impl Future<Output = Result<Vec<TakenItem>, Error>> + Send;

    /// Journals each claim's ending and archives exactly the messages whose
    /// ending it journaled, in one transaction, answered per claim in
    /// input order. Safe to repeat after a lost answer.
    fn queue_settle(
        &self,
        queue: &str,
        dead_letter_queue: &str,
        items: &[(QueueClaim<'_>, QueueEnding<'_>)],
    ) -> impl Future<Output = Result<Vec<QueueSettled>, Error>> + Send;

    /// Extends each claim's lease and hides its messages as long, in one
    /// transaction: each claim's new lease end, or `None` for one no longer
    /// this caller's.
    fn queue_extend(
        &self,
        queue: &str,
        lease: Duration,
        items: &[QueueClaim<'_>],
    ) -> impl Future<Output = Result<Vec<Option<DateTime<Utc>>>, Error>> + Send;
}
