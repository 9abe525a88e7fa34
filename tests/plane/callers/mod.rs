//! The callers' decisions: the effect driver's ending rules (`endings`, on
//! every backend through a fault-injecting wrapper), the webhook gate under
//! slow planes (`gate_deadlines`, wiremock) and lossy ones (`gate_endings`,
//! the in-memory repository behind the wrapper), and the service, tool
//! guard and gate on the in-memory repository (`on_memory`). Runs under
//! default features; the `on_the_stack` halves need feature `local`.

mod endings;
mod gate_deadlines;
mod gate_endings;
#[cfg(feature = "local")]
mod tool;
#[cfg(feature = "local")]
mod webhook;
