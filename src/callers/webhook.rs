//! The webhook gate: the edge adapter at an HTTP boundary.
//!
//! A webhook handler is the outermost frame, and a 5xx tells the vendor that
//! a delivery which succeeded failed (Slack disables a subscription that
//! answers 5xx often enough). So every duplicate ending is an ACK with a
//! counted, logged drop reason; none is silent. Only two things are not
//! ACKed, because nothing was done and the vendor's redelivery is wanted: a
//! processing failure that made no effect, and a plane that could not be
//! reached. Processing that panics or overruns its timeout is released and
//! not ACKed either: at this boundary a redelivery is better than a loss, so
//! processing must tolerate running again after one of those.
//!
//! The whole gate call answers within its deadline (default
//! [`DEFAULT_GATE_DEADLINE`], 2.5 s, inside Slack's 3 s ACK window): the
//! claim and the processing must be done by the deadline less an
//! [ending reserve](WebhookGate::with_deadline), and the completion or
//! release gets what is left. A claim cut by the deadline answers 503 (the
//! plane could not decide); processing cut by it is released and answers
//! 503, like an overrun; a completion cut by it still ACKs, since the
//! processing happened. The deadline cuts the wait, never the call: the
//! claim and the endings run as tasks of their own, so a completion lands
//! after the answer, and a claim made after the gate stopped waiting is
//! released once it answers (else the vendor's redelivery would meet it and
//! be dropped as a duplicate of a delivery nobody processes). Changing
//! from a gate without a deadline: processing longer than about 2 s now
//! answers 503 unless the gate is given `with_deadline` or
//! `without_deadline`.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use serde_json::{json, Value};
use tokio::time::Instant;
use tracing::Instrument;
use uuid::Uuid;

use crate::error::{Error, InvalidInput};
use crate::postgrest::PostgrestClient;
use crate::repo::{IdempotencyRepository, PostgrestRepository, ProviderJobRepository};

pub use crate::repo::ProviderJob;
use crate::service::{Claim, ClaimOutcome, Ending, IdempotencyService, RequestHash};

/// How long processing one delivery may take unless set otherwise; the
/// gate's deadline ([`DEFAULT_GATE_DEADLINE`]) cuts it sooner unless that is
/// raised or removed. It sets the lease either way.
pub const DEFAULT_PROCESSING_TIMEOUT: Duration = Duration::from_secs(20);

/// Added to the processing timeout to make the lease: the claim outlives the
/// processing it guards.
pub const LEASE_MARGIN: Duration = Duration::from_secs(10);

/// How long one gate call (lookup, claim, processing, completion) may take
/// unless set otherwise: 2.5 s, so the answer fits Slack's 3 s ACK window
/// with room for the network. A vendor with a longer window (most give 10
/// to 30 s) can be given more with [`WebhookGate::with_deadline`].
pub const DEFAULT_GATE_DEADLINE: Duration = Duration::from_millis(2500);

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
}

impl DropReason {
    /// The reason as logged and counted: `duplicate`, `hash_mismatch`,
    /// `unknown_job`, `job_mismatch`, `invalid_delivery`.
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::Duplicate => "duplicate",
            DropReason::HashMismatch => "hash_mismatch",
            DropReason::UnknownJob => "unknown_job",
            DropReason::JobMismatch => "job_mismatch",
            DropReason::InvalidDelivery => "invalid_delivery",
        }
    }
}

/// Why a delivery is answered with a non-2xx so the vendor redelivers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryReason {
    /// Processing failed without an effect; the claim was released.
    ProcessingFailed,
    /// Processing panicked or overran its timeout; the claim was released.
    ProcessingAborted,
    /// The plane could not be reached or refused the call; nothing was claimed.
    PlaneUnavailable,
}

