//! An HTTP reverse proxy in front of a PostgREST-compatible server (a
//! [`LocalStack`](idempotency_plane::local::LocalStack)'s URL, or any
//! other), that delays or drops chosen RPC answers: the faults a real
//! network puts between a worker and its plane, aimed at one function.
//!
//! Every request is forwarded to the upstream. A request whose path ends in
//! `/rpc/<function>` is counted under `<function>` and meets that
//! function's rules, which can be changed while the proxy runs:
//!
//! | rule | what the caller sees | what the database did |
//! |---|---|---|
//! | [`delay`](RpcProxy::delay) | every answer, after the upstream gave it, late by the duration | the call ran and committed before the wait |
//! | [`delay_request`](RpcProxy::delay_request) | every request held for the duration before it is forwarded | nothing yet while it is held: a slow write |
//! | [`drop_next`](RpcProxy::drop_next) | the next `n` answers, after the upstream gave them, never come: the connection closes | the call ran and committed |
//! | [`drop_next_unsent`](RpcProxy::drop_next_unsent) | the next `n` requests are closed without an answer and never forwarded | nothing |
//!
//! A dropping rule is spent first, then the holding and delaying ones
//! apply; [`clear`](RpcProxy::clear) removes every rule (a request already
//! held or delayed keeps its wait). The proxy speaks HTTP/1.1 with
//! keep-alive to its callers (bodies by `Content-Length` or chunked) and
//! forwards with reqwest; an upstream it cannot reach is answered 502.
//!
//! ```ignore
//! let proxy = RpcProxy::start(stack.url()).await;
//! let client = proxy.client(stack.service_key(), RetryConfig::disabled());
//! proxy.delay("idempotency_complete", Duration::from_secs(3));
//! proxy.drop_next("idempotency_claim", 1);
//! assert_eq!(proxy.requests("idempotency_claim"), 0);
//! proxy.clear();
//! ```

// Not every test uses every rule.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use idempotency_plane::postgrest::{ClientConfig, PostgrestClient, RetryConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// The proxy; it stops accepting when dropped.
pub struct RpcProxy {
    url: String,
    shared: Arc<Shared>,
    accepting: JoinHandle<()>,
}

struct Shared {
    /// `scheme://host:port` of the upstream; a request's target is appended.
    origin: String,
    http: reqwest::Client,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    rules: HashMap<String, Rules>,
    /// Requests received, by function.
    received: HashMap<String, usize>,
    /// Requests the upstream answered, by function (dropped answers included).
    answered: HashMap<String, usize>,
}

#[derive(Default, Clone, Copy)]
struct Rules {
    hold: Option<Duration>,
    delay: Option<Duration>,
    drop_answers: usize,
    drop_unsent: usize,
}

/// What to do with one request, decided when it arrives.
#[derive(Clone, Copy)]
struct Plan {
    drop_unsent: bool,
    hold: Option<Duration>,
    drop_answer: bool,
    delay: Option<Duration>,
}

