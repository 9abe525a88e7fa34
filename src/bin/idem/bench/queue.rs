//! The queue at pgmq's speed: the same queue of messages drained by four
//! workers in batches of 50, four ways in one run, on one stack with pgmq:
//!
//! - pgmq alone over direct SQL: read a batch, archive it (two statements,
//!   no plane): the floor;
//! - pgmq through the Data API as a consumer without the plane would use
//!   it: a read, then one archive per message (Supabase's `pgmq_public` has
//!   no batch archive);
//! - the plane's consumer through its queue functions (take, no-op effect,
//!   settle);
//! - the plane's consumer through `pgmq_public` (read, claim, journal,
//!   archive per message), for a plane without its queue functions.
//!
//! Each answers messages per second from the first read to the last
//! archive, and round trips per batch.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency_plane::callers::queue::{ConsumerOptions, QueueConsumer, QueuePath, Queues};
use idempotency_plane::local::{LocalStack, LocalStackConfig};
use idempotency_plane::service::{Answer, EffectDriver, Settle, Timing};
use idempotency_plane::{PostgrestClient, PostgrestRepository};
use serde_json::{json, Value};
use uuid::Uuid;

use super::drive::own_pool;
use super::work::{measure, Measure};
use crate::BoxError;

/// The queue drained, and its dead-letter queue.
const QUEUE: &str = "bench";
const DLQ: &str = "bench_dlq";
/// Workers per scenario, and messages per batch.
const WORKERS: usize = 4;
const BATCH: usize = 50;

/// What one scenario did: messages drained, batches that read any, round
/// trips those batches took.
#[derive(Default)]
struct Tally {
    messages: AtomicU64,
    batches: AtomicU64,
    trips: AtomicU64,
}

impl Tally {
    fn add(&self, messages: usize, trips: u64) {
        self.messages.fetch_add(messages as u64, Ordering::Relaxed);
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.trips.fetch_add(trips, Ordering::Relaxed);
    }
}

/// The four scenarios over a queue of `messages`, on a stack of their own.
pub(super) async fn queue_paths(messages: usize) -> Result<Vec<Measure>, BoxError> {
    let stack = LocalStack::start(LocalStackConfig::default().with_queues([QUEUE, DLQ])).await?;
    let result = scenarios(&stack, messages).await;
    stack.stop().await?;
    result
}

