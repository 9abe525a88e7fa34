//! The `Idempotency-Key` layer under network faults: clients of two callers
//! of one tenant, two replicas behind the layer, a proxy that delays or
//! drops the plane's answers.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_plane::callers::idempotency_key::IdempotencyKeyLayer;
use idempotency_plane::{IdempotencyService, PostgrestClient, PostgrestRepository, RetryConfig};
use rand::Rng;
use serde_json::{json, Value};
use uuid::Uuid;

use crate::support::harness::stack;
use crate::support::proxy::RpcProxy;

use super::{ms, rng, seed, Tally};

const HTTP_KEYS: usize = 10;
const CALLERS: [&str; 2] = ["alice", "bob"];
const REPLICAS: usize = 2;
/// How long the fault schedule runs.
const HTTP_CHAOS: Duration = ms(4000);
/// How many times one client sends its request at most.
const CLIENT_TRIES: usize = 60;
/// The handler's timeout, counted from before the claim; with the 1 s
/// journal deadline and a 1 s margin (the floor), a 3.5 s lease. A claim answered late
/// leaves the handler less of it: the handler pauses (at most 40 ms) before
/// its effect and makes the effect and its answer in one poll, so a cut
/// never falls between them (one before the effect is a 504, and the retry
/// runs cleanly).
const HANDLER_TIMEOUT: Duration = ms(1500);
/// The plane client's deadline: a claim answer later than this is a 503.
const CLIENT_DEADLINE: Duration = ms(1200);

/// The API's effects, one per handler run that reached it: who it was for.
#[derive(Clone)]
struct Shop {
    seed: u64,
    runs: Arc<AtomicUsize>,
    effects: Arc<Mutex<Vec<(String, String)>>>,
}

impl Shop {
    fn effects_for(&self, caller: &str, key: &str) -> Vec<usize> {
        let effects = self.effects.lock().unwrap();
        let made = effects.iter().enumerate().filter(|(_, (c, k))| c == caller && k == key);
        made.map(|(effect, _)| effect).collect()
    }
}