impl RpcProxy {
    /// A proxy on an ephemeral loopback port in front of `upstream` (`http://host:port`,
    /// optionally with a path such as `/rest/v1`).
    pub async fn start(upstream: &str) -> RpcProxy {
        let parsed = url::Url::parse(upstream).expect("the upstream is a URL");
        let origin = parsed.origin().ascii_serialization();
        let path = parsed.path().trim_end_matches('/').to_owned();
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the proxy");
        let url = format!("http://{}{path}", listener.local_addr().expect("the proxy's address"));
        let http = reqwest::Client::builder()
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .expect("the proxy's HTTP client");
        let shared = Arc::new(Shared { origin, http, state: Mutex::default() });
        let serving = shared.clone();
        let accepting = tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let _ = socket.set_nodelay(true);
                tokio::spawn(connection(socket, serving.clone()));
            }
        });
        RpcProxy { url, shared, accepting }
    }

    /// The proxy's URL: the upstream's, with the proxy's host and port.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A client configuration for the proxy, with `service_key`.
    pub fn client_config(&self, service_key: &str) -> ClientConfig {
        ClientConfig::new(&self.url, service_key.to_owned()).expect("a client configuration for the proxy")
    }

    /// A client of the proxy, with `service_key` and `retry`.
    pub fn client(&self, service_key: &str, retry: RetryConfig) -> PostgrestClient {
        PostgrestClient::new(self.client_config(service_key).with_retry(retry)).expect("a client of the proxy")
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.shared.lock()
    }

    fn edit(&self, function: &str, change: impl FnOnce(&mut Rules)) {
        change(self.state().rules.entry(function.to_owned()).or_default());
    }

    /// Every answer of `function` reaches its caller `by` late, after the
    /// upstream gave it (so the database committed before the wait).
    pub fn delay(&self, function: &str, by: Duration) {
        self.edit(function, |rules| rules.delay = Some(by));
    }

    /// Every request of `function` is held `by` before it is forwarded: the
    /// database does not see it until then.
    pub fn delay_request(&self, function: &str, by: Duration) {
        self.edit(function, |rules| rules.hold = Some(by));
    }

    /// The next `n` answers of `function` are lost: the upstream answers
    /// (the database committed) and the proxy closes the caller's
    /// connection without passing the answer on.
    pub fn drop_next(&self, function: &str, n: usize) {
        self.edit(function, |rules| rules.drop_answers = n);
    }

    /// The next `n` requests of `function` are closed without an answer and
    /// never forwarded: the database never sees them.
    pub fn drop_next_unsent(&self, function: &str, n: usize) {
        self.edit(function, |rules| rules.drop_unsent = n);
    }

    /// Removes every rule of every function.
    pub fn clear(&self) {
        self.state().rules.clear();
    }

    /// Requests of `function` received so far.
    pub fn requests(&self, function: &str) -> usize {
        self.state().received.get(function).copied().unwrap_or(0)
    }

    /// Requests of `function` the upstream answered so far, whether or not
    /// the answer was passed on.
    pub fn answered(&self, function: &str) -> usize {
        self.state().answered.get(function).copied().unwrap_or(0)
    }
}

impl Drop for RpcProxy {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A test that panicked while holding the lock leaves nothing half-done.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Counts a request of `function` and spends its one-shot rules.
    fn plan(&self, function: &str) -> Plan {
        let mut state = self.lock();
        *state.received.entry(function.to_owned()).or_default() += 1;
        let rules = state.rules.entry(function.to_owned()).or_default();
        let drop_unsent = rules.drop_unsent > 0;
        if drop_unsent {
            rules.drop_unsent -= 1;
            return Plan { drop_unsent, hold: None, drop_answer: false, delay: None };
        }
        let drop_answer = rules.drop_answers > 0;
        if drop_answer {
            rules.drop_answers -= 1;
        }
        Plan { drop_unsent, hold: rules.hold, drop_answer, delay: rules.delay }
    }

    fn answered(&self, function: &str) {
        *self.lock().answered.entry(function.to_owned()).or_default() += 1;
    }
}

/// One request as read from a caller.
struct Incoming {
    method: String,
    target: String,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
    close: bool,
}

/// One answer as the upstream gave it.
struct Outgoing {
    status: u16,
    reason: String,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
}

/// Serves one caller's connection, request after request.
async fn connection(mut socket: TcpStream, shared: Arc<Shared>) {
    let mut buffer = Vec::new();
    while let Some(request) = read_request(&mut socket, &mut buffer).await {
        let plan = rpc_function(&request.target).map(|function| (shared.plan(&function), function));
        if let Some((plan, _)) = &plan {
            if plan.drop_unsent {
                return;
            }
            if let Some(hold) = plan.hold {
                tokio::time::sleep(hold).await;
            }
        }
        let head_only = request.method.eq_ignore_ascii_case("HEAD");
        let close = request.close;
        let answer = forward(&shared, request).await;
        if let Some((plan, function)) = &plan {
            shared.answered(function);
            if plan.drop_answer {
                return;
            }
            if let Some(delay) = plan.delay {
                tokio::time::sleep(delay).await;
            }
        }
        if write_answer(&mut socket, &answer, head_only, close).await.is_err() || close {
            return;
        }
    }
}

/// `<function>` of a target whose path ends in `/rpc/<function>`.
fn rpc_function(target: &str) -> Option<String> {
    let path = target.split(['?', '#']).next()?;
    let (_, function) = path.rsplit_once("/rpc/")?;
    (!function.is_empty() && !function.contains('/')).then(|| function.to_owned())
}

/// Headers that describe one hop, never forwarded either way.
fn hop_by_hop(name: &str) -> bool {
    matches!(
        name,
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
            | "host"
            | "content-length"
    )
}

