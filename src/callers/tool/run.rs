//! What a guarded call is handed while it holds the claim, what the tool
//! answers, the checkpoint's decision, and how the call ended.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::service::{Answer, ResourceRef};

/// What the tool is handed while it holds the claim.
#[derive(Debug, Clone)]
pub struct ToolCall {
    pub(super) vendor_key: String,
    pub(super) lease_expires_at: chrono::DateTime<chrono::Utc>,
    pub(super) reclaimed: bool,
    pub(super) stop: CancellationToken,
}

impl ToolCall {
    /// The key to pass to the vendor (e.g. as `Idempotency-Key`) where it
    /// supports one. The same for every attempt of this call, so a vendor
    /// that dedupes turns a retry after a crash into a replay. Derived from
    /// organization, scope and key, because one vendor account serves every
    /// tenant; hex, 64 characters.
    pub fn idempotency_key(&self) -> &str {
        &self.vendor_key
    }

    /// When our lease passes, by the database clock.
    pub fn lease_expires_at(&self) -> chrono::DateTime<chrono::Utc> {
        self.lease_expires_at
    }

    /// True when this attempt took over the claim of a worker that died:
    /// the vendor may already have seen this call.
    pub fn reclaimed(&self) -> bool {
        self.reclaimed
    }

    /// Fired when the tool must stop where it stands: the call was taken
    /// over by another worker, or its heartbeats could not confirm the lease
    /// in time (the plane unreachable). Stop at the next safe point; the
    /// tool's future is dropped at the lease's confirmed end at the latest.
    pub fn stop(&self) -> &CancellationToken {
        &self.stop
    }
}

/// A tool's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolResult {
    /// True on success.
    pub ok: bool,
    /// True for a failure that made no effect and may succeed later (vendor
    /// 429 or 5xx). Never stored: the claim is released instead.
    #[serde(default, skip_serializing)]
    pub retryable: bool,
    /// The tool's output, or the failure's details.
    #[serde(default)]
    pub output: Value,
    /// A machine-readable failure code (`not_found`, `invalid_input`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The resource the effect made, stored beside the response.
    #[serde(skip)]
    pub resource: Option<ResourceRef>,
}

impl ToolResult {
    /// A success with `output`.
    pub fn success(output: Value) -> Self {
        ToolResult { ok: true, retryable: false, output, error: None, resource: None }
    }

    /// A business failure: an answer that repeating the call would give
    /// again (`not_found`, `invalid_input`). Completed and replayed.
    pub fn business_failure(error: impl Into<String>, output: Value) -> Self {
        ToolResult { ok: false, retryable: false, output, error: Some(error.into()), resource: None }
    }

    /// A failure that made no effect (vendor 429/5xx). Released, so the
    /// next attempt executes.
    pub fn retryable_failure(error: impl Into<String>, output: Value) -> Self {
        ToolResult { ok: false, retryable: true, output, error: Some(error.into()), resource: None }
    }

    /// Names the resource the effect made (e.g. `nylas.message`, its id).
    pub fn with_resource(mut self, resource_type: impl Into<String>, resource_id: impl Into<String>) -> Self {
        self.resource = Some(ResourceRef { resource_type: resource_type.into(), resource_id: resource_id.into() });
        self
    }

    /// The result a stored answer replays as. One written by another
    /// caller in another shape is a success whose output is that answer.
    pub(super) fn from_answer(answer: Answer) -> Self {
        ToolResult {
            ok: answer.ok,
            retryable: false,
            output: answer.output,
            error: answer.error,
            resource: answer.resource,
        }
    }

    /// The answer this result journals.
    pub(super) fn answer(&self) -> Answer {
        Answer { ok: self.ok, error: self.error.clone(), output: self.output.clone(), resource: self.resource.clone() }
    }
}

/// The policy checkpoint's decision, made between the read and the claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Checkpoint {
    /// Run the call now.
    Allow,
    /// Not yet (waiting on an approval): no key is taken, so the resumed
    /// step can claim it.
    Hold,
}

/// How a guarded call ended.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolRun {
    /// The tool ran in this attempt. Its answer as the journal keeps it,
    /// which is exactly what every replay answers (an error cut to its
    /// first 1 KiB, an output above the store limit by reference); a
    /// retryable failure, released, as the tool gave it.
    Executed(ToolResult),
    /// An earlier attempt ran it; this is its stored answer.
    Replayed(ToolResult),
    /// An earlier attempt reached the vendor and died before journaling
    /// its answer; the reconciler found the effect, which is now the call's
    /// journaled answer. The vendor was not called again.
    Reconciled(ToolResult),
    /// The checkpoint held the call; nothing ran and no key was taken.
    Held,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_stored_answer_reads_back_as_the_result_that_made_it() {
        let failure = ToolResult::business_failure("not_found", json!({"id": 7}));
        let stored = serde_json::to_value(&failure).unwrap();
        assert_eq!(stored, json!({"ok": false, "output": {"id": 7}, "error": "not_found"}));
        assert_eq!(ToolResult::from_answer(Answer::from_stored(Some(stored), None, None)), failure);
        // An answer stored by another caller replays as a success.
        let foreign = ToolResult::from_answer(Answer::from_stored(Some(json!({"message_id": "m"})), None, None));
        assert!(foreign.ok);
        assert_eq!(foreign.output, json!({"message_id": "m"}));
        // A foreign failure without an output is still a failure.
        let failed =
            ToolResult::from_answer(Answer::from_stored(Some(json!({"ok": false, "error": "not_found"})), None, None));
        assert!(!failed.ok);
        assert_eq!(failed.error.as_deref(), Some("not_found"));
    }
}
