//! What the `hostile`, `wire` and `stack::faults` tests share, one copy
//! of each: retry policies that finish in milliseconds, a claim row as the
//! claim functions answer it, a raw TCP server for the faults wiremock
//! cannot inject (canned bytes, a hang-up, an answer lost after the server
//! committed), and a port whose connections are refused for sure.

// Some of these serve only modules that need feature `local`.
#![cfg_attr(not(feature = "local"), allow(dead_code))]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency_plane::postgrest::{ClientConfig, PostgrestClient, RetryConfig};
use idempotency_plane::RequestHash;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use uuid::Uuid;

/// The service key every test client sends.
pub const KEY: &str = "service-key";

// ---------------------------------------------------------------------------
// Retries
// ---------------------------------------------------------------------------

/// Retries that finish in milliseconds: 2 retries, so 3 requests at most,
/// 1 to 5 ms apart; no retry starts once `max_elapsed` has passed since the
/// first attempt.
pub fn fast_retry(max_elapsed: Duration) -> RetryConfig {
    RetryConfig {
        max_retries: 2,
        initial_backoff: Duration::from_millis(1),
        max_backoff: Duration::from_millis(5),
        max_elapsed,
    }
}

/// Retries for a client of the real stack behind a [`FaultServer`] proxy:
/// 3 retries, 5 to 20 ms apart, none started after 10 s. One retry is what
/// repeats a call whose answer the proxy lost.
pub fn proxy_retry() -> RetryConfig {
    RetryConfig {
        max_retries: 3,
        initial_backoff: Duration::from_millis(5),
        max_backoff: Duration::from_millis(20),
        max_elapsed: Duration::from_secs(10),
    }
}

// ---------------------------------------------------------------------------
// A claim row
// ---------------------------------------------------------------------------

/// One row of `agent.idempotency_keys` plus `lease_live`, as the claim
/// functions answer it: key `run-1:step-1`, nothing recorded yet, the lease
/// live while `status` is `processing`.
pub fn claim_row(id: Uuid, lease_token: Uuid, scope: &str, request_hash: &RequestHash, status: &str) -> Value {
    json!({
        "id": id,
        "organization_id": Uuid::new_v4(),
        "scope": scope,
        "key": "run-1:step-1",
        "request_hash": request_hash.as_str(),
        "status": status,
        "lease_token": lease_token,
        "resource_type": null,
        "resource_id": null,
        "response": null,
        "claimed_at": "2026-01-01T00:00:00Z",
        "lease_expires_at": "2026-01-01T00:01:00Z",
        "retain_until": "2026-01-31T00:00:00Z",
        "lease_live": status == "processing",
    })
}

// ---------------------------------------------------------------------------
// A port that refuses connections
// ---------------------------------------------------------------------------

/// A loopback port whose connections are refused for as long as this lives.
///
/// It holds a TCP socket bound to the port but not listening. While it is
/// bound nobody else can bind the port, nor is it handed out as the local
/// port of an outgoing connection, and the kernel answers every connection
/// attempt to it with a reset: refused, at once, every time. The usual
/// alternatives are not sure: a port bound, read and freed can be taken by
/// anyone (another test's server) before the client connects; and a
/// listening socket that never accepts is not refusing, its backlog
/// completes the handshake and the client hangs instead.
pub struct RefusedPort {
    socket: TcpSocket,
    address: SocketAddr,
}

impl RefusedPort {
    pub fn new() -> RefusedPort {
        let socket = TcpSocket::new_v4().expect("a TCP socket");
        socket.bind("127.0.0.1:0".parse().expect("an address")).expect("bind a loopback port");
        let address = socket.local_addr().expect("the bound address");
        RefusedPort { socket, address }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.address)
    }

    /// Starts accepting on the same port: it never was free in between.
    /// Needs a tokio runtime.
    pub fn listen(self) -> TcpListener {
        self.socket.listen(1024).expect("listen on the held port")
    }
}

// ---------------------------------------------------------------------------
// A raw TCP fault server
// ---------------------------------------------------------------------------

