//! The tool guard's decisions, by job.

mod runs;
pub(crate) use runs::{allow, guard, spec};
