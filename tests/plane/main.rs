//! Contract tests of the idempotency plane.
//!
//! `stack_*` modules run against a real PostgreSQL behind the in-process
//! PostgREST-compatible server (one fresh database per test); `wire` replays
//! PostgREST's exact responses with wiremock.

#[cfg(not(feature = "local"))]
compile_error!("the tests need the embedded stack: run them with `cargo nextest run --features local` (see README.md)");

mod harness;
mod migrations_drift;
mod stack_claims;
mod stack_fences;
mod stack_surface;
mod wire;
