//! Supabase Queues through its Data API: the `pgmq_public` functions.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::postgrest::{ClientConfig, ClientError, PostgrestClient, Repeat};

/// The schema Supabase's Data API serves the queue functions from.
pub const QUEUES_SCHEMA: &str = "pgmq_public";

/// One message as `pgmq_public.read` answers it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct QueueMessage {
    /// The message's id in its queue.
    pub msg_id: i64,
    /// How often it was read, this read included.
    pub read_ct: i32,
    /// When it was sent (database clock).
    pub enqueued_at: chrono::DateTime<chrono::Utc>,
    /// The message as the producer sent it.
    pub message: Value,
}

/// A message no client can read: its JSON holds a number no IEEE 754
/// double can hold (`1e400`, which a JavaScript reader takes for
/// infinity), so it cannot be hashed or handed on. Kept as its text, to be
/// dead-lettered alone.
#[derive(Debug, Clone, PartialEq)]
pub struct UnreadableMessage {
    /// The message's id in its queue.
    pub msg_id: i64,
    /// How often it was read, this read included.
    pub read_ct: i32,
    /// The message's JSON text, as the server sent it.
    pub text: String,
    /// Why it cannot be read.
    pub reason: String,
}

/// What one read answered: the messages, and those no client can read.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReadBatch {
    /// The messages, in the order read.
    pub messages: Vec<QueueMessage>,
    /// The messages no client can read.
    pub unreadable: Vec<UnreadableMessage>,
}

/// A row of `pgmq_public.read`, its message left as JSON text until each
/// is read on its own: one unreadable message must not fail the batch.
#[derive(Deserialize)]
struct ReadRow {
    msg_id: i64,
    read_ct: i32,
    enqueued_at: chrono::DateTime<chrono::Utc>,
    message: Box<serde_json::value::RawValue>,
}

/// pgmq's queues over PostgREST, as Supabase exposes them: `read`, `send`,
/// `archive`, `delete` of schema `pgmq_public`. None is repeated after a
/// lost answer (a read that landed hid its messages; a send that landed is
/// a message): each is retried only when the server proves it never ran.
#[derive(Debug, Clone)]
pub struct Queues {
    client: PostgrestClient,
}

#[derive(Serialize)]
struct ReadArgs<'a> {
    queue_name: &'a str,
    sleep_seconds: u32,
    n: u32,
}

#[derive(Serialize)]
struct MessageArgs<'a> {
    queue_name: &'a str,
    message_id: i64,
}

#[derive(Serialize)]
struct SendArgs<'a> {
    queue_name: &'a str,
    message: &'a Value,
    sleep_seconds: u32,
}

impl Queues {
    /// Queues over the server `config` names; its schema is set to
    /// [`QUEUES_SCHEMA`].
    pub fn new(config: ClientConfig) -> Result<Self, ClientError> {
        Ok(Queues { client: PostgrestClient::new(config.with_schema(QUEUES_SCHEMA))? })
    }

    /// HTTP requests sent so far, retries included.
    pub fn requests_sent(&self) -> u64 {
        self.client.requests_sent()
    }

    /// Up to `n` messages of `queue`, each hidden from other readers for
    /// `visibility_seconds`.
    /// A message whose JSON no client can read is answered apart, as its
    /// text ([`ReadBatch::unreadable`]).
    pub async fn read(&self, queue: &str, visibility_seconds: u32, n: u32) -> Result<ReadBatch, ClientError> {
        let args = ReadArgs { queue_name: queue, sleep_seconds: visibility_seconds, n };
        let rows: Vec<ReadRow> = self.client.rpc("read", &args, Repeat::of("read")).await?;
        let mut batch = ReadBatch::default();
        for row in rows {
            let read = serde_json::from_str::<Value>(row.message.get()).map_err(|error| error.to_string()).and_then(
                |message| match beyond_doubles(&message) {
                    true => {
                        Err("it holds a number beyond every IEEE 754 double, which a client reads as infinity".into())
                    }
                    false => Ok(message),
                },
            );
            match read {
                Ok(message) => batch.messages.push(QueueMessage {
                    msg_id: row.msg_id,
                    read_ct: row.read_ct,
                    enqueued_at: row.enqueued_at,
                    message,
                }),
                Err(error) => batch.unreadable.push(UnreadableMessage {
                    msg_id: row.msg_id,
                    read_ct: row.read_ct,
                    text: row.message.get().to_owned(),
                    reason: format!("the message is not JSON every client can read: {error}"),
                }),
            }
        }
        Ok(batch)
    }

    /// Moves message `msg_id` of `queue` to its archive; false when it is
    /// not in the queue.
    pub async fn archive(&self, queue: &str, msg_id: i64) -> Result<bool, ClientError> {
        self.client.rpc("archive", &MessageArgs { queue_name: queue, message_id: msg_id }, Repeat::of("archive")).await
    }

    /// Deletes message `msg_id` of `queue`; false when it is not in the queue.
    pub async fn delete(&self, queue: &str, msg_id: i64) -> Result<bool, ClientError> {
        self.client.rpc("delete", &MessageArgs { queue_name: queue, message_id: msg_id }, Repeat::of("delete")).await
    }

    /// Sends `message` to `queue` and answers its id. pgmq keeps every
    /// send: a repeat is a second message.
    pub async fn send(&self, queue: &str, message: &Value) -> Result<i64, ClientError> {
        let args = SendArgs { queue_name: queue, message, sleep_seconds: 0 };
        let ids: Vec<i64> = self.client.rpc("send", &args, Repeat::of("send")).await?;
        ids.first().copied().ok_or(ClientError::Decode { function: "send", reason: "answered no message id".into() })
    }
}

/// Whether `value` holds a number no IEEE 754 double holds (`1e400`): one a
/// JavaScript client reads as infinity, and this crate, built with
/// serde_json's `arbitrary_precision` (as its `local` feature's server
/// is), reads as digits. No client can hash it alike, so it is refused
/// whichever way it was read.
fn beyond_doubles(value: &Value) -> bool {
    match value {
        Value::Number(number) => !number.as_f64().is_some_and(f64::is_finite),
        Value::Array(items) => items.iter().any(beyond_doubles),
        Value::Object(members) => members.values().any(beyond_doubles),
        Value::Null | Value::Bool(_) | Value::String(_) => false,
    }
}
