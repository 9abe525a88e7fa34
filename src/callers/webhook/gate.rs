//! The gate itself: its timing and deadline, and the answer it gives each
//! delivery (or provider callback) by its deadline, while the task that
//! carries the delivery goes on.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tracing::Instrument;

use super::ack::{body_above_limit, drop_delivery, unavailable, Ack, DropCounters, DropReason, RetryReason};
use super::carry::Carried;
use super::delivery::{Delivery, ProcessingError, ProviderCallback};
use super::jobs::{ProviderJob, ProviderJobs};
use super::stored::{stored_body, DEFAULT_WEBHOOK_BODY_LIMIT};
use crate::error::InvalidInput;
use crate::repo::{IdempotencyRepository, ProviderJobRepository};
use crate::service::{
    EffectDriver, IdempotencyService, LeaseOutlastsRetries, RequestHash, RetryHorizon, Timing, DEFAULT_JOURNAL_DEADLINE,
};

/// How long processing one delivery may take, in-process retries of
/// retryable failures included, unless set otherwise. Never cut by the
/// answer's deadline.
pub const DEFAULT_PROCESSING_TIMEOUT: Duration = Duration::from_secs(15);

/// Added to the processing timeout and the journal's deadline to make the
/// lease: the claim outlives the processing and the journal it guards.
pub const LEASE_MARGIN: Duration = Duration::from_secs(5);

/// How long after a delivery the vendor makes its last redelivery, unless
/// set otherwise: Slack's schedule (at once, after 1 minute, after 5
/// minutes), the shortest of the common ones. The lease must pass before it.
pub const DEFAULT_VENDOR_HORIZON: RetryHorizon = RetryHorizon::until_last_attempt(Duration::from_secs(6 * 60));

/// How long the gate takes to answer a delivery unless set otherwise: 2.5 s,
/// so the answer fits Slack's 3 s ACK window with room for the network.
/// Work still running then goes on after the answer.
pub const DEFAULT_GATE_DEADLINE: Duration = Duration::from_millis(2500);

/// The gate. Cheap to clone; clones share their counters.
#[derive(Debug, Clone)]
pub struct WebhookGate<R, J> {
    driver: EffectDriver<R>,
    jobs: ProviderJobs<J>,
    timing: Timing,
    horizon: RetryHorizon,
    deadline: Option<Duration>,
    body_limit: usize,
    drops: Arc<DropCounters>,
}

