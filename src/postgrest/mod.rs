//! A PostgREST client for calling the plane's SQL functions over HTTPS.
//!
//! Works against plain PostgREST (`http://host:3000`) and Supabase
//! (`https://<ref>.supabase.co/rest/v1`). Knows the server's row cap, refuses
//! bounds above it, and reads `Content-Range` so a truncated read is an error.

mod client;
pub mod codes;
mod config;
mod env;
mod error;
mod key;
mod range;
mod retry;
mod rpc_policy;

pub use client::PostgrestClient;
pub use config::{
    ClientConfig, DEFAULT_DEADLINE, DEFAULT_MAX_RESPONSE_BYTES, DEFAULT_MAX_ROWS, MAX_MAX_ROWS, PLAIN_HTTP_HOSTS_VAR,
};
pub use env::{
    service_keys_in, service_keys_in_env, DEFAULT_SECRET_KEY_NAME, SECRET_KEYS_VAR, SECRET_KEY_NAME_VAR,
    SERVICE_KEY_VARIABLES,
};
pub use error::{ClientError, PostgrestError, TransportKind};
pub use key::{Gateway, KeyError, KeyKind};
pub use range::{ContentRange, ContentRangeError};
pub use retry::{Repeat, RetryConfig};
#[cfg(test)]
pub(crate) use rpc_policy::functions as rpc_policy_functions;
