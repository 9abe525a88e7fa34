//! What only a real database and server can show, on a fresh PostgreSQL
//! database behind the in-process PostgREST-compatible server per test:
//! SQL and its grants, the server's wire answers, concurrency across
//! connections, the database's clock, faults between a worker and its plane
//! (a proxy that delays or drops answers), the `Idempotency-Key` layer and
//! the axum routes over HTTP, the saved-search start, the sweeper, and
//! every caller at random under faults (`callers_under_faults`, sorted
//! away from the other heavy modules: tests start in name order, eight at
//! a time, and PostgreSQL allows 100 connections). `pg_cron` runs the
//! README's Supabase Cron recipe on a PostgreSQL cluster of its own. The
//! whole folder needs feature `local`.

mod api_keys;
mod arguments;
mod batches;
mod callers_under_faults;
mod claims;
mod connections_exhausted;
mod database_crash;
mod declared_schema;
mod endings;
mod failover;
mod faults;
mod fences;
mod hangups;
mod idempotency_key;
mod indexes;
mod layout;
mod load;
mod local_doors;
mod nothing_held_by_nobody;
mod one_holder;
mod operator;
mod partition;
mod pg_cron;
mod queues;
mod redrive;
mod request_hash;
mod saved_search;
mod security;
mod server_version;
mod sql_sweep;
mod supabase_paths;
mod surface;
mod sweeper;
mod tool;
mod webhook;
mod webhook_redrive;
