//! `idem bench`: the plane's cost, side by side in one run on one database.
//!
//! Absolute times on a shared machine are noise; the ratios between rows
//! measured in the same run are the result. Every figure is also written as
//! JSON. Not a test: nothing here asserts a timing.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency_plane::local::{LocalStack, LocalStackConfig};
use idempotency_plane::sweeper::Sweeper;
use idempotency_plane::{
    ClaimOutcome, Completion, IdempotencyService, PostgrestClient, PostgrestRepository, RequestHash,
};
use serde::Serialize;
use serde_json::{json, Value};
use sqlx::{Executor, PgPool, Row};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use uuid::Uuid;

use crate::BoxError;

/// Options of `idem bench`.
#[derive(Debug, clap::Args)]
pub(crate) struct BenchArgs {
    /// Concurrent workers per throughput scenario.
    #[arg(long, default_value_t = 16)]
    workers: usize,
    /// Seconds each throughput scenario runs.
    #[arg(long, default_value_t = 8)]
    seconds: u64,
    /// Rows already in the table for the large side of the growth figure.
    #[arg(long, default_value_t = 1_000_000)]
    growth_rows: i64,
    /// Expired rows the concurrent sweep deletes.
    #[arg(long, default_value_t = 100_000)]
    sweep_rows: i64,
    /// One-way delay of the simulated WAN link, in milliseconds.
    #[arg(long, default_value_t = 25)]
    wan_delay_ms: u64,
    /// Operations per outcome over the simulated WAN link.
    #[arg(long, default_value_t = 40)]
    wan_operations: usize,
    /// Where to write the raw figures as JSON.
    #[arg(long, default_value = "bench.json")]
    out: std::path::PathBuf,
}

/// Latencies of one scenario.
#[derive(Debug, Clone, Serialize)]
struct Figure {
    name: String,
    operations: usize,
    seconds: f64,
    per_second: f64,
    p50_ms: f64,
    p99_ms: f64,
}

impl Figure {
    fn from(name: &str, mut latencies: Vec<Duration>, elapsed: Duration) -> Figure {
        latencies.sort_unstable();
        let at = |q: f64| {
            latencies
                .get(((latencies.len() as f64 * q) as usize).min(latencies.len().saturating_sub(1)))
                .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
        };
        Figure {
            name: name.to_owned(),
            operations: latencies.len(),
            seconds: elapsed.as_secs_f64(),
            per_second: latencies.len() as f64 / elapsed.as_secs_f64().max(f64::EPSILON),
            p50_ms: at(0.50),
            p99_ms: at(0.99),
        }
    }
}

#[derive(Debug, Serialize)]
struct Results {
    workers: usize,
    seconds_per_scenario: u64,
    figures: Vec<Figure>,
    round_trips: Vec<(String, f64)>,
    wan: Vec<Figure>,
    ratios: Vec<Ratio>,
}

#[derive(Debug, Serialize)]
struct Ratio {
    name: String,
    value: f64,
    target: String,
    met: bool,
}

pub(crate) async fn run(args: BenchArgs) -> Result<ExitCode, BoxError> {
    let stack = LocalStack::start(LocalStackConfig::default()).await?;
    let result = bench(&stack, &args).await;
    stack.stop().await?;
    let results = result?;
    print(&results);
    std::fs::write(&args.out, serde_json::to_vec_pretty(&results)?)?;
    println!("\nraw figures: {}", args.out.display());
    Ok(crate::exit::ok())
}

