//! The embedded local stack: a fresh PostgreSQL database with the migrations
//! applied, served by an in-process PostgREST-compatible server
//! (`postrust-server` in compatibility mode) on an ephemeral loopback port.
//!
//! Used by the tests, `idem demo` and `idem up`. Needs a PostgreSQL it can
//! create databases on: `DATABASE_URL`, else `postgres://postgres@127.0.0.1:5432/postgres`.
//! The database is dropped by [`LocalStack::stop`], or on drop, unless it is
//! a named one ([`LocalStackConfig::with_database`]), which is kept across
//! starts.
//!
//! The server answers as Supabase's API does: at its root (as plain
//! PostgREST, which the Rust client and `curl` use) and beneath
//! [`SUPABASE_REST_PATH`] (`/rest/v1`, where supabase-js calls), exposing the
//! schemas `supabase/config.toml` lists ([`exposed_schemas`]), the first of
//! which (`public`) is the default: a request that names no schema
//! (`Content-Profile` / `Accept-Profile`) does not reach `agent`, as on
//! Supabase.
//!
//! The migrations are applied once per migration set, into a template
//! database named after a digest of every embedded migration
//! (`idem_tpl_<16 hex>`), and each stack's database is a copy of it
//! (`CREATE DATABASE ... TEMPLATE`): a changed migration names a new template,
//! never a stale one. The template is built under the cluster-wide advisory
//! lock the migrations always took, under a temporary name that is renamed
//! only once every migration applied, and nobody may connect to it
//! (`ALLOW_CONNECTIONS false`), so a copy never waits on a stray session.
//!
//! One job per file: [`LocalStack`]'s start, restart and stop (`stack`); how
//! to start one (`config`); the database it serves and the clean-up of
//! leftovers (`database`, `database_name`); the migrations' template
//! database (`template`); the server (`server`) and its port (`ports`); the
//! cluster's maintenance connection and catalog helpers (`cluster`); the
//! keys (`jwt`, and Supabase's `sb_` keys with the gateway that maps them
//! to roles beneath `/rest/v1`: `api_keys`); the login the server serves as (`authenticator`); what
//! the server lets in (`guard`: loopback hosts, tokens of the API roles, no
//! CORS unless asked); and why a start failed (`error`).

mod api_keys;
mod authenticator;
mod cluster;
mod config;
mod database;
mod database_name;
mod error;
mod guard;
mod jwt;
mod ports;
mod queues;
mod server;
mod stack;
mod template;

pub use api_keys::{SUPABASE_CLI_PUBLISHABLE_KEY, SUPABASE_CLI_SECRET_KEY};
pub use authenticator::{AUTHENTICATOR, AUTHENTICATOR_PASSWORD_VAR};
pub use config::{LocalStackConfig, DEFAULT_DATABASE_URL};
pub use database_name::{DatabaseName, DatabaseNameError};
pub use error::LocalError;
pub use jwt::{mint_stable_token, mint_token, STABLE_KEY_EXPIRES_AT, SUPABASE_CLI_JWT_SECRET};
pub use queues::{check_queue_name, QUEUES_SCHEMA};
pub use server::{exposed_schemas, SUPABASE_REST_PATH};
pub use stack::LocalStack;
