//! Supabase Queues (pgmq) consumed effectively once.
//!
//! pgmq delivers at least once: a message whose visibility timeout passes
//! before it is archived comes back to the next reader, and a producer's
//! retry is a second message. [`QueueConsumer::drain`] claims each message
//! in the plane, before its effect runs, under the producer's idempotency
//! key (`{"idempotency_key": …, "payload": …}`), all of a batch in one round
//! trip; runs the effects this worker now holds; journals their endings in
//! one round trip; and archives exactly the messages whose answer is
//! journaled, sending failures for good to a dead-letter queue. A
//! redelivery or a duplicate finds the claim held (and is left) or its
//! answer journaled (and is archived without running). The TypeScript
//! client's `QueueConsumer` does the same, for Edge Functions.
//!
//! Queues are reached as Supabase serves them, through the `pgmq_public`
//! functions of its Data API ([`Queues`], beside the plane's repository in
//! [`crate::repo`], re-exported here), with the service role.

mod consumer;
mod in_plane;

pub use crate::repo::{QueueMessage, Queues, ReadBatch, UnreadableMessage, QUEUES_SCHEMA};
pub use consumer::{ConsumerOptions, Drained, MessageContext, QueueConsumer, QueuePath};