/// A raw TCP server for the faults wiremock cannot inject. It either answers
/// every request with canned bytes (however malformed) and closes, or
/// relays to a real server; either way it counts the connections it accepted
/// and can lose the answer of a chosen request: it reads the request (and,
/// relaying, lets the server answer it, so commit it) and closes the
/// connection without passing an answer on.
///
/// A client that keeps no connection idle (`with_pool_max_idle_per_host(0)`)
/// opens one connection per request, so "the n-th connection" is "the n-th
/// request".
pub struct FaultServer {
    url: String,
    connections: Arc<AtomicUsize>,
    lose: Arc<AtomicUsize>,
}

#[derive(Clone)]
enum Behaviour {
    /// Answer these bytes, then close.
    Answer(Arc<[u8]>),
    /// Relay to this `host:port`.
    Relay(String),
}

impl FaultServer {
    /// Answers every request with `answer`, byte for byte, then closes.
    pub async fn answering(answer: impl Into<Vec<u8>>) -> FaultServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the fault server");
        FaultServer::serve(listener, Behaviour::Answer(answer.into().into()))
    }

    /// Reads each request and closes the connection without an answer.
    pub async fn hanging_up() -> FaultServer {
        FaultServer::answering(Vec::new()).await
    }

    /// A proxy in front of `upstream` (`http://host:port`).
    pub async fn lossy_proxy(upstream: &str) -> FaultServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the proxy");
        FaultServer::lossy_proxy_on(listener, upstream)
    }

    /// A proxy in front of `upstream`, accepting on `listener`.
    pub fn lossy_proxy_on(listener: TcpListener, upstream: &str) -> FaultServer {
        FaultServer::serve(listener, Behaviour::Relay(upstream.trim_start_matches("http://").to_owned()))
    }

    fn serve(listener: TcpListener, behaviour: Behaviour) -> FaultServer {
        let url = format!("http://{}", listener.local_addr().expect("the server's address"));
        let connections = Arc::new(AtomicUsize::new(0));
        let lose = Arc::new(AtomicUsize::new(usize::MAX));
        let (count, target) = (connections.clone(), lose.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let n = count.fetch_add(1, Ordering::SeqCst) + 1;
                let drop_answer = target.load(Ordering::SeqCst) == n;
                let behaviour = behaviour.clone();
                tokio::spawn(async move {
                    match behaviour {
                        Behaviour::Answer(answer) => answer_with(client, &answer, drop_answer).await,
                        Behaviour::Relay(upstream) => {
                            let Ok(server) = TcpStream::connect(&upstream).await else { return };
                            relay(client, server, drop_answer).await;
                        }
                    }
                });
            }
        });
        FaultServer { url, connections, lose }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }

    /// Loses the answer of the `n`-th request from now (1 = the next one).
    pub fn lose_answer(&self, n: usize) {
        self.lose.store(self.connections.load(Ordering::SeqCst) + n, Ordering::SeqCst);
    }

    /// A client of this server that keeps no connection idle.
    pub fn client(&self, key: &str, retry: RetryConfig) -> PostgrestClient {
        let config =
            ClientConfig::new(&self.url, key.to_owned()).unwrap().with_pool_max_idle_per_host(0).with_retry(retry);
        PostgrestClient::new(config).unwrap()
    }
}

/// Reads one HTTP request, then writes `answer` (unless `drop_answer`) and
/// closes.
async fn answer_with(mut socket: TcpStream, answer: &[u8], drop_answer: bool) {
    read_request(&mut socket).await;
    if !drop_answer {
        let _ = socket.write_all(answer).await;
    }
    let _ = socket.shutdown().await;
}

/// Reads one HTTP request (head and `Content-Length` body) so the answer
/// never races an unread request into a reset.
async fn read_request(socket: &mut TcpStream) {
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        if let Some(end) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buffer[..end]).to_ascii_lowercase();
            let length = head
                .lines()
                .find_map(|line| line.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            if buffer.len() >= end + 4 + length {
                return;
            }
        }
        match socket.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buffer.extend_from_slice(&chunk[..n]),
        }
    }
}

/// Copies the request up and the answer down; with `drop_answer`, waits for
/// the answer to start and then closes the client's connection instead.
async fn relay(client: TcpStream, server: TcpStream, drop_answer: bool) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let up = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
    });
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        match server_read.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(_) if drop_answer => break,
            Ok(n) => {
                if client_write.write_all(&buffer[..n]).await.is_err() {
                    break;
                }
            }
        }
    }
    up.abort();
}