async fn forward(shared: &Shared, request: Incoming) -> Outgoing {
    let unreachable = |why: String| Outgoing {
        status: 502,
        reason: "Bad Gateway".into(),
        headers: vec![("content-type".into(), b"text/plain".to_vec())],
        body: format!("proxy: {why}").into_bytes(),
    };
    let Ok(method) = reqwest::Method::from_bytes(request.method.as_bytes()) else {
        return unreachable(format!("method {:?}", request.method));
    };
    let mut outbound = shared.http.request(method, format!("{}{}", shared.origin, request.target));
    for (name, value) in &request.headers {
        if !hop_by_hop(name) {
            outbound = outbound.header(name.as_str(), value.as_slice());
        }
    }
    let response = match outbound.body(request.body).send().await {
        Ok(response) => response,
        Err(error) => return unreachable(error.to_string()),
    };
    let status = response.status();
    let headers = response
        .headers()
        .iter()
        .filter(|(name, _)| !hop_by_hop(name.as_str()))
        .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
        .collect();
    match response.bytes().await {
        Ok(body) => Outgoing {
            status: status.as_u16(),
            reason: status.canonical_reason().unwrap_or("Unknown").to_owned(),
            headers,
            body: body.to_vec(),
        },
        Err(error) => unreachable(format!("the upstream's body broke off: {error}")),
    }
}

async fn write_answer(socket: &mut TcpStream, answer: &Outgoing, head_only: bool, close: bool) -> std::io::Result<()> {
    let mut out = format!("HTTP/1.1 {} {}\r\n", answer.status, answer.reason).into_bytes();
    for (name, value) in &answer.headers {
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    }
    let bodiless = answer.status < 200 || answer.status == 204 || answer.status == 304;
    if !bodiless {
        out.extend_from_slice(format!("content-length: {}\r\n", answer.body.len()).as_bytes());
    }
    if close {
        out.extend_from_slice(b"connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    if !bodiless && !head_only {
        out.extend_from_slice(&answer.body);
    }
    socket.write_all(&out).await?;
    socket.flush().await
}

/// Reads one request; `None` when the caller closed or sent something
/// that is not HTTP/1.1. Bytes of the next request stay in `buffer`.
async fn read_request(socket: &mut TcpStream, buffer: &mut Vec<u8>) -> Option<Incoming> {
    let head_end = loop {
        if let Some(end) = find(buffer, b"\r\n\r\n") {
            break end;
        }
        fill(socket, buffer).await?;
    };
    let head = String::from_utf8_lossy(&buffer[..head_end]).into_owned();
    buffer.drain(..head_end + 4);
    let mut lines = head.split("\r\n");
    let mut request_line = lines.next()?.split(' ');
    let (method, target, version) = (request_line.next()?, request_line.next()?, request_line.next()?);
    let mut headers = Vec::new();
    for line in lines {
        let (name, value) = line.split_once(':')?;
        headers.push((name.trim().to_ascii_lowercase(), value.trim().as_bytes().to_vec()));
    }
    let header = |wanted: &str| {
        headers
            .iter()
            .find(|(name, _)| name == wanted)
            .map(|(_, value)| String::from_utf8_lossy(value).to_ascii_lowercase())
    };
    let close = header("connection").is_some_and(|v| v.contains("close")) || version == "HTTP/1.0";
    let body = if header("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        read_chunked(socket, buffer).await?
    } else {
        let length: usize = header("content-length").map_or(Some(0), |v| v.trim().parse().ok())?;
        while buffer.len() < length {
            fill(socket, buffer).await?;
        }
        buffer.drain(..length).collect()
    };
    Some(Incoming { method: method.to_owned(), target: target.to_owned(), headers, body, close })
}

async fn read_chunked(socket: &mut TcpStream, buffer: &mut Vec<u8>) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let line_end = loop {
            if let Some(end) = find(buffer, b"\r\n") {
                break end;
            }
            fill(socket, buffer).await?;
        };
        let size_line = String::from_utf8_lossy(&buffer[..line_end]).into_owned();
        buffer.drain(..line_end + 2);
        let size = usize::from_str_radix(size_line.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            // Trailers, if any, end with an empty line.
            loop {
                if let Some(end) = find(buffer, b"\r\n") {
                    buffer.drain(..end + 2);
                    if end == 0 {
                        return Some(body);
                    }
                    continue;
                }
                fill(socket, buffer).await?;
            }
        }
        while buffer.len() < size + 2 {
            fill(socket, buffer).await?;
        }
        body.extend(buffer.drain(..size));
        buffer.drain(..2);
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|window| window == needle)
}