async fn bench(stack: &LocalStack, args: &BenchArgs) -> Result<Results, BoxError> {
    let client = PostgrestClient::new(stack.client_config()?.with_pool_max_idle_per_host(args.workers))?;
    let service = Arc::new(IdempotencyService::new(PostgrestRepository::new(client.clone())));
    let duration = Duration::from_secs(args.seconds);
    let mut figures = Vec::new();
    eprintln!("warming up…");
    pairs_through_crate(service.clone(), args.workers, Duration::from_secs(1)).await?;

    eprintln!("claim → complete through the crate…");
    figures.push(pairs_through_crate(service.clone(), args.workers, duration).await?);
    eprintln!("the same two calls from a bare HTTP client…");
    figures.push(pairs_bare_http(stack, args.workers, duration).await?);
    eprintln!("the same SQL functions over direct connections, alternating with the floor…");
    let (direct, floor) = functions_against_floor(stack.db(), args.workers, duration).await?;
    figures.push(direct);
    figures.push(floor);
    eprintln!("the same SQL functions as SECURITY DEFINER, alternating with SECURITY INVOKER…");
    let (definer, invoker) = definer_against_invoker(stack.db(), args.workers, duration).await?;
    figures.push(definer);
    figures.push(invoker);
    eprintln!("replays and conflicts…");
    let (replay, conflict, cached, trips) =
        replays_and_conflicts(stack, &client, service.clone(), args.workers, duration).await?;
    figures.push(replay);
    figures.push(conflict);
    figures.push(cached);

    eprintln!("claim latency idle, then while a sweep deletes {} expired rows…", args.sweep_rows);
    let idle = claims(service.clone(), args.workers, duration, "claim idle").await?;
    let during = claims_during_sweep(stack, &client, service.clone(), args).await?;
    figures.push(idle.clone());
    figures.push(during.clone());

    eprintln!("growth: 10,000 rows, then {} rows…", args.growth_rows);
    fill_table(stack.db(), 10_000).await?;
    let small = claims(service.clone(), args.workers, duration, "claim at 10k rows").await?;
    fill_table(stack.db(), args.growth_rows).await?;
    let large = claims(service.clone(), args.workers, duration, "claim at large table").await?;
    figures.push(small.clone());
    figures.push(large.clone());

    let get = |name: &str| figures.iter().find(|f| f.name == name).cloned();
    eprintln!("each outcome over a link with {} ms each way…", args.wan_delay_ms);
    let wan = wan_outcomes(stack, args).await?;
    let wan_p50 = |name: &str| wan.iter().find(|f| f.name == name).map_or(f64::NAN, |f| f.p50_ms);

    let (crate_pairs, bare, direct, floor) = (
        get("pairs via crate").ok_or("missing figure")?,
        get("pairs via bare HTTP").ok_or("missing figure")?,
        get("pairs via direct SQL").ok_or("missing figure")?,
        get("pairs via floor SQL").ok_or("missing figure")?,
    );
    let (definer, invoker) = (
        get("pairs via direct SQL, definer").ok_or("missing figure")?,
        get("pairs via direct SQL, invoker").ok_or("missing figure")?,
    );
    let ratio = |name: &str, value: f64, target: &str, met: bool| Ratio {
        name: name.to_owned(),
        value,
        target: target.to_owned(),
        met,
    };
    let trip = |name: &str| trips.iter().find(|(n, _)| n == name).map_or(f64::NAN, |(_, v)| *v);
    let ratios = vec![
        {
            let v = crate_pairs.per_second / bare.per_second;
            ratio("pairs/s crate ÷ bare HTTP", v, "≥ 0.90", v >= 0.90)
        },
        {
            let v = crate_pairs.p50_ms / bare.p50_ms;
            ratio("p50 crate ÷ bare HTTP", v, "≤ 1.10", v <= 1.10)
        },
        {
            let v = bare.per_second / direct.per_second;
            ratio("pairs/s PostgREST server ÷ direct SQL", v, "≥ 0.50", v >= 0.50)
        },
        {
            let v = direct.per_second / floor.per_second;
            ratio("pairs/s functions (direct SQL) ÷ floor", v, "≥ 0.90", v >= 0.90)
        },
        {
            let v = definer.per_second / invoker.per_second;
            ratio("pairs/s SECURITY DEFINER ÷ INVOKER", v, "≥ 0.95", v >= 0.95)
        },
        ratio("round trips: first claim", trip("first claim"), "1", trip("first claim") == 1.0),
        ratio("round trips: replay", trip("replay"), "1", trip("replay") == 1.0),
        ratio("round trips: conflict", trip("conflict"), "1", trip("conflict") == 1.0),
        ratio("round trips: processing", trip("processing"), "1", trip("processing") == 1.0),
        ratio("round trips: reclaim", trip("reclaim"), "1", trip("reclaim") == 1.0),
        {
            let v = wan_p50("replay") / wan_p50("first claim");
            ratio("WAN p50 replay ÷ first claim", v, "≤ 1.15", v <= 1.15)
        },
        {
            let v = wan_p50("conflict") / wan_p50("first claim");
            ratio("WAN p50 conflict ÷ first claim", v, "≤ 1.15", v <= 1.15)
        },
        {
            let v = wan_p50("reclaim") / wan_p50("first claim");
            ratio("WAN p50 reclaim ÷ first claim", v, "≤ 1.15", v <= 1.15)
        },
        {
            let v = during.p99_ms / idle.p99_ms;
            ratio("claim p99 during sweep ÷ idle", v, "≤ 1.5", v <= 1.5)
        },
        {
            let v = large.p50_ms / small.p50_ms;
            ratio("claim p50 large table ÷ 10k rows", v, "≤ 1.2", v <= 1.2)
        },
    ];
    Ok(Results { workers: args.workers, seconds_per_scenario: args.seconds, figures, round_trips: trips, wan, ratios })
}