/// The gate's answer to one delivery.
#[derive(Debug, Clone, PartialEq)]
pub enum Ack {
    /// Processed now (successfully, or with a failure that would repeat).
    Processed,
    /// Acknowledged without processing, for this reason.
    Dropped(DropReason),
    /// Not acknowledged: answer 503 so the vendor delivers it again.
    Retry(RetryReason),
}

impl Ack {
    /// The HTTP status to answer: 200 for every ACK, 503 for a retry.
    pub fn status(&self) -> u16 {
        match self {
            Ack::Processed | Ack::Dropped(_) => 200,
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
        }
    }
}

/// A processing failure, as the caller's handler reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessingError {
    /// True when the failure made no effect and a redelivery may succeed:
    /// the claim is released and the delivery not ACKed. False for a failure
    /// that would repeat: it is stored as the delivery's answer and ACKed.
    pub retryable: bool,
    /// What went wrong, for the log and the stored answer.
    pub message: String,
}

impl ProcessingError {
    /// A failure that made no effect; the vendor's redelivery will be processed.
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

/// The `agent.provider_jobs` directory.
#[derive(Debug, Clone)]
pub struct ProviderJobs<J = PostgrestRepository> {
    repo: J,
}

impl ProviderJobs<PostgrestRepository> {
    /// The directory through PostgREST, over `client`.
    pub fn new(client: PostgrestClient) -> Self {
        ProviderJobs { repo: PostgrestRepository::new(client) }
    }
}

impl<J: ProviderJobRepository> ProviderJobs<J> {
    /// The directory over any [`ProviderJobRepository`].
    pub fn over(repo: J) -> Self {
        ProviderJobs { repo }
    }

    /// Records a job this platform started at `provider`. A repeat answers
    /// the stored job; the same job id under another organization is refused.
    pub async fn register(&self, organization_id: Uuid, provider: &str, job_id: &str) -> Result<ProviderJob, Error> {
        self.repo.register(organization_id, provider, job_id).await
    }

