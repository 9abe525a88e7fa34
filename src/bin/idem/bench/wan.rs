//! Each claim outcome over a simulated long link: a proxy that delays every
//! byte each way.

use std::time::{Duration, Instant};

use idempotency_plane::local::LocalStack;
use idempotency_plane::{
    ClaimOutcome, Completion, IdempotencyService, PostgrestClient, PostgrestRepository, RequestHash,
};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use uuid::Uuid;

use super::figure::Figure;
use super::rows::expire_leases;
use crate::BoxError;

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

/// Latencies of each claim outcome, `n` claims each, through a link that
/// holds every byte `delay` each way (`--wan-delay-ms`): one call decides
/// every outcome, so each costs about one round trip.
pub(super) async fn wan_outcomes(stack: &LocalStack, delay: Duration, n: usize) -> Result<Vec<Figure>, BoxError> {
    let url = delaying_proxy(stack.url(), delay).await?;
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
    expire_leases(stack.db(), &ids).await?;
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
