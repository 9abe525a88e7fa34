//! Contract tests of the idempotency plane.
//!
//! `stack_*` modules run against a real PostgreSQL behind the in-process
//! PostgREST-compatible server (one fresh database per test); `wire` replays
//! PostgREST's exact responses with wiremock.

//! The `stack_*` modules need the embedded stack (feature `local`): the
//! README's test command, `cargo test --features local`, turns it on. Without
//! it only `wire` and `migrations_drift` compile, so `cargo clippy
//! --all-targets` works on the library's default features too.

#[cfg(feature = "local")]
mod cli;
mod conformance;
#[cfg(feature = "local")]
mod harness;
#[cfg(feature = "local")]
mod hostile;
mod migrations_drift;
mod on_memory;
mod readme_surface;
mod request_hash;
#[cfg(feature = "local")]
mod stack_claims;
#[cfg(feature = "local")]
mod stack_faults;
#[cfg(feature = "local")]
mod stack_fences;
#[cfg(feature = "local")]
mod stack_indexes;
#[cfg(feature = "local")]
mod stack_load;
#[cfg(feature = "local")]
mod stack_saved_search;
#[cfg(feature = "local")]
mod stack_security;
#[cfg(feature = "local")]
mod stack_surface;
#[cfg(feature = "local")]
mod stack_sweeper;
#[cfg(feature = "local")]
mod stack_tool;
#[cfg(feature = "local")]
mod stack_webhook;
mod wire;