/// Runs `op(worker, i)` on `workers` tasks until `duration` passes; answers
/// every latency.
async fn drive<F, Fut>(workers: usize, duration: Duration, op: F) -> Result<(Vec<Duration>, Duration), BoxError>
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), BoxError>> + Send,
{
    let op = Arc::new(op);
    let started = Instant::now();
    let tasks: Vec<_> = (0..workers)
        .map(|worker| {
            let op = op.clone();
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut i = 0u64;
                while started.elapsed() < duration {
                    let t = Instant::now();
                    op(worker, i).await?;
                    latencies.push(t.elapsed());
                    i += 1;
                }
                Ok::<_, BoxError>(latencies)
            })
        })
        .collect();
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await??);
    }
    Ok((all, started.elapsed()))
}

type Service = Arc<IdempotencyService<PostgrestRepository>>;

async fn pairs_through_crate(service: Service, workers: usize, duration: Duration) -> Result<Figure, BoxError> {
    let org = Uuid::new_v4();
    let hash = RequestHash::of_json(&json!({"bench": true}));
    let (latencies, elapsed) = drive(workers, duration, move |worker, i| {
        let (service, hash) = (service.clone(), hash.clone());
        async move {
            let key = format!("crate-{worker}-{i}");
            let ClaimOutcome::Claimed(claim) =
                service.claim(org, "tool.bench", &key, &hash, Duration::from_secs(60)).await?
            else {
                return Err("a fresh key was not claimed".into());
            };
            let _ = service.complete(&claim, Completion::response(json!({"ok": true}))).await?;
            Ok(())
        }
    })
    .await?;
    Ok(Figure::from("pairs via crate", latencies, elapsed))
}

async fn pairs_bare_http(stack: &LocalStack, workers: usize, duration: Duration) -> Result<Figure, BoxError> {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert("authorization", format!("Bearer {}", stack.service_key()).parse()?);
    headers.insert("content-profile", "agent".parse()?);
    headers.insert("content-type", "application/json".parse()?);
    let http = reqwest::Client::builder()
        .default_headers(headers)
        .pool_max_idle_per_host(workers)
        .tcp_nodelay(true)
        .build()?;
    let claim_url = format!("{}/rpc/idempotency_claim", stack.url());
    let complete_url = format!("{}/rpc/idempotency_complete", stack.url());
    let org = Uuid::new_v4();
    let hash = RequestHash::of_json(&json!({"bench": true})).as_str().to_owned();
    let (latencies, elapsed) = drive(workers, duration, move |worker, i| {
        let (http, claim_url, complete_url) = (http.clone(), claim_url.clone(), complete_url.clone());
        let token = Uuid::new_v4();
        let body = format!(
            r#"{{"p_organization_id":"{org}","p_scope":"tool.bench","p_key":"bare-{worker}-{i}","p_request_hash":"{hash}","p_lease_token":"{token}","p_lease_ms":60000}}"#
        );
        async move {
            let rows: Vec<Value> = http.post(&claim_url).body(body).send().await?.error_for_status()?.json().await?;
            let id = rows.first().and_then(|r| r["id"].as_str()).ok_or("no claim")?.to_owned();
            let done = format!(r#"{{"p_claim_id":"{id}","p_lease_token":"{token}","p_response":{{"ok":true}}}}"#);
            http.post(&complete_url).body(done).send().await?.error_for_status()?.bytes().await?;
            Ok(())
        }
    })
    .await?;
    Ok(Figure::from("pairs via bare HTTP", latencies, elapsed))
}

/// Segments each of two scenarios compared side by side runs, alternating
/// (ABBA), so that a machine whose speed drifts during the run weighs on
/// both alike.
const SEGMENTS: u32 = 4;

/// Latencies and elapsed time of one run of a scenario.
type Run = (Vec<Duration>, Duration);

/// Runs two scenarios in alternating segments (ABBA…), so that the
/// machine's drift weighs on both alike: `segment(first, round)` runs
/// segment `round` of the first scenario when `first`, else of the second.
/// Answers both totals.
async fn alternating<F, Fut>(mut segment: F) -> Result<(Run, Run), BoxError>
where
    F: FnMut(bool, u32) -> Fut,
    Fut: std::future::Future<Output = Result<Run, BoxError>>,
{
    let (mut first_total, mut second_total) = ((Vec::new(), Duration::ZERO), (Vec::new(), Duration::ZERO));
    for round in 0..SEGMENTS {
        for first in [round % 2 == 0, round % 2 == 1] {
            let (latencies, elapsed) = segment(first, round).await?;
            let total = if first { &mut first_total } else { &mut second_total };
            total.0.extend(latencies);
            total.1 += elapsed;
        }
    }
    Ok((first_total, second_total))
}

/// A pool of its own on the stack's database.
async fn own_pool(db: &PgPool) -> Result<PgPool, BoxError> {
    let options = db.connect_options().as_ref().clone();
    Ok(sqlx::postgres::PgPoolOptions::new().max_connections(20).connect_with(options).await?)
}

/// The SQL functions over direct connections and the floor, measured in
/// alternating segments of one pool each: figures for both.
async fn functions_against_floor(
    db: &PgPool,
    workers: usize,
    duration: Duration,
) -> Result<(Figure, Figure), BoxError> {
    let (functions_pool, floor_pool) = (own_pool(db).await?, own_pool(db).await?);
    let segment = duration / SEGMENTS;
    let (functions, floor) = alternating(|first, round| {
        let pool = if first { functions_pool.clone() } else { floor_pool.clone() };
        async move {
            if first {
                pairs_direct_sql(&pool, workers, segment, round).await
            } else {
                pairs_floor(&pool, workers, segment, round).await
            }
        }
    })
    .await?;
    Ok((
        Figure::from("pairs via direct SQL", functions.0, functions.1),
        Figure::from("pairs via floor SQL", floor.0, floor.1),
    ))
}

/// The two hot-path functions as they are (SECURITY DEFINER, acting as the
/// plane's owner) against the same functions switched to SECURITY INVOKER,
/// in alternating segments: what the role switch on every call costs. The
/// functions are SECURITY DEFINER again afterwards, whatever happened.
async fn definer_against_invoker(
    db: &PgPool,
    workers: usize,
    duration: Duration,
) -> Result<(Figure, Figure), BoxError> {
    async fn security(db: &PgPool, mode: &str) -> Result<(), sqlx::Error> {
        let statement = format!(
            "alter function agent.idempotency_claim(uuid, text, text, text, uuid, bigint) security {mode};
             alter function agent.idempotency_complete(uuid, uuid, text, text, jsonb) security {mode};"
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement)).execute(db).await.map(|_| ())
    }
    let pool = own_pool(db).await?;
    let segment = duration / SEGMENTS;
    let measured = alternating(|definer, round| {
        let (db, pool) = (db.clone(), pool.clone());
        async move {
            security(&db, if definer { "definer" } else { "invoker" }).await?;
            pairs_direct_sql(&pool, workers, segment, round).await
        }
    })
    .await;
    security(db, "definer").await?;
    let (definer, invoker) = measured?;
    Ok((
        Figure::from("pairs via direct SQL, definer", definer.0, definer.1),
        Figure::from("pairs via direct SQL, invoker", invoker.0, invoker.1),
    ))
}

