//! What a tool is: its scope, its timeout, and how a repeat of its call is
//! made safe.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use serde_json::Value;

use super::error::ToolError;
use super::run::{ToolCall, ToolResult};

/// The longest a tool call may run: the orchestrator's step budget.
pub const STEP_BUDGET: Duration = Duration::from_secs(120);

/// Asks the vendor whether a call's effect already happened, and what it
/// returned: `Ok(Some(result))` when it did, `Ok(None)` when it did not,
/// `Err(reason)` when the vendor cannot tell right now.
pub type Reconciler =
    Arc<dyn Fn(ToolCall, Value) -> BoxFuture<'static, Result<Option<ToolResult>, String>> + Send + Sync>;

/// How a repeat of a tool call is made safe after a worker died mid-call.
///
/// Postgres cannot commit atomically with a vendor's API: a worker can reach
/// the vendor and die before it journals the answer, and the next attempt
/// then reclaims the call. Either the vendor recognizes the repeat, or the
/// guard asks it first. A tool must say which; there is no third choice.
#[derive(Clone)]
pub enum RepeatSafety {
    /// The vendor dedupes on the key the guard hands the tool
    /// ([`ToolCall::idempotency_key`]), so a repeat is a replay at the vendor.
    VendorKey,
    /// The vendor takes no key. Before a reclaimed call runs, the guard
    /// calls the reconciler: an effect it finds is journaled as the call's
    /// answer and the vendor is not called again; otherwise the call runs
    /// once.
    Reconcile(Reconciler),
}

impl RepeatSafety {
    /// [`RepeatSafety::Reconcile`] with `check`, e.g. a search of the
    /// vendor's sent items for a reference the tool attached to the call.
    pub fn reconcile<F, Fut>(check: F) -> Self
    where
        F: Fn(ToolCall, Value) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Option<ToolResult>, String>> + Send + 'static,
    {
        RepeatSafety::Reconcile(Arc::new(move |call, arguments| Box::pin(check(call, arguments))))
    }
}

impl fmt::Debug for RepeatSafety {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RepeatSafety::VendorKey => "VendorKey",
            RepeatSafety::Reconcile(_) => "Reconcile(..)",
        })
    }
}

/// A tool's scope, timeout and how its repeats are made safe, checked once.
#[derive(Debug, Clone)]
pub struct ToolSpec {
    pub(super) scope: String,
    pub(super) timeout: Duration,
    pub(super) repeat: RepeatSafety,
}

impl ToolSpec {
    /// A tool under `scope` (which must start with `tool.`) whose calls
    /// finish within `timeout` (at most [`STEP_BUDGET`]), made safe to repeat
    /// by `repeat`.
    pub fn new(scope: impl Into<String>, timeout: Duration, repeat: RepeatSafety) -> Result<Self, ToolError> {
        let scope = scope.into();
        if !scope.starts_with("tool.") || scope.len() == "tool.".len() {
            return Err(ToolError::NotAToolScope { scope });
        }
        if timeout.is_zero() || timeout > STEP_BUDGET {
            return Err(ToolError::TimeoutOutOfRange { timeout, budget: STEP_BUDGET });
        }
        Ok(ToolSpec { scope, timeout, repeat })
    }

    /// The scope, e.g. `tool.email.send`.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The call's timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// How a repeat of its call is made safe.
    pub fn repeat_safety(&self) -> &RepeatSafety {
        &self.repeat
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(scope: &str, timeout: Duration) -> Result<ToolSpec, ToolError> {
        ToolSpec::new(scope, timeout, RepeatSafety::VendorKey)
    }

    #[test]
    fn a_tool_spec_refuses_timeouts_above_the_step_budget_and_non_tool_scopes() {
        assert!(spec("tool.email.send", STEP_BUDGET).is_ok());
        assert!(matches!(
            spec("tool.email.send", STEP_BUDGET + Duration::from_millis(1)),
            Err(ToolError::TimeoutOutOfRange { .. })
        ));
        assert!(matches!(spec("tool.email.send", Duration::ZERO), Err(ToolError::TimeoutOutOfRange { .. })));
        for scope in ["webhook.nylas", "tool.", "email.send"] {
            assert!(matches!(spec(scope, Duration::from_secs(5)), Err(ToolError::NotAToolScope { .. })));
        }
    }
}
