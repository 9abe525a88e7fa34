//! The `idem` binary, run as a user runs it: its commands against a local
//! stack (`idem`), and `idem up` with its env file and named databases
//! (`up`, unix only). Needs feature `local` (the binary and the stack).

mod idem;
#[cfg(unix)]
mod up;
