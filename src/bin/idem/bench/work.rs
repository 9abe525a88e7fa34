//! What the work that outlives its worker costs: a claim that carries a
//! 4 KiB request against one that carries none, a heartbeat, a re-drive of
//! 10,000 orphans by four re-drivers, and the WAL and disk a million claims
//! with their work would take.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency_plane::repo::{ClaimCall, IdempotencyRepository, OrphanedWork, RedriveCall};
use idempotency_plane::{PostgrestClient, PostgrestRepository, RequestHash};
use serde::Serialize;
use serde_json::{json, Value};
use sqlx::{Executor, PgPool};
use uuid::Uuid;

use super::drive::{alternating, drive, own_pool, SEGMENTS};
use super::figure::Figure;
use crate::BoxError;

/// The scope the work scenarios claim in: a member of the seeded
/// `webhook.*` family (384 KiB of work at most).
const SCOPE: &str = "webhook.bench";

/// The request a claim carries in the payload scenarios: a webhook
/// delivery's body of about 4 KiB, as a gate stores it (`body_text`): a
/// payment provider's invoice event with its lines, `n` making each one's
/// ids its own. Realistic JSON, which compresses as real deliveries do
/// (random hex would not).
pub(super) fn four_kib_request(n: u64) -> Value {
    let lines: Vec<Value> = (0..8u64)
        .map(|line| {
            json!({
                "id": format!("il_1Pq{n:08}L{line:02}xYzAbCdEf"),
                "object": "line_item",
                "amount": 1200 + line * 350,
                "currency": "usd",
                "description": format!("1 x Team plan seat (at $12.00 / month), line {line}"),
                "discountable": true,
                "livemode": false,
                "metadata": {"seat": format!("seat-{line}"), "workspace": format!("ws_{n:08}")},
                "period": {"end": 1_735_689_600 + line, "start": 1_733_011_200 + line},
                "plan": {"id": "price_1PqTeamMonthly", "interval": "month", "product": "prod_TeamPlan"},
                "proration": false,
                "quantity": 1,
                "type": "subscription"
            })
        })
        .collect();
    let event = json!({
        "id": format!("evt_1Pq{n:08}AbCdEfGhIjKl"),
        "object": "event",
        "api_version": "2024-06-20",
        "created": 1_733_011_200 + n,
        "type": "invoice.payment_succeeded",
        "livemode": false,
        "pending_webhooks": 1,
        "request": {"id": format!("req_{n:012}"), "idempotency_key": format!("inv-{n}")},
        "data": {"object": {
            "id": format!("in_1Pq{n:08}MnOpQrSt"),
            "object": "invoice",
            "account_country": "US",
            "account_name": "Acme Analytics, Inc.",
            "amount_due": 12_400,
            "amount_paid": 12_400,
            "billing_reason": "subscription_cycle",
            "collection_method": "charge_automatically",
            "currency": "usd",
            "customer": format!("cus_{n:010}"),
            "customer_email": format!("billing+{n}@example.com"),
            "customer_name": "Example Customer",
            "hosted_invoice_url": format!("https://invoice.example.com/i/acct_1Pq/test_{n:016}"),
            "lines": {"object": "list", "data": lines, "has_more": false, "total_count": 8},
            "paid": true,
            "status": "paid",
            "subscription": format!("sub_1Pq{n:08}"),
            "total": 12_400
        }}
    });
    json!({"body_text": event.to_string()})
}

/// One measurement of the work scenarios that is not a latency.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Measure {
    pub(super) name: String,
    pub(super) value: f64,
    pub(super) unit: &'static str,
}

pub(super) fn measure(name: &str, value: f64, unit: &'static str) -> Measure {
    Measure { name: name.to_owned(), value, unit }
}

