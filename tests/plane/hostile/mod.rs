//! Hostile input: property tests of the pure parts (Content-Range in
//! `content_range`, request hashes in `hashes`, key/scope/lease validation
//! in `validation`), hostile keys on the real stack (`keys`), and servers
//! that answer garbage (wiremock in `answers`, and a raw TCP server for what
//! wiremock cannot send in `servers`). This module holds what they share.
//!
//! All but `keys` (the real stack, feature `local`) run under every feature
//! set, so the request-hash properties hold for serde_json's default number
//! handling (with `float_roundtrip`) as well as for the embedded server's
//! `arbitrary_precision`.

mod answers;
mod content_range;
mod hashes;
#[cfg(feature = "local")]
mod keys;
mod servers;
mod validation;

use std::time::Duration;

use idempotency_plane::postgrest::{ClientConfig, PostgrestClient, RetryConfig};
use idempotency_plane::PostgrestRepository;
use proptest::test_runner::Config as ProptestConfig;

use crate::support::transport::KEY;

pub const SCOPE: &str = "tool.hostile.input";

/// What `fast_retry` is given here: no retry starts after 5 s.
pub const RETRY_WITHIN: Duration = Duration::from_secs(5);

/// 256 cases, no regression files written into the tree.
pub fn proptest_config() -> ProptestConfig {
    ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() }
}

/// A client of a test server at `url`: 2 s per request, no idle connection
/// kept (so one connection per request).
pub fn client_for(url: &str, retry: RetryConfig) -> PostgrestClient {
    let config = ClientConfig::new(url, KEY)
        .expect("config")
        .with_retry(retry)
        .with_request_timeout(Duration::from_secs(2))
        .with_pool_max_idle_per_host(0);
    PostgrestClient::new(config).expect("client")
}

pub fn repository_for(url: &str, retry: RetryConfig) -> PostgrestRepository {
    PostgrestRepository::new(client_for(url, retry))
}
