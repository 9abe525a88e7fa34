//! The helpers the other folders share: the backends generic cases run
//! on (`backends`: the in-memory plane always, a local stack with feature
//! `local`), a fault-injecting repository
//! (`faults`), an HTTP proxy that delays or drops chosen RPC answers
//! (`proxy`), PostgreSQL clusters of a test's own to crash, fail over or
//! exhaust (`cluster`, feature `local`) and a TCP forwarder in front of one
//! that can cut the network or move to another server (`tcp_forward`),
//! retry policies, canned claim rows
//! and raw TCP fault servers
//! (`transport`), and one fresh local stack per test with ways to look
//! under it (`harness`, feature `local`). Everything but `harness` compiles
//! under default features.
//!
//! This module itself holds the small helpers every folder uses, defined
//! once: a lease, a request hash, an organization, the claim a `claim()`
//! answered, and bounded waits.

// Some of these serve only modules that need feature `local`.
#![cfg_attr(not(feature = "local"), allow(dead_code))]

pub mod backends;
#[cfg(feature = "local")]
pub mod cluster;
pub mod faults;
#[cfg(feature = "local")]
pub mod harness;
pub mod proxy;
#[cfg(feature = "local")]
pub mod tcp_forward;
pub mod transport;

use std::future::Future;
use std::time::Duration;

use idempotency_plane::{Claim, ClaimOutcome, Error, RequestHash};
use uuid::Uuid;

/// Runs each named case, an `async fn` of the calling module, twice: in
/// `in_memory::<case>`, and with feature `local` in `on_the_stack::<case>`
/// on a fresh local stack, stopped after the case. Each side says how a
/// case is called: `|case| …` and `|case, stack| …`. With the cases alone,
/// a case takes the plane itself (`&impl Plane`): a fresh in-memory plane,
/// or the stack.
// The observability tests share this module and run no case on every plane.
#[allow(unused_macros)]
macro_rules! on_every_plane {
    (
        in_memory: |$m:ident| $in_memory:expr,
        on_the_stack: |$s:ident, $stack:ident| $on_stack:expr;
        $($case:ident),* $(,)?
    ) => {
        mod in_memory {
            $(
                #[tokio::test]
                async fn $case() {
                    let $m = super::$case;
                    $in_memory
                }
            )*
        }

        #[cfg(feature = "local")]
        mod on_the_stack {
            $(
                #[tokio::test]
                async fn $case() {
                    let $stack = crate::support::harness::stack().await;
                    let $s = super::$case;
                    $on_stack;
                    $stack.stop().await.unwrap();
                }
            )*
        }
    };
    ($($case:ident),* $(,)?) => {
        crate::support::on_every_plane!(
            in_memory: |case| case(&crate::support::backends::OnMemory::default()).await,
            on_the_stack: |case, stack| case(&stack).await;
            $($case),*
        );
    };
}
pub(crate) use on_every_plane;

/// The lease most tests claim with: long enough that it never passes
/// unless a test moves it.
pub const LEASE: Duration = Duration::from_secs(60);

/// How long a test waits for something another task or the server does:
/// long enough for a machine busy with the rest of the suite, short enough
/// that a hang fails the test instead of the run.
pub const WAIT: Duration = Duration::from_secs(30);

/// A fresh organization.
/// `n` fresh lease tokens, for a re-drive (one per orphan it may take
/// over); leaked, so a call built from them can be kept anywhere.
pub fn lease_tokens(n: u64) -> &'static [Uuid] {
    Box::leak((0..n).map(|_| Uuid::new_v4()).collect::<Vec<_>>().into_boxed_slice())
}

pub fn org() -> Uuid {
    Uuid::new_v4()
}

/// The request hash of `{"content": content}`.
pub fn hash(content: &str) -> RequestHash {
    RequestHash::of_json(&serde_json::json!({ "content": content }))
}

/// The claim a `claim()` answered; panics with whatever else it answered.
pub fn claimed(outcome: Result<ClaimOutcome, Error>) -> Claim {
    match outcome {
        Ok(ClaimOutcome::Claimed(claim)) => claim,
        other => panic!("expected to own the key, got {other:?}"),
    }
}

/// Polls `done` until it holds; panics naming `what` after [`WAIT`].
pub async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let polled = tokio::time::timeout(WAIT, async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    if polled.await.is_err() {
        panic!("{what}: did not happen within {WAIT:?}");
    }
}

/// Awaits `future`; panics naming `what` after `limit`.
pub async fn within<T>(limit: Duration, what: &str, future: impl Future<Output = T>) -> T {
    match tokio::time::timeout(limit, future).await {
        Ok(value) => value,
        Err(_) => panic!("{what}: not done within {limit:?}"),
    }
}
