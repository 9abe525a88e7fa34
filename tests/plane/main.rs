//! Contract tests of the idempotency plane, one test binary in folders by
//! what they test and what they run on:
//!
//! - `repository`: the repository contract, each case run on the in-memory
//!   repository and, with feature `local`, on PostgreSQL behind the
//!   in-process PostgREST-compatible server.
//! - `callers`: the callers' decisions (tool guard, webhook gate, service,
//!   effect driver), each case written once over any plane and run on the
//!   in-memory repository and, with feature `local`, on the stack; plus the
//!   gate under slow or lossy planes (wiremock, a fault-injecting wrapper).
//! - `stack`: what only a real database and server can show (SQL, wire
//!   answers of the real server, concurrency across connections, the
//!   database's clock), one fresh database per test; `stack::pg_cron` runs
//!   the README's Supabase Cron recipe on a PostgreSQL cluster of its own.
//! - `wire`: PostgREST's exact responses replayed with wiremock.
//! - `hostile`: hostile input to the pure parts, the stack and the client.
//! - `cli`: the `idem` binary, run as a user runs it; its usage errors and
//!   `--help` need no stack.
//! - `drift`: what the crate ships against what it must match (the
//!   migrations folder, the README, request-hash and key vectors).
//! - `support`: the helpers the others share.
//!
//! `stack`, `cli` (but `cli::usage`), `hostile::keys` and `support::harness` need the embedded
//! stack (feature `local`), and so do the `on_the_stack` halves of
//! `repository` and `callers`: the README's test command, `cargo test
//! --features local`, turns it on. Everything else — wiremock, property,
//! the repository contract and the callers' decisions on the in-memory
//! repository, the drift and README checks — also runs with the library's
//! default features (`cargo test`), which is what a library user compiles:
//! serde_json without the embedded server's `arbitrary_precision`.

mod callers;
mod cli;
mod drift;
mod hostile;
mod repository;
#[cfg(feature = "local")]
mod stack;
mod support;
mod wire;
