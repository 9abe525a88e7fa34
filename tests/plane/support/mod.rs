//! The helpers the other folders share: a fault-injecting repository
//! (`faults`), an HTTP proxy that delays or drops chosen RPC answers
//! (`proxy`), retry policies, canned claim rows and raw TCP fault servers
//! (`transport`), and one fresh local stack per test with ways to look
//! under it (`harness`, feature `local`). Everything but `harness` compiles
//! under default features.

pub mod faults;
#[cfg(feature = "local")]
pub mod harness;
pub mod proxy;
pub mod transport;
