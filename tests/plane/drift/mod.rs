//! What the crate ships, against what it must match: the embedded migrations
//! against `supabase/migrations/`, the folder the Supabase CLI pushes
//! (`migrations`), the README's code against the
//! public API (`readme`, its stack half with feature `local`), and the
//! request hash and a tool call's keys against the vectors the TypeScript
//! client checks too (`request_hash`, `keys`), and the Idempotency-Key
//! layer's credential headers against the TypeScript middleware's list and
//! the webhook gates' body limits against the TypeScript gate's
//! (`typescript`, feature `axum`).
//! Runs under default features.

mod keys;
mod migrations;
mod readme;
mod request_hash;
#[cfg(feature = "axum")]
mod typescript;
