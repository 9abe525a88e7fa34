//! What reaches the gate: one delivery (or a provider's callback, which
//! names a job rather than a tenant), and what its processing may fail with.

use uuid::Uuid;

/// A processing failure, as the caller's handler reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessingError {
    /// True when the failure made no effect and trying again may succeed:
    /// the gate tries again, with backoff, within the processing timeout.
    /// False for a failure that would repeat: it is journaled as the
    /// delivery's answer and ACKed.
    pub retryable: bool,
    /// What went wrong, for the log and the stored answer.
    pub message: String,
}

impl ProcessingError {
    /// A failure that made no effect; processing is tried again.
    pub fn retryable(message: impl Into<String>) -> Self {
        ProcessingError { retryable: true, message: message.into() }
    }

    /// A failure that would repeat; stored and ACKed.
    pub fn permanent(message: impl Into<String>) -> Self {
        ProcessingError { retryable: false, message: message.into() }
    }
}

/// One delivery at the boundary.
#[derive(Debug, Clone, Copy)]
pub struct Delivery<'a> {
    /// The tenant the delivery belongs to (resolved before the gate).
    pub organization_id: Uuid,
    /// The vendor scope, e.g. `webhook.nylas`.
    pub scope: &'a str,
    /// The vendor's delivery id: the idempotency key.
    pub delivery_id: &'a str,
    /// The body exactly as delivered; its SHA-256 is the request hash.
    pub body: &'a [u8],
}

/// A provider's callback: the job the path names, and the one the body names.
#[derive(Debug, Clone, Copy)]
pub struct ProviderCallback<'a> {
    /// The provider; its scope is `webhook.<provider>`.
    pub provider: &'a str,
    /// The job id in the callback path.
    pub path_job_id: &'a str,
    /// The job id the body names, if it names one.
    pub body_job_id: Option<&'a str>,
    /// The provider's delivery id.
    pub delivery_id: &'a str,
    /// The body exactly as delivered.
    pub body: &'a [u8],
}
