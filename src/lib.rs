//! # idempotency-plane
//!
//! Repeating a command has the same effect as making it once, for workers
//! that reach PostgreSQL only over HTTPS through PostgREST (or Supabase).
//!
//! Layers, each using only the layers below it, never one above:
//!
//! - [`postgrest`]: an HTTP client for the plane's SQL functions, with typed
//!   errors, safe retries, and `Content-Range` checks on bounded reads.
//! - [`repo`]: the one road to the database. Four traits, one per table the
//!   plane owns (claims with the one-call claim, Runs, provider jobs, the
//!   sweeper's expired claims); [`PostgrestRepository`] implements them over
//!   PostgREST and [`MemoryRepository`] in one process; [`TenantRouter`]
//!   spreads organizations over several planes. Only this layer knows the
//!   SQL functions' names ([`repo::SQL_SURFACE`]).
//! - [`service`]: the duplicate semantics over any repository: what a read
//!   finds ([`ReadOutcome`]), how a claim ended ([`ClaimOutcome`]), request
//!   hashes (RFC 8785), what the journal can hold, input validation; and
//!   the [`EffectDriver`](service::EffectDriver), the one road from claim
//!   to journal every caller takes, with exactly three endings.
//! - [`callers`] and [`sweeper`]: the tool guard, the webhook gate (with
//!   provider callbacks), saved-search start, Run admission, the
//!   `Idempotency-Key` layer for any HTTP API (feature `axum`), and the
//!   retention sweeper, each over the driver or a repository trait.
//!
//! Beside them: the crate's [`Error`] (over the client's [`ClientError`]),
//! what every layer above the client fails with; and at the ground, below
//! the client, what the store can hold ([`Unstorable`](service::Unstorable)
//! and its measures, which the error, the repository and the service share)
//! and [`telemetry`], which names every metric the layers emit.
//!
//! Features: `cli` (default) builds the `idem` operator tool; `otel` (which
//! `cli` turns on) exports the spans and metrics over OTLP
//! (`telemetry::otel`); `axum` the HTTP integrations; `local` the embedded
//! stack. `default-features = false` keeps a library user's tree to the
//! client, the service and the callers.
//!
//! Every atomic decision is one SQL function in the database, whatever
//! client calls it; the crate decides no lease with its own clock (its
//! timers only bound how long it waits, and end before the lease does).
//!
//! The database owns every clock: callers pass lease durations, and the
//! functions compute instants from the database's clock.
//!
//! ```no_run
//! # async fn run() -> Result<(), idempotency_plane::Error> {
//! use std::time::Duration;
//! use idempotency_plane::{ClaimOutcome, ClientConfig, Completion, IdempotencyService,
//!     PostgrestClient, PostgrestRepository, RequestHash};
//!
//! let client = PostgrestClient::new(ClientConfig::new("http://localhost:3000", "service-key")?)?;
//! let service = IdempotencyService::new(PostgrestRepository::new(client));
//! let org = uuid::Uuid::new_v4();
//! let request = serde_json::json!({"to": "a@example.com", "subject": "hi"});
//! let hash = RequestHash::of_json(&request);
//! match service.claim(org, "tool.email.send", "run-1:step-3", &hash, Duration::from_secs(90)).await? {
//!     ClaimOutcome::Claimed(claim) => {
//!         // ... perform the effect, passing the vendor a key of this tenant's own
//!         // (the tool guard derives one: `ToolCall::idempotency_key`) ...
//!         let _ = service.complete(&claim, Completion::resource("email.message", "m-1")).await?;
//!     }
//!     ClaimOutcome::Completed { response, resource, .. } => { /* replay it */ }
//!     ClaimOutcome::Processing { .. } => { /* in flight elsewhere: raise or drop */ }
//!     ClaimOutcome::Conflict => { /* same key, different content */ }
//! }
//! # Ok(()) }
//! ```
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

pub mod callers;
mod error;
pub mod postgrest;
pub mod repo;
pub mod service;
mod storable;
pub mod sweeper;
pub mod telemetry;

/// SQL migrations, in order, as `(file name, contents)`: the files of
/// `supabase/migrations/`.
pub mod migrations;

#[cfg(feature = "local")]
pub mod local;

pub use error::{Error, InvalidInput};
pub use postgrest::{ClientConfig, ClientError, PostgrestClient, RetryConfig};
pub use repo::{IdempotencyRecord, IdempotencyRepository, MemoryRepository, PostgrestRepository, TenantRouter};
pub use service::{
    canonical_json, Claim, ClaimOutcome, Completion, Ending, IdempotencyService, ReadOutcome, RequestHash, ResourceRef,
    ResponseRef,
};

/// The README's Rust quick start, compiled as a doctest so it cannot drift
/// from the API it shows.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
