//! The callers of the plane, one module each: they turn the service's five
//! endings into what their boundary needs.
//!
//! - [`tool`]: a tool call inside an orchestrator step (raises on in-flight).
//! - [`webhook`]: the HTTP boundary (every duplicate is an ACK with a reason),
//!   and provider callbacks that resolve their tenant first.
//! - [`queue`]: Supabase Queues (pgmq) consumed effectively once, a batch
//!   at a time.
//! - [`saved_search`]: the one surface claim before Run admission.
//! - [`runs`]: Run admission through `agent.runs`, never the claim table.
//! - [`route`]: who may call a worker's scheduled routes (a re-drive, a
//!   queue drain), checked in constant time.
//! - `idempotency_key` (feature `axum`): `Idempotency-Key` for any HTTP API,
//!   as a tower layer.

pub mod queue;
pub mod route;
pub mod runs;
pub mod saved_search;
pub mod tool;
pub mod webhook;

#[cfg(feature = "axum")]
pub mod http;
#[cfg(feature = "axum")]
pub mod idempotency_key;