/// First claims carrying a 4 KiB request against first claims carrying
/// none, in alternating segments on `workers` tasks.
pub(super) async fn claims_with_work(
    repo: Arc<PostgrestRepository>,
    workers: usize,
    duration: Duration,
) -> Result<(Figure, Figure), BoxError> {
    let org = Uuid::new_v4();
    let hash = RequestHash::of_json(&json!({"bench": "work"})).as_str().to_owned();
    let request = Arc::new(four_kib_request(1));
    let segment = duration / SEGMENTS;
    let (with, without) = alternating(|carries, round| {
        let (repo, hash, request) = (repo.clone(), hash.clone(), request.clone());
        drive(workers, segment, move |worker, i| {
            let (repo, hash, request) = (repo.clone(), hash.clone(), request.clone());
            async move {
                let key = format!("work-{carries}-{round}-{worker}-{i}");
                let call = ClaimCall {
                    organization_id: org,
                    scope: SCOPE,
                    key: &key,
                    request_hash: &hash,
                    lease_token: Uuid::new_v4(),
                    lease: Duration::from_secs(60),
                    request: carries.then_some(request.as_ref()),
                };
                repo.claim(&call).await?;
                Ok(())
            }
        })
    })
    .await?;
    Ok((
        Figure::from("claim carrying 4 KiB of work", with.0, with.1),
        Figure::from("claim carrying no work", without.0, without.1),
    ))
}

/// Heartbeats on `workers` held claims, each extended again and again for
/// `duration`; and the HTTP requests one heartbeat costs.
pub(super) async fn heartbeats(
    client: &PostgrestClient,
    repo: Arc<PostgrestRepository>,
    workers: usize,
    duration: Duration,
) -> Result<(Figure, Measure), BoxError> {
    let org = Uuid::new_v4();
    let hash = RequestHash::of_json(&json!({"bench": "heartbeat"})).as_str().to_owned();
    let mut held = Vec::with_capacity(workers);
    for worker in 0..workers {
        let (key, token) = (format!("beating-{worker}"), Uuid::new_v4());
        let call = ClaimCall {
            organization_id: org,
            scope: SCOPE,
            key: &key,
            request_hash: &hash,
            lease_token: token,
            lease: Duration::from_secs(30),
            request: None,
        };
        held.push((repo.claim(&call).await?.id, token));
    }
    let held = Arc::new(held);
    let before = client.requests_sent();
    let (latencies, elapsed) = drive(workers, duration, move |worker, _| {
        let (repo, held) = (repo.clone(), held.clone());
        async move {
            let (id, token) = held[worker];
            match repo.extend(org, id, token, Duration::from_secs(30)).await? {
                Some(_) => Ok(()),
                None => Err("a heartbeat found its own claim taken over".into()),
            }
        }
    })
    .await?;
    let trips = (client.requests_sent() - before) as f64 / latencies.len().max(1) as f64;
    Ok((Figure::from("heartbeat (extend)", latencies, elapsed), measure("round trips: heartbeat", trips, "HTTP")))
}

/// Orphans the re-drive throughput is measured on.
const ORPHANS: i64 = 10_000;

/// Concurrent re-drivers.
const REDRIVERS: usize = 4;