async fn scenarios(stack: &LocalStack, messages: usize) -> Result<Vec<Measure>, BoxError> {
    let mut measures = Vec::new();
    let pool = own_pool(stack.db()).await?;

    fill(stack, messages).await?;
    let (rate, trips) = timed(messages, |tally| {
        let pool = pool.clone();
        async move {
            loop {
                let ids: Vec<i64> = sqlx::query_scalar("select msg_id from pgmq.read($1, 30, $2)")
                    .bind(QUEUE)
                    .bind(BATCH as i32)
                    .fetch_all(&pool)
                    .await?;
                if ids.is_empty() {
                    return Ok(());
                }
                sqlx::query("select pgmq.archive($1, $2::bigint[])").bind(QUEUE).bind(&ids).execute(&pool).await?;
                tally.add(ids.len(), 2);
            }
        }
    })
    .await?;
    measures.push(measure("queue: pgmq alone, direct SQL (the floor)", rate, "msg/s"));
    measures.push(measure("queue: round trips per batch, pgmq direct SQL", trips, "trips"));

    fill(stack, messages).await?;
    let http = data_api(stack)?;
    let (rate, trips) = timed(messages, |tally| {
        let (http, base) = (http.clone(), stack.url().to_owned());
        async move {
            loop {
                let read: Vec<Value> = http
                    .post(format!("{base}/rpc/read"))
                    .json(&json!({"queue_name": QUEUE, "sleep_seconds": 30, "n": BATCH}))
                    .send()
                    .await?
                    .error_for_status()?
                    .json()
                    .await?;
                if read.is_empty() {
                    return Ok(());
                }
                let archives = read.iter().map(|message| {
                    let body = json!({"queue_name": QUEUE, "message_id": message["msg_id"]});
                    let request = http.post(format!("{base}/rpc/archive")).json(&body).send();
                    async move { request.await?.error_for_status().map(|_| ()) }
                });
                futures_util::future::try_join_all(archives).await?;
                tally.add(read.len(), 1 + read.len() as u64);
            }
        }
    })
    .await?;
    measures.push(measure("queue: pgmq through the Data API, no plane", rate, "msg/s"));
    measures.push(measure("queue: round trips per batch, Data API, no plane", trips, "trips"));

    for (path, name) in [(QueuePath::Plane, "plane's queue functions"), (QueuePath::DataApi, "pgmq_public")] {
        fill(stack, messages).await?;
        let org = Uuid::new_v4();
        let (rate, trips) = timed(messages, |tally| {
            let config = stack.client_config();
            async move {
                let config = config?;
                let client = PostgrestClient::new(config.clone())?;
                let queues_client = config.clone();
                let driver = EffectDriver::new(idempotency_plane::IdempotencyService::new(PostgrestRepository::new(
                    client.clone(),
                )));
                let timing = Timing::new(Duration::from_secs(10), Duration::from_secs(5), Duration::from_secs(2))?;
                let mut options = ConsumerOptions::new(QUEUE, DLQ, org, timing);
                options.batch_size = BATCH as u32;
                options.concurrency = BATCH;
                options.path = path;
                let queues = Queues::new(queues_client)?;
                let consumer = QueueConsumer::new(driver, queues.clone(), options)?;
                loop {
                    let before = client.requests_sent() + queues.requests_sent();
                    let drained =
                        consumer.drain(|_, _| async { Settle::Journal(Answer::success(json!({"ok": true}))) }).await?;
                    if drained.read == 0 {
                        return Ok(());
                    }
                    tally.add(drained.archived, client.requests_sent() + queues.requests_sent() - before);
                }
            }
        })
        .await?;
        measures.push(measure(&format!("queue: consumer through the {name}"), rate, "msg/s"));
        measures.push(measure(&format!("queue: round trips per batch, consumer, {name}"), trips, "trips"));
    }
    Ok(measures)
}

/// A Data API client with the service key, serving `pgmq_public`.
fn data_api(stack: &LocalStack) -> Result<reqwest::Client, BoxError> {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert("authorization", format!("Bearer {}", stack.service_key()).parse()?);
    headers.insert("content-profile", "pgmq_public".parse()?);
    headers.insert("content-type", "application/json".parse()?);
    Ok(reqwest::Client::builder().default_headers(headers).pool_max_idle_per_host(64).tcp_nodelay(true).build()?)
}

/// Puts `messages` orders on the queue, each under its own key.
async fn fill(stack: &LocalStack, messages: usize) -> Result<(), BoxError> {
    let batch: Vec<Value> =
        (0..messages).map(|n| json!({"idempotency_key": format!("order-{n}"), "payload": {"n": n}})).collect();
    for chunk in batch.chunks(1000) {
        sqlx::query("select pgmq.send_batch($1, $2::jsonb[])").bind(QUEUE).bind(chunk).execute(stack.db()).await?;
    }
    Ok(())
}

/// Runs [`WORKERS`] copies of `worker` until each finds the queue empty;
/// answers messages per second and round trips per batch. Every message
/// must have been drained.
async fn timed<F, Fut>(messages: usize, worker: F) -> Result<(f64, f64), BoxError>
where
    F: Fn(Arc<Tally>) -> Fut,
    Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
{
    let tally = Arc::new(Tally::default());
    let started = Instant::now();
    let tasks: Vec<_> = (0..WORKERS).map(|_| tokio::spawn(worker(tally.clone()))).collect();
    for task in tasks {
        task.await??;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let drained = tally.messages.load(Ordering::Relaxed);
    if drained != messages as u64 {
        return Err(format!("the workers drained {drained} of {messages} messages").into());
    }
    let batches = tally.batches.load(Ordering::Relaxed).max(1) as f64;
    Ok((drained as f64 / elapsed, tally.trips.load(Ordering::Relaxed) as f64 / batches))
}