    /// The job `provider` knows as `job_id`, if we hold it.
    pub async fn lookup(&self, provider: &str, job_id: &str) -> Result<Option<ProviderJob>, Error> {
        self.repo.lookup(provider, job_id).await
    }
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

/// The gate. Cheap to clone; clones share their counters.
#[derive(Debug, Clone)]
pub struct WebhookGate<R, J = PostgrestRepository> {
    service: Arc<IdempotencyService<R>>,
    jobs: ProviderJobs<J>,
    timeout: Duration,
    deadline: Option<Duration>,
    drops: Arc<DropCounters>,
}

/// When each phase of one gate call must be done by.
#[derive(Debug, Clone, Copy)]
struct Budget {
    /// The lookup, the claim and the processing.
    work: Option<Instant>,
    /// The call as a whole: the completion or release gets until then.
    call: Option<Instant>,
}

impl Budget {
    fn starting_now(deadline: Option<Duration>) -> Budget {
        let now = Instant::now();
        Budget {
            work: deadline.map(|deadline| now + deadline - ending_reserve(deadline)),
            call: deadline.map(|deadline| now + deadline),
        }
    }
}

/// The part of the gate deadline kept for the call that ends a claim: a
/// fifth (500 ms of the default 2.5 s).
fn ending_reserve(deadline: Duration) -> Duration {
    deadline / 5
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
    /// with [`DEFAULT_PROCESSING_TIMEOUT`] and [`DEFAULT_GATE_DEADLINE`].
    pub fn new(service: IdempotencyService<R>, jobs: ProviderJobs<J>) -> Self {
        WebhookGate {
            service: Arc::new(service),
            jobs,
            timeout: DEFAULT_PROCESSING_TIMEOUT,
            deadline: Some(DEFAULT_GATE_DEADLINE),
            drops: Arc::new(DropCounters::default()),
        }
    }

    /// Sets how long one gate call may take, from entry to answer: set it
    /// below the vendor's ACK window. Default [`DEFAULT_GATE_DEADLINE`].
    ///
    /// The lookup, claim and processing must be done a fifth of it before
    /// the end (the ending reserve, 500 ms of the default); the completion
    /// or release gets the rest. Processing is cut at whichever comes first
    /// of this and the processing timeout. The lease is not shortened: it
    /// stays the processing timeout plus [`LEASE_MARGIN`].
    pub fn with_deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// No deadline for the whole call: processing is bounded by its
    /// timeout, and each plane call by the client's own deadline
    /// ([`ClientConfig::with_deadline`](crate::ClientConfig::with_deadline)).
    pub fn without_deadline(mut self) -> Self {
        self.deadline = None;
        self
    }

    /// The deadline of one gate call, if any.
    pub fn deadline(&self) -> Option<Duration> {
        self.deadline
    }

    /// Sets how long processing one delivery may take; the lease is that
    /// plus [`LEASE_MARGIN`].
    /// Refused unless the timeout is above zero and its lease stays within
    /// the store's [`MAX_LEASE`](crate::service::MAX_LEASE).
    pub fn with_processing_timeout(mut self, timeout: Duration) -> Result<Self, InvalidInput> {
        let lease = timeout.saturating_add(LEASE_MARGIN);
        if timeout.is_zero() || lease > crate::service::MAX_LEASE {
            return Err(InvalidInput::LeaseTooLong { lease, max: crate::service::MAX_LEASE });
        }
        self.timeout = timeout;
        Ok(self)
    }

    /// The lease a delivery is claimed for.
    pub fn lease(&self) -> Duration {
        self.timeout + LEASE_MARGIN
    }

    /// The drop counters.
    pub fn drops(&self) -> &DropCounters {
        &self.drops
    }

    /// Claims the delivery, runs `process` if we own it, then completes
    /// (success, or a failure that would repeat) or releases (a failure that
    /// made no effect). Every duplicate ending is an ACK with its reason.
    pub async fn handle<F, Fut>(&self, delivery: Delivery<'_>, process: F) -> Ack
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Value, ProcessingError>>,
    {
        self.handle_within(Budget::starting_now(self.deadline), delivery, process).await
    }

    async fn handle_within<F, Fut>(&self, budget: Budget, delivery: Delivery<'_>, process: F) -> Ack
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Value, ProcessingError>>,
    {
        let span = tracing::info_span!(
            "webhook.delivery",
            organization_id = %delivery.organization_id, scope = delivery.scope,
            delivery_id = delivery.delivery_id, ack = tracing::field::Empty,
            drop_reason = tracing::field::Empty, replayed = tracing::field::Empty
        );
        let ack = self.handle_inner(budget, delivery, process).instrument(span.clone()).await;
        span.record(
            "ack",
            match &ack {
                Ack::Processed => "processed",
                Ack::Dropped(_) => "dropped",
                Ack::Retry(_) => "retry",
            },
        );
        ack
    }

    async fn handle_inner<F, Fut>(&self, budget: Budget, delivery: Delivery<'_>, process: F) -> Ack
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Value, ProcessingError>>,
    {
        let hash = RequestHash::of_bytes(delivery.body);
        // The lease starts when the claim's transaction does: count the
        // processing timeout from before the claim, retries included.
        let timeout_at = Instant::now() + self.timeout;
        let processing_deadline = budget.work.map_or(timeout_at, |work| work.min(timeout_at));
        // The claim runs as a task of its own, so that a deadline that cuts
        // the wait for it does not cut the call: a claim the database made
        // after we stopped waiting is released once it answers, and the
        // vendor's redelivery is processed, never dropped as a duplicate of
        // a delivery nobody processes.
        let mut claiming = {
            let service = self.service.clone();
            let (organization_id, scope, key) =
                (delivery.organization_id, delivery.scope.to_owned(), delivery.delivery_id.to_owned());
            let (hash, lease) = (hash.clone(), self.lease());
            tokio::spawn(
                async move { service.claim(organization_id, &scope, &key, &hash, lease).await }.in_current_span(),
            )
        };
        let claimed = match within(budget.work, &mut claiming).await {
            Some(Ok(claimed)) => claimed,
            Some(Err(failed)) => {
                tracing::error!(%failed, "the claim's task failed; not acknowledged");
                return Ack::Retry(RetryReason::PlaneUnavailable);
            }
            None => {
                tracing::error!("the claim did not answer within the gate's deadline; not acknowledged");
                let service = self.service.clone();
                tokio::spawn(
                    async move {
                        if let Ok(Ok(ClaimOutcome::Claimed(claim))) = claiming.await {
                            tracing::warn!("the claim the deadline cut was made; releasing it for the redelivery");
                            service.release_or_log(&claim).await;
                        }
                    }
                    .in_current_span(),
                );
                return Ack::Retry(RetryReason::PlaneUnavailable);
            }
        };
        let claim = match claimed {
            Ok(ClaimOutcome::Claimed(claim)) => claim,
            Ok(ClaimOutcome::Completed { .. }) => {
                tracing::Span::current().record("replayed", true);
                return self.drop_delivery(DropReason::Duplicate);
            }
            Ok(ClaimOutcome::Processing { .. }) => return self.drop_delivery(DropReason::Duplicate),
            Ok(ClaimOutcome::Conflict) => return self.drop_delivery(DropReason::HashMismatch),
            // Only the delivery's own id can make it unclaimable for good;
            // any other refusal is the gate's configuration, and answering
            // 503 keeps the delivery until that is fixed.
            Err(Error::Invalid(
                refused @ (InvalidInput::EmptyKey | InvalidInput::KeyTooLong { .. } | InvalidInput::KeyHasNul),
            )) => {
                tracing::warn!(%refused, "the delivery id cannot be claimed");
                return self.drop_delivery(DropReason::InvalidDelivery);
            }
            Err(error) => return self.unavailable(&error),
        };
        let processed = tokio::time::timeout_at(processing_deadline, AssertUnwindSafe(process()).catch_unwind()).await;
        // Endings run as tasks of their own too: one the deadline cuts still
        // lands after the gate has answered.
        let release = |claim: &Claim| {
            let (service, claim) = (self.service.clone(), claim.clone());
            let releasing = tokio::spawn(async move { service.release_or_log(&claim).await }.in_current_span());
            async move {
                if within(budget.call, releasing).await.is_none() {
                    tracing::warn!("the release did not answer within the gate's deadline; it lands after the answer");
                }
            }
        };
        let processed = match processed {
            Ok(Ok(processed)) => processed,
            Ok(Err(_panic)) => {
                tracing::error!("processing panicked; released so the vendor's redelivery is processed");
                release(&claim).await;
                return Ack::Retry(RetryReason::ProcessingAborted);
            }
            Err(_elapsed) => {
                tracing::error!(
                    timeout_ms = self.timeout.as_millis() as u64,
                    gate_deadline_ms = self.deadline.map(|d| d.as_millis() as u64),
                    "processing overran its timeout or the gate's deadline; released for redelivery"
                );
                release(&claim).await;
                return Ack::Retry(RetryReason::ProcessingAborted);
            }
        };
        let (payload, ok) = match processed {
            Ok(output) => (output, true),
            Err(failure) if failure.retryable => {
                tracing::warn!(error = %failure.message, "processing failed without an effect; released for redelivery");
                release(&claim).await;
                return Ack::Retry(RetryReason::ProcessingFailed);
            }
            Err(failure) => {
                tracing::warn!(error = %failure.message, "processing failed; the failure is the delivery's answer");
                (Value::String(failure.message), false)
            }
        };
        // The processing happened: journal its answer whatever it holds (a
        // stand-in when the store cannot hold it), so a redelivery is a
        // duplicate.
        let envelope = move |payload| {
            if ok {
                json!({"ok": true, "output": payload})
            } else {
                json!({"ok": false, "error": payload})
            }
        };
        let completing = {
            let service = self.service.clone();
            tokio::spawn(
                async move { service.complete_after_effect(&claim, payload, None, envelope).await }.in_current_span(),
            )
        };
        let completed = match within(budget.call, completing).await {
            Some(Ok(completed)) => completed,
            Some(Err(failed)) => Err(Error::Inconsistent(format!("the completion's task failed: {failed}"))),
            None => {
                // The processing happened; the vendor must not redeliver it,
                // and the completion lands after the answer.
                tracing::warn!("processed; the completion did not answer within the gate's deadline and lands after");
                return Ack::Processed;
            }
        };
        match completed {
            Ok(Ending::Recorded) => {}
            Ok(Ending::LeaseMovedOn) => {
                tracing::warn!("processed, but the lease had moved on: another worker holds this delivery now")
            }
            // The processing happened; the vendor must not redeliver it. The
            // claim is reclaimable once its lease passes.
            Err(error) => {
                tracing::error!(%error, "processed, but the completion could not be recorded (the plane is unavailable)")
            }
        }
        Ack::Processed
    }

    /// Resolves the callback's tenant from `agent.provider_jobs`, checks the
    /// body names the same job, then handles it under `webhook.<provider>`.
    /// `process` receives the job it belongs to.
    pub async fn handle_provider_callback<F, Fut>(&self, callback: ProviderCallback<'_>, process: F) -> Ack
    where
        F: FnOnce(ProviderJob) -> Fut,
        Fut: Future<Output = Result<Value, ProcessingError>>,
    {
        let span = tracing::info_span!(
            "webhook.provider_callback",
            provider = callback.provider,
            job_id = callback.path_job_id,
            delivery_id = callback.delivery_id,
            drop_reason = tracing::field::Empty
        );
        let budget = Budget::starting_now(self.deadline);
        let lookup = self.jobs.lookup(callback.provider, callback.path_job_id).instrument(span.clone());
        let job = match within(budget.work, lookup).await {
            Some(Ok(Some(job))) => job,
            Some(Ok(None)) => return span.in_scope(|| self.drop_delivery(DropReason::UnknownJob)),
            Some(Err(error)) => return span.in_scope(|| self.unavailable(&error)),
            None => {
                return span.in_scope(|| {
                    tracing::error!("the job lookup did not answer within the gate's deadline; not acknowledged");
                    Ack::Retry(RetryReason::PlaneUnavailable)
                })
            }
        };
        if callback.body_job_id.is_some_and(|named| named != callback.path_job_id) {
            return span.in_scope(|| self.drop_delivery(DropReason::JobMismatch));
        }
        let scope = format!("webhook.{}", callback.provider);
        let delivery = Delivery {
            organization_id: job.organization_id,
            scope: &scope,
            delivery_id: callback.delivery_id,
            body: callback.body,
        };
        self.handle_within(budget, delivery, || process(job)).instrument(span).await
    }

    /// Counts the drop (here, and in `idempotency_webhook_drops_total{reason}`),
    /// logs it with its reason, and ACKs.
    fn drop_delivery(&self, reason: DropReason) -> Ack {
        self.drops.add(reason);
        metrics::counter!(crate::telemetry::WEBHOOK_DROPS_TOTAL, "reason" => reason.as_str()).increment(1);
        tracing::Span::current().record("drop_reason", reason.as_str());
        tracing::info!(drop_reason = reason.as_str(), "delivery dropped and acknowledged");
        Ack::Dropped(reason)
    }

    fn unavailable(&self, error: &Error) -> Ack {
        tracing::error!(%error, "the plane could not decide; not acknowledged so the vendor redelivers");
        Ack::Retry(RetryReason::PlaneUnavailable)
    }
}