async fn pairs_direct_sql(
    pool: &PgPool,
    workers: usize,
    duration: Duration,
    round: u32,
) -> Result<(Vec<Duration>, Duration), BoxError> {
    let pool = pool.clone();
    let org = Uuid::new_v4();
    let hash = RequestHash::of_json(&json!({"bench": true})).as_str().to_owned();
    drive(workers, duration, move |worker, i| {
        let (pool, hash) = (pool.clone(), hash.clone());
        async move {
            let token = Uuid::new_v4();
            let row = sqlx::query("select * from agent.idempotency_claim($1, 'tool.bench', $2, $3, $4, 60000)")
                .bind(org)
                .bind(format!("sql-{round}-{worker}-{i}"))
                .bind(&hash)
                .bind(token)
                .fetch_one(&pool)
                .await?;
            let id: Uuid = row.try_get("id")?;
            sqlx::query("select * from agent.idempotency_complete($1, $2, null, null, '{\"ok\":true}'::jsonb)")
                .bind(id)
                .bind(token)
                .fetch_one(&pool)
                .await?;
            Ok(())
        }
    })
    .await
}

/// The floor: claim → complete with the leanest plain statements that keep
/// the contract (the scope's policy, lease stamped from the clock,
/// retention from the lease's end, the fence, the response limit, and the
/// same answer rows: every claim column and `lease_live`), over direct
/// connections. What the plane's functions cost is measured against it.
async fn pairs_floor(
    pool: &PgPool,
    workers: usize,
    duration: Duration,
    round: u32,
) -> Result<(Vec<Duration>, Duration), BoxError> {
    let pool = pool.clone();
    let org = Uuid::new_v4();
    let hash = RequestHash::of_json(&json!({"bench": true})).as_str().to_owned();
    drive(workers, duration, move |worker, i| {
        let (pool, hash) = (pool.clone(), hash.clone());
        async move {
            let token = Uuid::new_v4();
            let row = sqlx::query(
                "with p as (select s.retain from agent.idempotency_scopes s
                             where s.scope = 'tool.bench'
                                or (s.scope like '%.*'
                                    and char_length('tool.bench') > char_length(s.scope) - 1
                                    and left('tool.bench', char_length(s.scope) - 1) = left(s.scope, -1))
                             order by s.scope = 'tool.bench' desc, char_length(s.scope) desc limit 1),
                      c as (select clock_timestamp() as at)
                 insert into agent.idempotency_keys as k
                   (organization_id, scope, key, request_hash, status, lease_token,
                    claimed_at, lease_expires_at, retain_until)
                 select $1, 'tool.bench', $2, $3, 'processing', $4,
                        c.at, c.at + interval '60 seconds', c.at + interval '60 seconds' + p.retain
                   from p, c
                 on conflict (organization_id, scope, key) do nothing
                 returning 'claimed' as outcome, k.id, k.organization_id, k.scope, k.key, k.request_hash,
                           k.status, k.lease_token, k.resource_type, k.resource_id, k.response,
                           k.claimed_at, k.lease_expires_at, k.retain_until,
                           k.lease_expires_at > clock_timestamp() as lease_live",
            )
            .bind(org)
            .bind(format!("floor-{round}-{worker}-{i}"))
            .bind(&hash)
            .bind(token)
            .fetch_one(&pool)
            .await?;
            let id: Uuid = row.try_get("id")?;
            sqlx::query(
                "update agent.idempotency_keys as k
                    set status = 'completed', response = $3,
                        retain_until = greatest(k.retain_until, clock_timestamp() + (k.retain_until - k.lease_expires_at))
                  where k.id = $1 and k.lease_token = $2 and k.status = 'processing'
                    and octet_length($3::text) <= (
                          select s.max_response_bytes from agent.idempotency_scopes s
                           where s.scope = k.scope
                              or (s.scope like '%.*'
                                  and char_length(k.scope) > char_length(s.scope) - 1
                                  and left(k.scope, char_length(s.scope) - 1) = left(s.scope, -1))
                           order by s.scope = k.scope desc, char_length(s.scope) desc limit 1)
                 returning k.id, k.organization_id, k.scope, k.key, k.request_hash, k.status,
                           k.lease_token, k.resource_type, k.resource_id, k.response, k.claimed_at,
                           k.lease_expires_at, k.retain_until, false as lease_live",
            )
            .bind(id)
            .bind(token)
            .bind(json!({"ok": true}))
            .fetch_one(&pool)
            .await?;
            Ok(())
        }
    })
    .await
}

