//! Contract tests of the idempotency plane.
//!
//! `stack_*` modules run against a real PostgreSQL behind the in-process
//! PostgREST-compatible server (one fresh database per test); `wire_*`
//! replay PostgREST's exact responses with wiremock; `hostile_*` feed hostile
//! input to the pure parts, the stack and the client; `support` holds the
//! helpers several of them share, and `proxy` a reverse proxy that delays
//! or drops chosen RPC answers of a real server. `pg_cron` runs the README's
//! Supabase Cron recipe through pg_cron, on a PostgreSQL cluster of its own.

//! The `stack_*`, `hostile_keys`, `cli`, `pg_cron` and `harness` modules need the
//! embedded stack (feature `local`): the README's test command, `cargo test
//! --features local`, turns it on. Everything else — wiremock, property,
//! conformance on the in-memory repository, callers on it, the drift and
//! README checks — also runs with the library's default features (`cargo
//! test`), which is what a library user compiles: serde_json without the
//! embedded server's `arbitrary_precision`.

#[cfg(feature = "local")]
mod cli;
#[cfg(all(feature = "local", unix))]
mod cli_up;
mod conformance;
mod endings;
mod faults;
mod gate_deadlines;
mod gate_endings;
#[cfg(feature = "local")]
mod harness;
mod hostile;
mod hostile_answers;
mod hostile_content_range;
mod hostile_hashes;
#[cfg(feature = "local")]
mod hostile_keys;
mod hostile_servers;
mod hostile_validation;
mod migrations_drift;
mod on_memory;
#[cfg(feature = "local")]
mod pg_cron;
mod proxy;
#[cfg(feature = "local")]
mod random_endings;
mod readme_surface;
mod request_hash;
#[cfg(feature = "local")]
mod stack_arguments;
#[cfg(feature = "local")]
mod stack_claims;
#[cfg(feature = "local")]
mod stack_endings;
#[cfg(feature = "local")]
mod stack_faults;
#[cfg(feature = "local")]
mod stack_fences;
#[cfg(feature = "local")]
mod stack_idempotency_key;
#[cfg(feature = "local")]
mod stack_indexes;
#[cfg(feature = "local")]
mod stack_load;
#[cfg(feature = "local")]
mod stack_saved_search;
#[cfg(feature = "local")]
mod stack_security;
#[cfg(feature = "local")]
mod stack_sql_sweep;
#[cfg(feature = "local")]
mod stack_supabase_paths;
#[cfg(feature = "local")]
mod stack_surface;
#[cfg(feature = "local")]
mod stack_sweeper;
#[cfg(feature = "local")]
mod stack_tool;
#[cfg(feature = "local")]
mod stack_webhook;
mod support;
mod wire;
mod wire_claims;
mod wire_deadlines;
mod wire_errors;
mod wire_keys;
mod wire_ranges;
mod wire_retries;