/// A gate setting that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GateConfigError {
    /// The processing timeout or the journal deadline is zero: no delivery
    /// could be processed, or its answer journaled, in no time.
    #[error("the webhook gate's {what} must be above zero")]
    ZeroTimeout {
        /// Which one: `processing timeout` or `journal deadline`.
        what: &'static str,
    },
    /// The lease the processing timeout, the journal deadline and the
    /// margin make is one the store refuses.
    #[error(transparent)]
    Timing(#[from] InvalidInput),
    /// The lease would still hold at the vendor's last redelivery.
    #[error(transparent)]
    LeaseOutlastsRetries(#[from] LeaseOutlastsRetries),
}

/// Runs `future` until `deadline`, if there is one; `None` when cut.
async fn within<T>(deadline: Option<Instant>, future: impl Future<Output = T>) -> Option<T> {
    match deadline {
        Some(deadline) => tokio::time::timeout_at(deadline, future).await.ok(),
        None => Some(future.await),
    }
}

impl<R: IdempotencyRepository + 'static, J: ProviderJobRepository> WebhookGate<R, J> {
    /// A gate over `service`, resolving provider callbacks through `jobs`,
    /// with [`DEFAULT_PROCESSING_TIMEOUT`], [`DEFAULT_JOURNAL_DEADLINE`],
    /// [`LEASE_MARGIN`] (a 30 s lease), [`DEFAULT_GATE_DEADLINE`],
    /// [`DEFAULT_VENDOR_HORIZON`] and [`DEFAULT_WEBHOOK_BODY_LIMIT`].
    pub fn new(service: IdempotencyService<R>, jobs: ProviderJobs<J>) -> Self {
        WebhookGate {
            driver: EffectDriver::new(service),
            jobs,
            timing: default_timing(),
            horizon: DEFAULT_VENDOR_HORIZON,
            deadline: Some(DEFAULT_GATE_DEADLINE),
            body_limit: DEFAULT_WEBHOOK_BODY_LIMIT,
            drops: Arc::new(DropCounters::default()),
        }
    }

    /// Sets how long the gate takes to answer a delivery: set it below the
    /// vendor's ACK window. Default [`DEFAULT_GATE_DEADLINE`]. Work still
    /// running then goes on after the answer (see the module docs); the
    /// lease is not shortened.
    pub fn with_deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// No deadline for the answer: it waits for the processing and its
    /// journal, each bounded by its own timeout.
    pub fn without_deadline(mut self) -> Self {
        self.deadline = None;
        self
    }

    /// The deadline of the answer, if any.
    pub fn deadline(&self) -> Option<Duration> {
        self.deadline
    }

    /// Sets the largest body the gate takes, in bytes (default
    /// [`DEFAULT_WEBHOOK_BODY_LIMIT`], 256 KiB): a larger one is answered
    /// 413 ([`RetryReason::DeliveryTooLarge`]) before anything else, never
    /// looked up or claimed, and the axum route
    /// ([`callers::http`](crate::callers::http)) refuses it before reading
    /// past the limit or verifying its signature. Keep the scope's
    /// `max_request_bytes` at least
    /// [`stored_body_bound`](super::stored_body_bound)`(bytes)`, so that
    /// every body the gate takes can be stored with its claim (`idem doctor`
    /// checks it, told the limit by `IDEM_WEBHOOK_BODY_LIMIT_BYTES`).
    pub fn with_body_limit(mut self, bytes: usize) -> Self {
        self.body_limit = bytes;
        self
    }

    /// The largest body the gate takes, in bytes.
    pub fn body_limit(&self) -> usize {
        self.body_limit
    }

    /// Sets how long processing one delivery may take, in-process retries
    /// included; the lease is that plus the journal deadline plus
    /// [`LEASE_MARGIN`]. Refused when zero, or when the lease is outside what
    /// the store accepts or outlasts the vendor's retries.
    pub fn with_processing_timeout(self, timeout: Duration) -> Result<Self, GateConfigError> {
        refuse_zero(timeout, "processing timeout")?;
        let (timing, horizon) = (Timing::new(timeout, self.timing.journal(), self.timing.margin())?, self.horizon);
        self.with_timing(timing, horizon)
    }

    /// Sets how long journaling a processed delivery may take, retries
    /// included (default [`DEFAULT_JOURNAL_DEADLINE`]); part of the lease.
    /// Refused when zero, or when the lease is outside what the store
    /// accepts or outlasts the vendor's retries.
    pub fn with_journal_deadline(self, deadline: Duration) -> Result<Self, GateConfigError> {
        refuse_zero(deadline, "journal deadline")?;
        let (timing, horizon) = (Timing::new(self.timing.effect(), deadline, self.timing.margin())?, self.horizon);
        self.with_timing(timing, horizon)
    }

    /// Sets how long after a delivery the vendor makes its last redelivery
    /// (default [`DEFAULT_VENDOR_HORIZON`]); the lease must pass before it.
    pub fn with_vendor_horizon(self, horizon: RetryHorizon) -> Result<Self, GateConfigError> {
        let timing = self.timing;
        self.with_timing(timing, horizon)
    }

    fn with_timing(mut self, timing: Timing, horizon: RetryHorizon) -> Result<Self, GateConfigError> {
        timing.check(horizon, Duration::ZERO)?;
        self.timing = timing;
        self.horizon = horizon;
        Ok(self)
    }

    /// The lease a delivery is claimed for.
    pub fn lease(&self) -> Duration {
        self.timing.lease()
    }

    /// The drop counters.
    pub fn drops(&self) -> &DropCounters {
        &self.drops
    }

    /// Claims each delivery for a short `lease` (at least 3 s) and keeps it
    /// alive with heartbeats while processing and its journal run, instead
    /// of claiming for the whole processing timeout: a worker that dies is
    /// re-driven (or its event redelivered) after `lease`, while a live one
    /// keeps its claim as long as its own deadlines allow.
    pub fn with_heartbeats(self, lease: Duration) -> Result<Self, GateConfigError> {
        let (timing, horizon) = (self.timing.with_heartbeats(lease)?, self.horizon);
        self.with_timing(timing, horizon)
    }

    pub(super) fn driver(&self) -> &EffectDriver<R> {
        &self.driver
    }

    pub(super) fn timing(&self) -> Timing {
        self.timing
    }

    /// Claims the delivery, runs `process` if we own it, and journals its
    /// answer; every duplicate ending is an ACK with its reason. Answers
    /// within the deadline; the work goes on after it when it must (see the
    /// module docs), so `process` is `'static`, and called again after a
    /// retryable failure. A body above the [body limit](Self::with_body_limit)
    /// is answered 413 first, unclaimed.
    pub async fn handle<F, Fut>(&self, delivery: Delivery<'_>, process: F) -> Ack
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Value, ProcessingError>> + Send + 'static,
    {
        if let Some(refused) = self.refuse_above_limit(delivery.scope, delivery.body) {
            return refused;
        }
        self.handle_by(self.answer_deadline(), delivery, process).await
    }

    /// The 413 a body above the body limit gets, before anything else.
    fn refuse_above_limit(&self, scope: &str, body: &[u8]) -> Option<Ack> {
        (body.len() > self.body_limit).then(|| body_above_limit(scope, body.len(), self.body_limit))
    }

    fn answer_deadline(&self) -> Option<Instant> {
        self.deadline.map(|deadline| Instant::now() + deadline)
    }

    /// [`handle`](Self::handle), answering by `answer_by`: the delivery is
    /// carried by a task of its own, and the vendor hears whatever that task
    /// said by then ([`ack`]).
    async fn handle_by<F, Fut>(&self, answer_by: Option<Instant>, delivery: Delivery<'_>, process: F) -> Ack
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Value, ProcessingError>> + Send + 'static,
    {
        let span = tracing::info_span!(
            "webhook.delivery",
            organization_id = %delivery.organization_id, idempotency.scope = delivery.scope,
            idempotency.key_hash = %crate::telemetry::key_hash(delivery.delivery_id), ack = tracing::field::Empty,
            drop_reason = tracing::field::Empty, replayed = tracing::field::Empty
        );
        let (carried, held) = self.carrier(&delivery);
        // The whole road runs as a task of its own: the answer may leave
        // before it ends, and the road must not be cut with it.
        let (answer, answered) = oneshot::channel();
        tokio::spawn(carried.carry(process, answer).instrument(span.clone()));
        let heard = within(answer_by, answered).await;
        let ack = span.in_scope(|| ack(&self.drops, heard, held.load(Ordering::SeqCst)));
        span.record("ack", ack_name(&ack));
        ack
    }

    /// The delivery, owned, for the task that carries it past the answer,
    /// and the flag that task sets once it holds the claim.
    fn carrier(&self, delivery: &Delivery<'_>) -> (Carried<R>, Arc<AtomicBool>) {
        let held = Arc::new(AtomicBool::new(false));
        let carried = Carried {
            driver: self.driver.clone(),
            drops: self.drops.clone(),
            timing: self.timing,
            organization_id: delivery.organization_id,
            scope: delivery.scope.to_owned(),
            key: delivery.delivery_id.to_owned(),
            hash: RequestHash::of_bytes(delivery.body),
            request: stored_body(delivery.body),
            held: held.clone(),
        };
        (carried, held)
    }

    /// Resolves the callback's tenant from `agent.provider_jobs`, checks the
    /// body names the same job, then handles it under `webhook.<provider>`.
    /// `process` receives the job it belongs to. A body above the
    /// [body limit](Self::with_body_limit) is answered 413 first, before
    /// the lookup.
    pub async fn handle_provider_callback<F, Fut>(&self, callback: ProviderCallback<'_>, process: F) -> Ack
    where
        F: Fn(ProviderJob) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Value, ProcessingError>> + Send + 'static,
    {
        let span = tracing::info_span!(
            "webhook.provider_callback",
            provider = callback.provider,
            job_id = callback.path_job_id,
            idempotency.key_hash = %crate::telemetry::key_hash(callback.delivery_id),
            drop_reason = tracing::field::Empty
        );
        let scope = format!("webhook.{}", callback.provider);
        if let Some(refused) = span.in_scope(|| self.refuse_above_limit(&scope, callback.body)) {
            return refused;
        }
        let answer_by = self.answer_deadline();
        let job = match self.resolve_job(&callback, answer_by).instrument(span.clone()).await {
            Ok(job) => job,
            Err(ack) => return ack,
        };
        let delivery = Delivery {
            organization_id: job.organization_id,
            scope: &scope,
            delivery_id: callback.delivery_id,
            body: callback.body,
        };
        self.handle_by(answer_by, delivery, move || process(job.clone())).instrument(span).await
    }

    /// The job the callback's path names, looked up by `answer_by`, when
    /// the body names the same one (or none). `Err` is the answer instead:
    /// a drop for an unknown or mismatched job, a retry when the lookup
    /// failed or did not answer in time.
    async fn resolve_job(
        &self,
        callback: &ProviderCallback<'_>,
        answer_by: Option<Instant>,
    ) -> Result<ProviderJob, Ack> {
        let job = match within(answer_by, self.jobs.lookup(callback.provider, callback.path_job_id)).await {
            Some(Ok(Some(job))) => job,
            Some(Ok(None)) => return Err(drop_delivery(&self.drops, DropReason::UnknownJob)),
            Some(Err(error)) => return Err(unavailable(&error)),
            None => {
                tracing::error!("the job lookup did not answer within the gate's deadline; not acknowledged");
                return Err(Ack::Retry(RetryReason::PlaneUnavailable));
            }
        };
        if callback.body_job_id.is_some_and(|named| named != callback.path_job_id) {
            return Err(drop_delivery(&self.drops, DropReason::JobMismatch));
        }
        Ok(job)
    }
}

/// What the vendor hears by the deadline: the carrier's answer when it
/// came (a duplicate's drop is counted here, where it is answered; a
/// failure journaled with its reason was counted by its carrier); else
/// [`Ack::Accepted`] when the claim is `held` and processing goes on after
/// the answer, or [`Ack::Retry`] when the claim has not answered yet.
fn ack(drops: &DropCounters, heard: Option<Result<Ack, oneshot::error::RecvError>>, held: bool) -> Ack {
    match heard {
        Some(Ok(Ack::Dropped(
            reason @ (DropReason::Duplicate | DropReason::HashMismatch | DropReason::InvalidDelivery),
        ))) => drop_delivery(drops, reason),
        Some(Ok(ack)) => ack,
        Some(Err(_task_failed)) => {
            tracing::error!("the delivery's task ended without an answer; not acknowledged");
            Ack::Retry(RetryReason::PlaneUnavailable)
        }
        None if held => {
            tracing::info!("still processing at the deadline: accepted, it goes on after the answer");
            Ack::Accepted
        }
        None => {
            tracing::warn!("the claim did not answer within the deadline; not acknowledged, still asking");
            Ack::Retry(RetryReason::PlaneUnavailable)
        }
    }
}

/// The answer as the `webhook.delivery` span records it.
fn ack_name(ack: &Ack) -> &'static str {
    match ack {
        Ack::Processed => "processed",
        Ack::Failed { .. } => "failed",
        Ack::Accepted => "accepted",
        Ack::Dropped(_) => "dropped",
        Ack::Retry(_) => "retry",
    }
}

/// Refuses a zero `what` (the processing timeout, the journal deadline).
fn refuse_zero(value: Duration, what: &'static str) -> Result<(), GateConfigError> {
    if value.is_zero() {
        return Err(GateConfigError::ZeroTimeout { what });
    }
    Ok(())
}

/// The gate's default timing: processing 15 s, journal 10 s, margin 5 s, a
/// 30 s lease (checked by a test).
fn default_timing() -> Timing {
    Timing::from_checked_constants(DEFAULT_PROCESSING_TIMEOUT, DEFAULT_JOURNAL_DEADLINE, LEASE_MARGIN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_timing_is_one_the_store_accepts_and_makes_the_specs_30_second_lease() {
        let checked = Timing::new(DEFAULT_PROCESSING_TIMEOUT, DEFAULT_JOURNAL_DEADLINE, LEASE_MARGIN);
        assert_eq!(checked, Ok(default_timing()));
        assert_eq!(default_timing().lease(), Duration::from_secs(30));
        assert!(default_timing().check(DEFAULT_VENDOR_HORIZON, Duration::ZERO).is_ok());
    }

    #[test]
    fn a_zero_processing_timeout_or_journal_deadline_is_refused_as_zero() {
        use crate::repo::MemoryRepository;
        let gate = || {
            WebhookGate::new(
                IdempotencyService::new(MemoryRepository::new()),
                ProviderJobs::new(MemoryRepository::new()),
            )
        };
        assert_eq!(
            gate().with_processing_timeout(Duration::ZERO).err(),
            Some(GateConfigError::ZeroTimeout { what: "processing timeout" })
        );
        assert_eq!(
            gate().with_journal_deadline(Duration::ZERO).err(),
            Some(GateConfigError::ZeroTimeout { what: "journal deadline" })
        );
        let refused = gate().with_processing_timeout(Duration::ZERO).err().map(|e| e.to_string());
        assert_eq!(refused.as_deref(), Some("the webhook gate's processing timeout must be above zero"));
        assert!(matches!(
            gate().with_processing_timeout(Duration::MAX).err(),
            Some(GateConfigError::Timing(InvalidInput::LeaseTooLong { .. }))
        ));
        assert!(gate().with_processing_timeout(Duration::from_secs(1)).is_ok());
    }
}
