//! The `idem` binary, run as a user runs it: `usage` checks that every
//! usage or configuration error exits 2 before any request and that every
//! `--help` names its environment (the binary alone, no stack); `idem` runs
//! its commands against a local stack, `console` runs `idem console` and
//! calls its API, and `up` runs `idem up` with its env file and named
//! databases (all three need feature `local`; `up` is unix only).

#[cfg(feature = "local")]
mod console;
#[cfg(feature = "local")]
mod idem;
#[cfg(all(feature = "local", unix))]
mod up;
#[cfg(feature = "cli")]
mod usage;