/// Reads more bytes into `buffer`; `None` once the caller closed.
async fn fill(socket: &mut TcpStream, buffer: &mut Vec<u8>) -> Option<()> {
    let mut chunk = [0u8; 16 * 1024];
    match socket.read(&mut chunk).await {
        Ok(0) | Err(_) => None,
        Ok(n) => {
            buffer.extend_from_slice(&chunk[..n]);
            Some(())
        }
    }
}

#[test]
fn rpc_functions_are_read_from_the_path_whatever_its_prefix() {
    assert_eq!(rpc_function("/rpc/idempotency_claim").as_deref(), Some("idempotency_claim"));
    assert_eq!(rpc_function("/rest/v1/rpc/f?select=id").as_deref(), Some("f"));
    assert_eq!(rpc_function("/rpc/"), None);
    assert_eq!(rpc_function("/orders"), None);
}

/// The proxy itself, on a real stack.
#[cfg(feature = "local")]
mod tests {
    use super::*;
    use crate::support::harness::{client, stack};
    use idempotency_plane::{IdempotencyService, PostgrestRepository};
    use std::time::Instant;

    #[tokio::test]
    async fn the_proxy_forwards_counts_delays_and_drops_chosen_answers() {
        let stack = stack().await;
        let proxy = RpcProxy::start(stack.url()).await;
        let through = proxy.client(stack.service_key(), RetryConfig::disabled());
        let service = IdempotencyService::new(PostgrestRepository::new(through));
        let org = crate::support::harness::org();
        let hash = crate::support::harness::hash("proxy");
        // Forwarded as is, and counted.
        let first = service.claim(org, "tool.proxy", "k-1", &hash, crate::support::harness::LEASE).await;
        let claim = crate::support::harness::claimed(first);
        assert_eq!((proxy.requests("idempotency_claim"), proxy.answered("idempotency_claim")), (1, 1));
        // Delayed after the upstream answered.
        proxy.delay("idempotency_claim", Duration::from_millis(400));
        let started = Instant::now();
        let again = service.claim(org, "tool.proxy", "k-1", &hash, crate::support::harness::LEASE).await;
        assert!(matches!(again, Ok(idempotency_plane::ClaimOutcome::Processing { .. })), "{again:?}");
        assert!(started.elapsed() >= Duration::from_millis(400));
        // Dropped after the upstream answered: the claim exists, the caller heard nothing.
        proxy.clear();
        proxy.drop_next("idempotency_claim", 1);
        let lost = service.claim(org, "tool.proxy", "k-2", &hash, crate::support::harness::LEASE).await;
        assert!(lost.is_err(), "{lost:?}");
        assert_eq!(crate::support::harness::count_rows(&stack).await, 2, "the database made the claim");
        // Dropped unsent: nothing reached the database.
        proxy.drop_next_unsent("idempotency_claim", 1);
        let unsent = service.claim(org, "tool.proxy", "k-3", &hash, crate::support::harness::LEASE).await;
        assert!(unsent.is_err(), "{unsent:?}");
        assert_eq!(crate::support::harness::count_rows(&stack).await, 2);
        assert_eq!((proxy.requests("idempotency_claim"), proxy.answered("idempotency_claim")), (4, 3));
        // Rules are per function: a completion passes.
        let done = service.complete(&claim, idempotency_plane::Completion::response(serde_json::json!(1))).await;
        assert!(matches!(done, Ok(idempotency_plane::Ending::Recorded)), "{done:?}");
        assert_eq!(proxy.requests("idempotency_complete"), 1);
        // Other paths are forwarded too: the direct client and the proxied one see one database.
        let direct = IdempotencyService::new(PostgrestRepository::new(client(&stack)));
        let replay = direct.claim(org, "tool.proxy", "k-1", &hash, crate::support::harness::LEASE).await;
        assert!(matches!(replay, Ok(idempotency_plane::ClaimOutcome::Completed { .. })), "{replay:?}");
        stack.stop().await.unwrap();
    }
}
