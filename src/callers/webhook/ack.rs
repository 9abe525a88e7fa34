//! What the gate answers a delivery: an [`Ack`] (200) with its drop reason
//! when it was not processed, or a retry (503); and the drop counters.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::Error;

/// Why a delivery was acknowledged without being processed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// Handled already, or being handled right now by another worker.
    Duplicate,
    /// The delivery id was seen with a different body.
    HashMismatch,
    /// The callback path names a job this platform does not hold.
    UnknownJob,
    /// The body names a different job than the path.
    JobMismatch,
    /// The delivery cannot be claimed at all (an empty, over-long or NUL
    /// delivery id): redelivering it would never help.
    InvalidDelivery,
    /// Processing panicked or overran its timeout; what it did is unknown,
    /// and that is journaled as the event's answer.
    ProcessingAborted,
    /// The event's work had been handed out as often as its scope's
    /// `max_attempts` allows; a re-drive journaled it as a failure.
    DeadLettered,
}

impl DropReason {
    /// The reason as logged and counted: `duplicate`, `hash_mismatch`,
    /// `unknown_job`, `job_mismatch`, `invalid_delivery`,
    /// `processing_aborted`, `dead_lettered`.
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::Duplicate => "duplicate",
            DropReason::HashMismatch => "hash_mismatch",
            DropReason::UnknownJob => "unknown_job",
            DropReason::JobMismatch => "job_mismatch",
            DropReason::InvalidDelivery => "invalid_delivery",
            DropReason::ProcessingAborted => "processing_aborted",
            DropReason::DeadLettered => "dead_lettered",
        }
    }
}

/// Why a delivery is answered with a non-2xx so the vendor redelivers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RetryReason {
    /// The gate holds no claim: the plane could not be reached, refused the
    /// call, or did not answer within the deadline (then the gate keeps
    /// asking in the background, and processes the event if the claim was
    /// made).
    PlaneUnavailable,
    /// The delivery's body is above the gate's body limit (refused before
    /// anything else, unclaimed), or larger (or nested deeper) than its
    /// scope's `max_request_bytes` lets a claim carry. It is never
    /// acknowledged without its body stored (no worker could finish it after
    /// this one died): answered 413, so the vendor records the failure and
    /// keeps the event for a resend once the limits are raised.
    DeliveryTooLarge,
}

/// The most characters of a failure an [`Ack::Failed`] carries (its whole
/// text is journaled).
pub const FAILED_ACK_ERROR_CHARS: usize = 200;

/// The gate's answer to one delivery.
#[derive(Debug, Clone, PartialEq)]
pub enum Ack {
    /// Processed, and its success journaled.
    Processed,
    /// Processed, and it failed for good (a [`ProcessingError`] that is not
    /// retryable): the failure is journaled as the event's answer, and the
    /// vendor is told it failed in a 2xx, so it does not deliver it again
    /// (every redelivery would replay the failure). An operator can send it
    /// back once the cause is fixed (`idem redrive --failed`).
    ///
    /// [`ProcessingError`]: super::ProcessingError
    Failed {
        /// The failure as journaled, cut to [`FAILED_ACK_ERROR_CHARS`]
        /// characters.
        error: String,
    },
    /// Claimed and held by the plane with its body, not yet journaled:
    /// processing was still running when the deadline came (it goes on
    /// after the answer and is journaled, processed or failed with a drop
    /// reason), or it kept failing with retryable failures and is left for
    /// a re-drive.
    Accepted,
    /// Acknowledged without processing, for this reason.
    Dropped(DropReason),
    /// Not acknowledged: answer 503 so the vendor delivers it again.
    Retry(RetryReason),
}

impl Ack {
    /// The HTTP status to answer: 200 for every ACK, 503 for a retry, 413
    /// for a delivery too large to store with its claim.
    pub fn status(&self) -> u16 {
        match self {
            Ack::Processed | Ack::Failed { .. } | Ack::Accepted | Ack::Dropped(_) => 200,
            Ack::Retry(RetryReason::DeliveryTooLarge) => 413,
            Ack::Retry(_) => 503,
        }
    }
}

/// Counts of every drop reason, for an operator's "why did this not run?".
#[derive(Debug, Default)]
pub struct DropCounters {
    duplicate: AtomicU64,
    hash_mismatch: AtomicU64,
    unknown_job: AtomicU64,
    job_mismatch: AtomicU64,
    invalid_delivery: AtomicU64,
    processing_aborted: AtomicU64,
    dead_lettered: AtomicU64,
}

impl DropCounters {
    /// How many deliveries were dropped for `reason` since start.
    pub fn get(&self, reason: DropReason) -> u64 {
        self.counter(reason).load(Ordering::Relaxed)
    }

    fn add(&self, reason: DropReason) {
        self.counter(reason).fetch_add(1, Ordering::Relaxed);
    }

    fn counter(&self, reason: DropReason) -> &AtomicU64 {
        match reason {
            DropReason::Duplicate => &self.duplicate,
            DropReason::HashMismatch => &self.hash_mismatch,
            DropReason::UnknownJob => &self.unknown_job,
            DropReason::JobMismatch => &self.job_mismatch,
            DropReason::InvalidDelivery => &self.invalid_delivery,
            DropReason::ProcessingAborted => &self.processing_aborted,
            DropReason::DeadLettered => &self.dead_lettered,
        }
    }
}

/// Counts the drop (in `counters`, and in
/// `idempotency_webhook_drops_total{reason}`), logs it with its reason, and
/// ACKs.
pub(super) fn drop_delivery(counters: &DropCounters, reason: DropReason) -> Ack {
    counters.add(reason);
    metrics::counter!(crate::telemetry::WEBHOOK_DROPS_TOTAL, "reason" => reason.as_str()).increment(1);
    tracing::Span::current().record("drop_reason", reason.as_str());
    tracing::info!(drop_reason = reason.as_str(), "delivery dropped and acknowledged");
    Ack::Dropped(reason)
}

/// The delivery is too large (or too deep) for its scope to store with its
/// claim: not acknowledged (413), so the vendor keeps the event.
pub(super) fn too_large(error: &Error) -> Ack {
    tracing::error!(%error, "the delivery is above its scope's max_request_bytes; not acknowledged (413) so the vendor keeps it");
    Ack::Retry(RetryReason::DeliveryTooLarge)
}

/// The body is above the gate's body limit: refused before anything else
/// (no lookup, no claim), not acknowledged (413), so the vendor keeps it.
pub(super) fn body_above_limit(scope: &str, body_bytes: usize, limit: usize) -> Ack {
    tracing::warn!(
        scope,
        body_bytes,
        limit_bytes = limit,
        "the delivery's body is above the gate's body limit; not acknowledged (413) so the vendor keeps it"
    );
    Ack::Retry(RetryReason::DeliveryTooLarge)
}

/// The plane could not decide: not acknowledged, so the vendor redelivers.
pub(super) fn unavailable(error: &Error) -> Ack {
    tracing::error!(%error, "the plane could not decide; not acknowledged so the vendor redelivers");
    Ack::Retry(RetryReason::PlaneUnavailable)
}
