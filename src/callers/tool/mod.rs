//! The tool guard: one tool call inside a durable orchestrator's step.
//!
//! The journal is read before the policy checkpoint and claimed after it, so
//! a call a person has not yet allowed takes no key. A live claim raises
//! [`ToolError::ClaimInFlight`], which ends the step so the orchestrator runs
//! it again; it is never turned into a result. A retryable failure releases
//! the claim; success and business failures complete it.
//!
//! The module by job: what a tool is (`spec`), the keys of its calls
//! (`key`), what a call is handed and how it ends (`run`), the guard and its
//! steps (`guard`), and why a call did not answer (`error`).

mod error;
mod guard;
mod key;
mod run;
mod spec;

pub use error::ToolError;
pub use guard::{ToolGuard, DEFAULT_LEASE_MARGIN, LEASE_MARGIN_RANGE};
pub use key::{vendor_key, ToolKey};
pub use run::{Checkpoint, ToolCall, ToolResult, ToolRun};
pub use spec::{Reconciler, RepeatSafety, ToolSpec, STEP_BUDGET};

pub use crate::service::RetryHorizon;