/// `POST /orders`: pauses a little, then makes one counted effect for the
/// (caller, key) and answers a body naming it: 201 with the order, or, when
/// the order asks for it, 403, a business refusal the layer journals too.
/// Never a 5xx, a 429 or a panic: no answer of its own is one the layer
/// releases, so a second effect for one (caller, key) is never legitimate.
async fn place_order(
    axum::extract::State(shop): axum::extract::State<Shop>,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> axum::response::Response {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    let (caller, key) = (header("x-user"), header("idempotency-key"));
    let run = shop.runs.fetch_add(1, Ordering::SeqCst);
    tokio::time::sleep(ms(rng(shop.seed, &[0x5409, run as u64]).random_range(0..40))).await;
    let order: Value = serde_json::from_slice(&body).expect("the clients send JSON");
    // The effect and the answer, with no await between them.
    let effect = {
        let mut effects = shop.effects.lock().unwrap();
        effects.push((caller.clone(), key.clone()));
        effects.len() - 1
    };
    let (status, answer) = if order["decline"] == json!(true) {
        (403, json!({"error": "declined", "effect": effect, "caller": caller, "key": key}))
    } else {
        (201, json!({"effect": effect, "caller": caller, "key": key, "order": order}))
    };
    axum::response::Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .header("location", format!("/orders/{effect}"))
        .body(axum::body::Body::from(serde_json::to_vec(&answer).expect("an answer")))
        .expect("a response")
}

/// One answer a client got.
#[derive(Debug, Clone)]
struct Got {
    status: u16,
    content_type: Option<String>,
    location: Option<String>,
    replayed: Option<String>,
    body: bytes::Bytes,
}

impl Got {
    /// The handler's answer (first or replayed): the API's own JSON, not
    /// one of the layer's problems.
    fn is_handlers(&self) -> bool {
        self.content_type.as_deref() == Some("application/json")
    }

    /// The layer's problem type, for one of its own answers.
    fn problem(&self) -> Option<String> {
        if self.content_type.as_deref() != Some("application/problem+json") {
            return None;
        }
        let problem: Value = serde_json::from_slice(&self.body).ok()?;
        // `…#idempotency-key-problems-<slug>`
        Some(problem["type"].as_str()?.rsplit_once("problems-")?.1.to_owned())
    }
}

/// One (caller, key) and what its clients got.
struct Pair {
    caller: &'static str,
    key: String,
    body: String,
    got: Mutex<Vec<Got>>,
}

/// Everything a client needs, owned.
#[derive(Clone)]
struct Clients {
    http: reqwest::Client,
    urls: Arc<Vec<String>>,
    seed: u64,
    tally: Tally,
}

impl Clients {
    /// Sends `pair`'s request, to a replica drawn each time, until the
    /// handler's answer (first or replayed) came `wanted` times, as a client
    /// that lost an answer sends again, or `tries` ran out; again after the
    /// layer's own 409, 503 or 504, which leave the key to a retry.
    async fn send(self, n: usize, client: usize, pair: Arc<Pair>, wanted: usize, tries: usize) {
        let mut draw = rng(self.seed, &[0xC11E, n as u64, client as u64]);
        let mut answered = 0;
        for _ in 0..tries {
            let url = &self.urls[draw.random_range(0..self.urls.len())];
            let response = self
                .http
                .post(format!("{url}/orders"))
                .header("idempotency-key", &pair.key)
                .header("x-user", pair.caller)
                .header("content-type", "application/json")
                .body(pair.body.clone())
                .send()
                .await
                .expect("the API answers");
            let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
            let (status, content_type, location, replayed) =
                (response.status().as_u16(), header("content-type"), header("location"), header("idempotent-replayed"));
            let body = response.bytes().await.expect("the answer's body");
            let got = Got { status, content_type, location, replayed, body };
            pair.got.lock().unwrap().push(got.clone());
            if got.is_handlers() {
                self.tally.add(if got.replayed.is_some() { "replayed" } else { "handled" });
                answered += 1;
                if answered == wanted {
                    return;
                }
                tokio::time::sleep(ms(draw.random_range(100..600))).await;
                continue;
            }
            match got.problem().as_deref() {
                Some(slug @ ("in-flight" | "unavailable" | "handler-timeout")) => {
                    self.tally.add(match slug {
                        "in-flight" => "in-flight",
                        "unavailable" => "unavailable",
                        _ => "handler-timeout",
                    });
                    tokio::time::sleep(ms(draw.random_range(50..200))).await;
                }
                _ => panic!(
                    "seed {}: {} with key {}: the layer answered {status} {:?}",
                    self.seed,
                    pair.caller,
                    pair.key,
                    String::from_utf8_lossy(&got.body)
                ),
            }
        }
    }
}

/// Changes the proxy's rules every 150–400 ms until `chaos` has passed:
/// answers of `idempotency_claim` and `idempotency_complete` late (within
/// the client's deadline or beyond it; the journal's within its deadline or
/// beyond it) or dropped after the database answered. Never a request held
/// or dropped before it reaches the database: every journal sent lands
/// while its claim is held, so no handler is run twice for a key by a
/// journal that never landed.
async fn network_faults(proxy: Arc<RpcProxy>, seed: u64, chaos: Duration) -> Tally {
    const CLAIM: &str = "idempotency_claim";
    const COMPLETE: &str = "idempotency_complete";
    let mut draw = rng(seed, &[0x4E7]);
    let end = tokio::time::Instant::now() + chaos;
    let rules = Tally::default();
    while tokio::time::Instant::now() < end {
        proxy.clear();
        match draw.random_range(0..100) {
            0..25 => rules.add("claim clean"),
            25..50 => {
                rules.add("claim late");
                proxy.delay(CLAIM, ms(draw.random_range(50..900)));
            }
            50..60 => {
                rules.add("claim later than the client's deadline");
                proxy.delay(CLAIM, CLIENT_DEADLINE + ms(300));
            }
            _ => {
                rules.add("claim answers dropped");
                proxy.drop_next(CLAIM, draw.random_range(1..=3));
            }
        }
        match draw.random_range(0..100) {
            0..30 => rules.add("journal clean"),
            30..55 => {
                rules.add("journal late");
                proxy.delay(COMPLETE, ms(draw.random_range(50..800)));
            }
            55..70 => {
                rules.add("journal later than its deadline");
                proxy.delay(COMPLETE, ms(2500));
            }
            _ => {
                rules.add("journal answers dropped");
                proxy.drop_next(COMPLETE, draw.random_range(1..=3));
            }
        }
        tokio::time::sleep(ms(draw.random_range(150..400))).await;
    }
    proxy.clear();
    rules
}

/// Clients of two callers of one tenant send each key's request
/// concurrently, retrying, to two replicas of an API behind the layer,
/// whose plane's claim and journal answers are late or lost; some keys are
/// used by both callers with the same body. Per (caller, key): the handler
/// made its effect exactly once; every answer of the handler a client got
/// is the first one, byte for byte, and every one but the first says it is
/// replayed; and each answer names an effect made for that caller and key,
/// never the other caller's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomized_idempotency_keys_run_each_callers_request_once_and_replay_its_first_answer() {
    let seed = seed("idempotency keys");
    let stack = stack().await;
    let proxy = Arc::new(RpcProxy::start(stack.url()).await);
    let shop = Shop { seed, runs: Arc::default(), effects: Arc::default() };
    let tenant = Uuid::new_v4();
    let mut urls = Vec::new();
    for _ in 0..REPLICAS {
        // Each replica has its own client of the plane, which does not retry
        // itself: a lost answer is the layer's to handle.
        let config = proxy
            .client_config(stack.service_key())
            .with_retry(RetryConfig::disabled())
            .with_deadline(CLIENT_DEADLINE)
            .expect("a deadline");
        let service =
            IdempotencyService::new(PostgrestRepository::new(PostgrestClient::new(config).expect("a client")));
        let layer = IdempotencyKeyLayer::new(service, move |_| Some(tenant))
            .principal(|parts| parts.headers.get("x-user")?.to_str().ok().map(str::to_owned))
            .handler_timeout(HANDLER_TIMEOUT, ms(1000))
            .and_then(|layer| layer.journal_deadline(ms(1000)))
            .expect("a lease the plane accepts");
        let app = axum::Router::new()
            .route("/orders", axum::routing::post(place_order))
            .route_layer(layer)
            .with_state(shop.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        urls.push(format!("http://{}", listener.local_addr().expect("an address")));
        tokio::spawn(async move { axum::serve(listener, app).await });
    }
    let clients = Clients { http: reqwest::Client::new(), urls: Arc::new(urls), seed, tally: Tally::default() };

    let mut pairs: Vec<Arc<Pair>> = Vec::new();
    for n in 0..HTTP_KEYS {
        let mut draw = rng(seed, &[0x0B5E, n as u64]);
        let callers: &[&'static str] = match draw.random_range(0..3) {
            0 => &CALLERS[..1],
            1 => &CALLERS[1..],
            _ => &CALLERS,
        };
        let body = json!({"item": n, "decline": draw.random_bool(0.3)}).to_string();
        for &caller in callers {
            pairs.push(Arc::new(Pair { caller, key: format!("order-{n}"), body: body.clone(), got: Mutex::default() }));
        }
    }

    let faults = tokio::spawn(network_faults(proxy.clone(), seed, HTTP_CHAOS));
    let mut sends = Vec::new();
    for (n, pair) in pairs.iter().enumerate() {
        let mut draw = rng(seed, &[0xC0C0, n as u64]);
        for client in 0..draw.random_range(2..=4) {
            let (start, wanted) = (ms(draw.random_range(0..2500)), draw.random_range(1..=3));
            let (clients, pair) = (clients.clone(), pair.clone());
            sends.push(tokio::spawn(async move {
                tokio::time::sleep(start).await;
                clients.send(n, client, pair, wanted, CLIENT_TRIES).await;
            }));
        }
    }
    let rules = faults.await.expect("the fault schedule");
    for send in sends {
        send.await.expect("a client panicked");
    }
    // The network is clean; one more client per (caller, key), until answered.
    for (n, pair) in pairs.iter().enumerate() {
        clients.clone().send(n, 99, pair.clone(), 1, 200).await;
    }
    println!(
        "idempotency keys: {} (caller, key) pairs, {} handler runs; answers {}; network {rules}; \
         claim requests {}, journal requests {}",
        pairs.len(),
        shop.runs.load(Ordering::SeqCst),
        clients.tally,
        proxy.requests("idempotency_claim"),
        proxy.requests("idempotency_complete"),
    );

    let effects = shop.effects.lock().unwrap().clone();
    for pair in &pairs {
        let context = format!("seed {seed}, {} with key {}", pair.caller, pair.key);
        let made = shop.effects_for(pair.caller, &pair.key);
        assert_eq!(made.len(), 1, "{context}: the handler made {} effects: {made:?}", made.len());
        let got = pair.got.lock().unwrap().clone();
        let answers: Vec<&Got> = got.iter().filter(|got| got.is_handlers()).collect();
        let firsts: Vec<&Got> = answers.iter().copied().filter(|got| got.replayed.is_none()).collect();
        assert_eq!(firsts.len(), 1, "{context}: {} answers not marked replayed: {firsts:?}", firsts.len());
        let first = firsts[0];
        let named: Value = serde_json::from_slice(&first.body).expect("the handler's JSON");
        assert_eq!(named["effect"], json!(made[0]), "{context}: the first answer names another effect: {named}");
        assert_eq!((named["caller"].as_str(), named["key"].as_str()), (Some(pair.caller), Some(&*pair.key)));
        let declined = pair.body.contains(r#""decline":true"#);
        assert_eq!(first.status, if declined { 403 } else { 201 }, "{context}: {first:?}");
        for answer in &answers {
            let named: Value = serde_json::from_slice(&answer.body).expect("the handler's JSON");
            let owner = named["effect"].as_u64().and_then(|effect| effects.get(effect as usize));
            assert_eq!(
                owner,
                Some(&(pair.caller.to_owned(), pair.key.clone())),
                "{context}: received an answer produced for another (caller, key): {named}"
            );
            let same = (answer.status, &answer.content_type, &answer.location, &answer.body);
            assert_eq!(
                same,
                (first.status, &first.content_type, &first.location, &first.body),
                "{context}: an answer other than the first"
            );
            if !std::ptr::eq(*answer, first) {
                assert_eq!(answer.replayed.as_deref(), Some("true"), "{context}: {answer:?}");
            }
        }
    }
    assert_eq!(effects.len(), pairs.len(), "seed {seed}: effects for no (caller, key) of the test: {effects:?}");
    stack.stop().await.unwrap();
}
