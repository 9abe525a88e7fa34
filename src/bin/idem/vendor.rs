//! A fake email vendor: a real HTTP server on 127.0.0.1 that dedupes sends on
//! the `Idempotency-Key` header, the way Stripe or Nylas do.
//!
//! It is the demo's effect. A new key creates one message; the same key again
//! answers that message (`replayed: true`) and creates nothing; the same key
//! with a different body is refused with 422. The ledger counts every send,
//! and the messages created per recipient: each demo effect has its own
//! recipient, so a second message for one recipient is a duplicate effect,
//! whatever keys the workers sent.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idempotency_plane::RequestHash;
use rand::Rng;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::BoxError;

/// How long the vendor takes to make an effect, so that duplicates really
/// overlap with a send in flight.
const LATENCY_MS: std::ops::RangeInclusive<u64> = 5..=30;

/// What the vendor remembers. Shared with the demo, which reads it to check
/// the effects.
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    book: Mutex<Book>,
    sends: AtomicU64,
    replayed_sends: AtomicU64,
}

#[derive(Debug, Default)]
struct Book {
    /// Idempotency key → the message it made.
    by_key: HashMap<String, Message>,
    /// Recipient → messages created for it.
    created_for: HashMap<String, u32>,
}

#[derive(Debug)]
struct Message {
    id: String,
    fingerprint: RequestHash,
}

impl Ledger {
    fn book(&self) -> MutexGuard<'_, Book> {
        // The book holds plain counters; a panic elsewhere cannot leave it torn.
        self.book.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Every POST /messages that reached the vendor, deduped or not.
    pub(crate) fn sends(&self) -> u64 {
        self.sends.load(Ordering::Relaxed)
    }

    /// Sends the vendor answered from its own idempotency cache.
    pub(crate) fn replayed_sends(&self) -> u64 {
        self.replayed_sends.load(Ordering::Relaxed)
    }

    /// Distinct messages created: the effects.
    pub(crate) fn messages(&self) -> usize {
        self.book().by_key.len()
    }

    /// Messages created for `recipient`: 1 is correct, more is a duplicate effect.
    pub(crate) fn effects_for(&self, recipient: &str) -> u32 {
        self.book().created_for.get(recipient).copied().unwrap_or(0)
    }

    /// The message `idempotency_key` created, if any.
    pub(crate) fn message_for(&self, idempotency_key: &str) -> Option<String> {
        self.book().by_key.get(idempotency_key).map(|m| m.id.clone())
    }
}

/// The running vendor. Stop it with [`Vendor::stop`].
#[derive(Debug)]
pub(crate) struct Vendor {
    address: SocketAddr,
    ledger: Arc<Ledger>,
    shutdown: oneshot::Sender<()>,
    server: JoinHandle<()>,
}

impl Vendor {
    /// Binds 127.0.0.1 on a free port and serves `POST /messages`.
    pub(crate) async fn start() -> Result<Vendor, BoxError> {
        let ledger = Arc::new(Ledger::default());
        let router = Router::new().route("/messages", post(send_message)).with_state(Arc::clone(&ledger));
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let address = listener.local_addr()?;
        let (shutdown, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            let serve = axum::serve(listener, router).with_graceful_shutdown(async {
                let _ = stopped.await;
            });
            if let Err(error) = serve.await {
                tracing::error!(%error, "the fake vendor stopped");
            }
        });
        Ok(Vendor { address, ledger, shutdown, server })
    }

    /// The vendor's ledger.
    pub(crate) fn ledger(&self) -> Arc<Ledger> {
        Arc::clone(&self.ledger)
    }

    /// A client of this vendor.
    pub(crate) fn client(&self) -> Result<VendorClient, BoxError> {
        VendorClient::new(&format!("http://{}/messages", self.address))
    }

    /// Stops serving and waits (briefly) for the server to finish.
    pub(crate) async fn stop(self) {
        let _ = self.shutdown.send(());
        let _ = tokio::time::timeout(Duration::from_secs(5), self.server).await;
    }
}

/// `POST /messages`: one message per `Idempotency-Key`.
async fn send_message(State(ledger): State<Arc<Ledger>>, headers: HeaderMap, Json(body): Json<Value>) -> Response {
    let Some(key) = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).filter(|k| !k.is_empty()) else {
        return refuse(StatusCode::BAD_REQUEST, "the Idempotency-Key header is required");
    };
    let Some(recipient) = body.get("to").and_then(Value::as_str) else {
        return refuse(StatusCode::UNPROCESSABLE_ENTITY, "`to` is required");
    };
    let latency = rand::rng().random_range(LATENCY_MS);
    tokio::time::sleep(Duration::from_millis(latency)).await;

    ledger.sends.fetch_add(1, Ordering::Relaxed);
    let fingerprint = RequestHash::of_json(&body);
    let mut book = ledger.book();
    if let Some(message) = book.by_key.get(key) {
        if message.fingerprint != fingerprint {
            return refuse(StatusCode::UNPROCESSABLE_ENTITY, "this Idempotency-Key was used with different parameters");
        }
        ledger.replayed_sends.fetch_add(1, Ordering::Relaxed);
        let answer = Json(json!({ "id": message.id, "replayed": true }));
        return (StatusCode::OK, [("idempotent-replayed", "true")], answer).into_response();
    }
    let id = format!("msg_{:06}", book.by_key.len() + 1);
    book.by_key.insert(key.to_owned(), Message { id: id.clone(), fingerprint });
    *book.created_for.entry(recipient.to_owned()).or_default() += 1;
    (StatusCode::CREATED, Json(json!({ "id": id, "replayed": false }))).into_response()
}

fn refuse(status: StatusCode, message: &str) -> Response {
    (status, Json(json!({ "error": message }))).into_response()
}

/// What the vendor answered to a send.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct Sent {
    /// The message id.
    pub(crate) id: String,
    /// True when the vendor answered from its idempotency cache.
    pub(crate) replayed: bool,
}

/// An HTTP client of the vendor. Cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct VendorClient {
    http: reqwest::Client,
    messages_url: String,
}

impl VendorClient {
    fn new(messages_url: &str) -> Result<VendorClient, BoxError> {
        let http = reqwest::Client::builder().timeout(Duration::from_secs(5)).build()?;
        Ok(VendorClient { http, messages_url: messages_url.to_owned() })
    }

    /// Sends `message`, passing the claim's key as the vendor's idempotency key.
    pub(crate) async fn send(&self, idempotency_key: &str, message: &Value) -> Result<Sent, BoxError> {
        let response =
            self.http.post(&self.messages_url).header("Idempotency-Key", idempotency_key).json(message).send().await?;
        let status = response.status();
        if !status.is_success() {
            let body = response.text().await.unwrap_or_default();
            return Err(format!("the vendor answered {status}: {body}").into());
        }
        Ok(response.json::<Sent>().await?)
    }
}