/// A TCP proxy that holds every byte `delay` in each direction, as a long
/// link does (latency, not bandwidth); answers its URL.
async fn delaying_proxy(upstream: &str, delay: Duration) -> Result<String, BoxError> {
    let upstream = upstream.trim_start_matches("http://").to_owned();
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let upstream = upstream.clone();
            tokio::spawn(async move {
                let Ok(server) = TcpStream::connect(&upstream).await else { return };
                let _ = (client.set_nodelay(true), server.set_nodelay(true));
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                tokio::join!(
                    delayed_copy(client_read, server_write, delay),
                    delayed_copy(server_read, client_write, delay)
                );
            });
        }
    });
    Ok(url)
}

/// Copies `from` to `to`, each chunk written `delay` after it was read.
async fn delayed_copy(mut from: impl AsyncReadExt + Unpin, mut to: impl AsyncWriteExt + Unpin, delay: Duration) {
    let (chunks, mut due) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let read = async move {
        let mut buffer = vec![0u8; 16 * 1024];
        while let Ok(n @ 1..) = from.read(&mut buffer).await {
            if chunks.send((tokio::time::Instant::now() + delay, buffer[..n].to_vec())).is_err() {
                break;
            }
        }
    };
    let write = async move {
        while let Some((at, bytes)) = due.recv().await {
            tokio::time::sleep_until(at).await;
            if to.write_all(&bytes).await.is_err() {
                break;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(read, write);
}

/// p50 of each claim outcome through a link with `--wan-delay-ms` each way:
/// one call decides every outcome, so each costs about one round trip.
async fn wan_outcomes(stack: &LocalStack, args: &BenchArgs) -> Result<Vec<Figure>, BoxError> {
    let url = delaying_proxy(stack.url(), Duration::from_millis(args.wan_delay_ms)).await?;
    let config = stack.client_config()?;
    let client = PostgrestClient::new(
        idempotency_plane::ClientConfig::new(&url, stack.service_key().to_owned())?.with_max_rows(config.max_rows())?,
    )?;
    let service = IdempotencyService::new(PostgrestRepository::new(client));
    let (org, hash, other) = (
        Uuid::new_v4(),
        RequestHash::of_json(&json!({"bench": "wan"})),
        RequestHash::of_json(&json!({"bench": "wan, other"})),
    );
    let n = args.wan_operations;
    let lease = Duration::from_secs(60);
    let key = |outcome: &str, k: usize| format!("wan-{outcome}-{k}");
    // Warm the connection, then time each outcome in turn.
    for k in 0..3 {
        let _ = service.claim(org, "tool.bench", &key("warm", k), &hash, lease).await?;
    }
    let mut figures = Vec::new();
    let mut timed = Vec::new();
    let mut claims = Vec::new();
    let started = Instant::now();
    for k in 0..n {
        let t = Instant::now();
        match service.claim(org, "tool.bench", &key("done", k), &hash, lease).await? {
            ClaimOutcome::Claimed(claim) => claims.push(claim),
            other => return Err(format!("expected a first claim, got {}", other.kind()).into()),
        }
        timed.push(t.elapsed());
    }
    figures.push(Figure::from("first claim", std::mem::take(&mut timed), started.elapsed()));
    for claim in &claims {
        let _ = service.complete(claim, Completion::response(json!({"ok": true}))).await?;
    }
    for (name, wanted, request) in [("replay", "completed", &hash), ("conflict", "conflict", &other)] {
        let started = Instant::now();
        for k in 0..n {
            let t = Instant::now();
            let outcome = service.claim(org, "tool.bench", &key("done", k), request, lease).await?;
            if outcome.kind() != wanted {
                return Err(format!("expected {wanted}, got {}", outcome.kind()).into());
            }
            timed.push(t.elapsed());
        }
        figures.push(Figure::from(name, std::mem::take(&mut timed), started.elapsed()));
    }
    let mut ids = Vec::new();
    for k in 0..n {
        if let ClaimOutcome::Claimed(claim) = service.claim(org, "tool.bench", &key("held", k), &hash, lease).await? {
            ids.push(claim.id());
        }
    }
    let started = Instant::now();
    for k in 0..n {
        let t = Instant::now();
        let outcome = service.claim(org, "tool.bench", &key("held", k), &hash, lease).await?;
        if outcome.kind() != "processing" {
            return Err(format!("expected processing, got {}", outcome.kind()).into());
        }
        timed.push(t.elapsed());
    }
    figures.push(Figure::from("processing", std::mem::take(&mut timed), started.elapsed()));
    stack
        .db()
        .execute(
            sqlx::query(
                "update agent.idempotency_keys set lease_expires_at = now() - interval '1 second' where id = any($1)",
            )
            .bind(&ids),
        )
        .await?;
    let started = Instant::now();
    for k in 0..n {
        let t = Instant::now();
        match service.claim(org, "tool.bench", &key("held", k), &hash, lease).await? {
            ClaimOutcome::Claimed(claim) if claim.reclaimed() => timed.push(t.elapsed()),
            other => return Err(format!("expected a reclaim, got {}", other.kind()).into()),
        }
    }
    figures.push(Figure::from("reclaim", timed, started.elapsed()));
    Ok(figures)
}

/// Replays and conflicts on completed keys, and the round trips of each path
/// (first claim, replay, conflict, reclaim) read off the client's counter.
async fn replays_and_conflicts(
    stack: &LocalStack,
    client: &PostgrestClient,
    service: Service,
    workers: usize,
    duration: Duration,
) -> Result<(Figure, Figure, Figure, Vec<(String, f64)>), BoxError> {
    let org = Uuid::new_v4();
    let hash = RequestHash::of_json(&json!({"bench": "replay"}));
    let other = RequestHash::of_json(&json!({"bench": "other"}));
    let keys = 256u64;
    let mut trips = Vec::new();

    let before = client.requests_sent();
    for k in 0..keys {
        let ClaimOutcome::Claimed(claim) =
            service.claim(org, "tool.bench", &format!("replay-{k}"), &hash, Duration::from_secs(60)).await?
        else {
            return Err("fresh key not claimed".into());
        };
        let _ = service.complete(&claim, Completion::response(json!({"k": k}))).await?;
    }
    // Each pair was one claim and one complete.
    trips.push(("first claim".to_owned(), (client.requests_sent() - before) as f64 / keys as f64 - 1.0));

    let replay = {
        let (service, hash) = (service.clone(), hash.clone());
        let before = client.requests_sent();
        let (latencies, elapsed) = drive(workers, duration, move |_, i| {
            let (service, hash) = (service.clone(), hash.clone());
            async move {
                match service
                    .claim(org, "tool.bench", &format!("replay-{}", i % keys), &hash, Duration::from_secs(60))
                    .await?
                {
                    ClaimOutcome::Completed { .. } => Ok(()),
                    other => Err(format!("expected a replay, got {}", other.kind()).into()),
                }
            }
        })
        .await?;
        trips.push(("replay".to_owned(), (client.requests_sent() - before) as f64 / latencies.len().max(1) as f64));
        Figure::from("replay", latencies, elapsed)
    };
    let conflict = {
        let before = client.requests_sent();
        let (latencies, elapsed) = drive(workers, duration, move |_, i| {
            let (service, other) = (service.clone(), other.clone());
            async move {
                match service
                    .claim(org, "tool.bench", &format!("replay-{}", i % keys), &other, Duration::from_secs(60))
                    .await?
                {
                    ClaimOutcome::Conflict => Ok(()),
                    other => Err(format!("expected a conflict, got {}", other.kind()).into()),
                }
            }
        })
        .await?;
        trips.push(("conflict".to_owned(), (client.requests_sent() - before) as f64 / latencies.len().max(1) as f64));
        Figure::from("conflict", latencies, elapsed)
    };

    // The same replays through a service with a replay cache.
    let cached = {
        let service = Arc::new(IdempotencyService::new(PostgrestRepository::new(client.clone())).with_replay_cache(
            10_000,
            64 << 20,
            Duration::from_secs(60),
        ));
        for k in 0..keys {
            let _ = service.read(org, "tool.bench", &format!("replay-{k}"), &hash).await?;
        }
        let before = client.requests_sent();
        let (latencies, elapsed) = {
            let (service, hash) = (service.clone(), hash.clone());
            drive(workers, duration, move |_, i| {
                let (service, hash) = (service.clone(), hash.clone());
                async move {
                    match service
                        .claim(org, "tool.bench", &format!("replay-{}", i % keys), &hash, Duration::from_secs(60))
                        .await?
                    {
                        ClaimOutcome::Completed { .. } => Ok(()),
                        other => Err(format!("expected a replay, got {}", other.kind()).into()),
                    }
                }
            })
            .await?
        };
        trips.push((
            "replay, cached".to_owned(),
            (client.requests_sent() - before) as f64 / latencies.len().max(1) as f64,
        ));
        if let Some((entries, bytes)) = service.replay_cache_stats() {
            trips.push(("cache bytes per entry".to_owned(), bytes as f64 / entries.max(1) as f64));
        }
        Figure::from("replay, cache hit", latencies, elapsed)
    };

    // Claims in flight: processing, answered to every other caller.
    let service = IdempotencyService::new(PostgrestRepository::new(client.clone()));
    let mut ids = Vec::new();
    for k in 0..64u64 {
        if let ClaimOutcome::Claimed(claim) =
            service.claim(org, "tool.bench", &format!("reclaim-{k}"), &hash, Duration::from_secs(60)).await?
        {
            ids.push(claim.id());
        }
    }
    let before = client.requests_sent();
    for k in 0..ids.len() {
        match service.claim(org, "tool.bench", &format!("reclaim-{k}"), &hash, Duration::from_secs(60)).await? {
            ClaimOutcome::Processing { .. } => {}
            other => return Err(format!("expected processing, got {}", other.kind()).into()),
        }
    }
    trips.push(("processing".to_owned(), (client.requests_sent() - before) as f64 / ids.len().max(1) as f64));

    // Reclaims: the same claims once their lease passed, taken over once each.
    stack
        .db()
        .execute(
            sqlx::query(
                "update agent.idempotency_keys set lease_expires_at = now() - interval '1 second' where id = any($1)",
            )
            .bind(&ids),
        )
        .await?;
    let before = client.requests_sent();
    for k in 0..ids.len() {
        match service.claim(org, "tool.bench", &format!("reclaim-{k}"), &hash, Duration::from_secs(60)).await? {
            ClaimOutcome::Claimed(claim) if claim.reclaimed() => {}
            other => return Err(format!("expected a reclaim, got {}", other.kind()).into()),
        }
    }
    trips.push(("reclaim".to_owned(), (client.requests_sent() - before) as f64 / ids.len().max(1) as f64));
    Ok((replay, conflict, cached, trips))
}

async fn claims(service: Service, workers: usize, duration: Duration, name: &str) -> Result<Figure, BoxError> {
    let org = Uuid::new_v4();
    let hash = RequestHash::of_json(&json!({"bench": "claims"}));
    let label = name.replace(' ', "-");
    let (latencies, elapsed) = drive(workers, duration, move |worker, i| {
        let (service, hash, label) = (service.clone(), hash.clone(), label.clone());
        async move {
            let key = format!("{label}-{worker}-{i}");
            match service.claim(org, "tool.bench", &key, &hash, Duration::from_secs(60)).await? {
                ClaimOutcome::Claimed(_) => Ok(()),
                other => Err(format!("expected a claim, got {}", other.kind()).into()),
            }
        }
    })
    .await?;
    Ok(Figure::from(name, latencies, elapsed))
}

async fn claims_during_sweep(
    stack: &LocalStack,
    client: &PostgrestClient,
    service: Service,
    args: &BenchArgs,
) -> Result<Figure, BoxError> {
    stack
        .db()
        .execute(
            sqlx::query(
                "insert into agent.idempotency_keys
                   (organization_id, scope, key, request_hash, status, lease_token, response,
                    claimed_at, lease_expires_at, retain_until)
                 select gen_random_uuid(), 'tool.bench', 'expired-' || i, repeat('a', 64), 'completed',
                        gen_random_uuid(), '1', now() - interval '31 days', now() - interval '31 days',
                        now() - interval '1 day'
                   from generate_series(1, $1) i",
            )
            .bind(args.sweep_rows),
        )
        .await?;
    stack.db().execute("analyze agent.idempotency_keys").await?;
    let sweeper = Sweeper::new(client.clone(), u64::from(client.config().max_rows()))?;
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let finished = done.clone();
    let sweeping = tokio::spawn(async move {
        let started = Instant::now();
        let mut deleted = 0;
        let result = loop {
            match sweeper.pass().await {
                Ok(report) => {
                    deleted += report.deleted;
                    if !report.filled {
                        break Ok((deleted, started.elapsed()));
                    }
                }
                Err(error) => break Err(BoxError::from(error)),
            }
        };
        finished.store(true, std::sync::atomic::Ordering::SeqCst);
        result
    });
    // Measure for as long as the sweep runs (at least a second).
    let sweep_started = Instant::now();
    let org = Uuid::new_v4();
    let hash = RequestHash::of_json(&json!({"bench": "during sweep"}));
    let mut latencies = Vec::new();
    let workers: Vec<_> = (0..args.workers)
        .map(|worker| {
            let (service, hash) = (service.clone(), hash.clone());
            let done = done.clone();
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut i = 0;
                while !done.load(std::sync::atomic::Ordering::SeqCst) {
                    let t = Instant::now();
                    let key = format!("during-{worker}-{i}");
                    match service.claim(org, "tool.bench", &key, &hash, Duration::from_secs(60)).await? {
                        ClaimOutcome::Claimed(_) => latencies.push(t.elapsed()),
                        other => return Err(format!("expected a claim, got {}", other.kind()).into()),
                    }
                    i += 1;
                }
                Ok::<_, BoxError>(latencies)
            })
        })
        .collect();
    for worker in workers {
        latencies.extend(worker.await??);
    }
    let (deleted, swept_in) = sweeping.await??;
    eprintln!("  the sweep deleted {deleted} rows in {:.1} s", swept_in.as_secs_f64());
    Ok(Figure::from("claim during sweep", latencies, sweep_started.elapsed()))
}

/// Brings the table to `rows` rows (completed claims of other tenants, still
/// retained), then refreshes the planner's statistics.
async fn fill_table(db: &PgPool, rows: i64) -> Result<(), BoxError> {
    let present: i64 = sqlx::query_scalar("select count(*) from agent.idempotency_keys").fetch_one(db).await?;
    let missing = rows - present;
    if missing > 0 {
        db.execute(
            sqlx::query(
                "insert into agent.idempotency_keys
                   (organization_id, scope, key, request_hash, status, lease_token, response,
                    claimed_at, lease_expires_at, retain_until)
                 select gen_random_uuid(), 'tool.filler', 'filler-' || i, repeat('b', 64), 'completed',
                        gen_random_uuid(), '{\"ok\":true}', now(), now() + interval '1 minute', now() + interval '30 days'
                   from generate_series(1, $1) i",
            )
            .bind(missing),
        )
        .await?;
    }
    db.execute("analyze agent.idempotency_keys").await?;
    Ok(())
}

fn print(results: &Results) {
    println!();
    println!(
        "idem bench: {} workers, {} s per scenario, one database, one run",
        results.workers, results.seconds_per_scenario
    );
    println!();
    println!("  {:<34} {:>9} {:>11} {:>9} {:>9}", "scenario", "ops", "ops/s", "p50 ms", "p99 ms");
    println!("  {:-<34} {:->9} {:->11} {:->9} {:->9}", "", "", "", "", "");
    for f in &results.figures {
        println!("  {:<34} {:>9} {:>11.0} {:>9.3} {:>9.3}", f.name, f.operations, f.per_second, f.p50_ms, f.p99_ms);
    }
    println!();
    println!("  {:<34} {:>9}", "round trips per operation", "HTTP");
    println!("  (and the replay cache's memory per entry, bytes)");
    println!("  {:-<34} {:->9}", "", "");
    for (name, trips) in &results.round_trips {
        println!("  {:<34} {:>9.2}", name, trips);
    }
    println!();
    println!("  {:<34} {:>9} {:>9}", "over the WAN link, per outcome", "p50 ms", "p99 ms");
    println!("  {:-<34} {:->9} {:->9}", "", "", "");
    for f in &results.wan {
        println!("  {:<34} {:>9.1} {:>9.1}", f.name, f.p50_ms, f.p99_ms);
    }
    println!();
    println!("  {:<40} {:>8} {:>9}  met", "ratio", "value", "target");
    println!("  {:-<40} {:->8} {:->9}  ---", "", "", "");
    for r in &results.ratios {
        println!("  {:<40} {:>8.2} {:>9}  {}", r.name, r.value, r.target, if r.met { "yes" } else { "NO" });
    }
}