/// `ORPHANS` orphans carrying 1 KiB of work each, taken over by
/// `REDRIVERS` concurrent re-drivers, each asking for the row cap per call
/// until none is left: orphans taken over per second, and that every orphan
/// went to exactly one re-driver.
pub(super) async fn redrive_throughput(db: &PgPool, client: &PostgrestClient) -> Result<Measure, BoxError> {
    let org = Uuid::new_v4();
    db.execute(
        sqlx::query(
            "insert into agent.idempotency_keys
               (organization_id, scope, key, request_hash, status, lease_token, claimed_at, lease_expires_at,
                retain_until, request, redrive_at)
             select $1, $2, 'orphan-' || i, repeat('c', 64), 'processing', gen_random_uuid(),
                    now() - interval '1 minute', now() - interval '1 second', now() + interval '1 day',
                    jsonb_build_object('body_text', repeat('w', 1024)), now() - interval '1 second'
               from generate_series(1, $3) i",
        )
        .bind(org)
        .bind(SCOPE)
        .bind(ORPHANS),
    )
    .await?;
    db.execute("analyze agent.idempotency_keys").await?;
    let bound = u64::from(client.config().max_rows());
    let started = Instant::now();
    let redrivers: Vec<_> = (0..REDRIVERS)
        .map(|_| {
            let repo = PostgrestRepository::new(client.clone());
            tokio::spawn(async move {
                let mut taken = 0usize;
                loop {
                    let tokens: Vec<Uuid> = (0..bound).map(|_| Uuid::new_v4()).collect();
                    let call = RedriveCall {
                        scope: SCOPE,
                        lease_tokens: &tokens,
                        lease: Duration::from_secs(60),
                        organization_id: Some(org),
                    };
                    let rows = repo.redrive(&call).await?;
                    if rows.is_empty() {
                        return Ok::<_, BoxError>(taken);
                    }
                    taken += rows.len();
                }
            })
        })
        .collect();
    let mut taken = 0;
    for redriver in redrivers {
        taken += redriver.await??;
    }
    let elapsed = started.elapsed();
    if taken as i64 != ORPHANS {
        return Err(format!("{REDRIVERS} re-drivers took {taken} of {ORPHANS} orphans").into());
    }
    eprintln!("  {REDRIVERS} re-drivers took over {taken} orphans in {:.2} s", elapsed.as_secs_f64());
    Ok(measure("re-drive: orphans taken over per second", taken as f64 / elapsed.as_secs_f64(), "/s"))
}

/// Claims per side of the WAL and disk figures.
const WRITTEN_CLAIMS: i64 = 20_000;

/// The WAL written and the disk taken (table, TOAST and indexes) per
/// million first claims, carrying a 4 KiB request (a webhook delivery's
/// JSON, [`four_kib_request`], compressed as the server compresses the work
/// column: lz4 where it has it) and carrying none; each
/// claim its own statement and transaction, as the plane receives them.
/// The WAL is the cluster's: measure on a quiet one.
pub(super) async fn wal_and_disk(db: &PgPool) -> Result<Vec<Measure>, BoxError> {
    let pool = own_pool(db).await?;
    let mut measures = Vec::new();
    for carries in [false, true] {
        let org = Uuid::new_v4();
        let size = "select pg_total_relation_size('agent.idempotency_keys')::int8";
        let lsn = "select pg_current_wal_lsn()::text";
        let disk_before: i64 = sqlx::query_scalar(size).fetch_one(&pool).await?;
        let wal_before: String = sqlx::query_scalar(lsn).fetch_one(&pool).await?;
        let workers = 8;
        let per_worker = WRITTEN_CLAIMS / workers as i64;
        let tasks: Vec<_> = (0..workers)
            .map(|worker| {
                let pool = pool.clone();
                tokio::spawn(async move {
                    for i in 0..per_worker {
                        let n = (worker as u64) * 1_000_000 + i as u64;
                        sqlx::query(
                            "select agent.idempotency_claim($1, $2, $3, repeat('d', 64), gen_random_uuid(), 60000, $4)",
                        )
                        .bind(org)
                        .bind(SCOPE)
                        .bind(format!("written-{worker}-{i}"))
                        .bind(carries.then(|| four_kib_request(n)))
                        .execute(&pool)
                        .await?;
                    }
                    Ok::<_, BoxError>(())
                })
            })
            .collect();
        for task in tasks {
            task.await??;
        }
        let wal: f64 = sqlx::query_scalar("select pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::float8")
            .bind(&wal_before)
            .fetch_one(&pool)
            .await?;
        let disk_after: i64 = sqlx::query_scalar(size).fetch_one(&pool).await?;
        let per_million = |bytes: f64| bytes / (per_worker * workers as i64) as f64 * 1_000_000.0 / (1024.0 * 1024.0);
        let what = if carries { "with 4 KiB of work" } else { "without work" };
        measures.push(measure(&format!("WAL per million claims {what}"), per_million(wal), "MiB"));
        measures.push(measure(
            &format!("disk per million claims {what}"),
            per_million((disk_after - disk_before) as f64),
            "MiB",
        ));
    }
    Ok(measures)
}
