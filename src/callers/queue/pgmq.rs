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

    /// Up to `n` messages of `queue`, each hidden from other readers for
    /// `visibility_seconds`.
    pub async fn read(&self, queue: &str, visibility_seconds: u32, n: u32) -> Result<Vec<QueueMessage>, ClientError> {
        let args = ReadArgs { queue_name: queue, sleep_seconds: visibility_seconds, n };
        self.client.rpc("read", &args, Repeat::of("read")).await
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
