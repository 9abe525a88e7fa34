//! The webhook gate: the edge adapter at an HTTP boundary.
//!
//! A webhook handler is the outermost frame, and a 5xx tells the vendor that
//! a delivery which succeeded failed (Slack disables a subscription that
//! answers 5xx often enough). So every duplicate ending is an ACK with a
//! counted, logged drop reason; none is silent.
//!
//! **The invariant.** Once any delivery of an event has been answered 2xx
//! (processed, or dropped as a duplicate of a claim that is in flight or
//! done), the event is processed to completion exactly once, or its failure
//! is journaled and counted as a drop reason ([`DropReason::ProcessingFailed`],
//! [`DropReason::ProcessingAborted`]); it is never silently lost. A
//! redelivery that meets a live claim is ACKed as a duplicate, as the spec
//! says, so the gate never gives up a claim it holds: it never releases one.
//! It carries the event to a journaled ending itself:
//!
//! - processing runs to its own timeout (default
//!   [`DEFAULT_PROCESSING_TIMEOUT`]), never cut by the answer's deadline; a
//!   retryable failure is retried in process, with backoff, within that
//!   timeout; what still fails at the end is journaled as a failure;
//! - the answer leaves within the gate's deadline (default
//!   [`DEFAULT_GATE_DEADLINE`], 2.5 s, inside Slack's 3 s window): processing
//!   still running then is answered [`Ack::Accepted`] (200) and finished in
//!   the background, so slow-but-successful processing runs once and is not
//!   restarted on every redelivery;
//! - a claim that does not answer within the deadline is answered 503 (the
//!   plane could not decide), and the gate keeps asking with the same lease
//!   token in the background (after any failure that may have followed the
//!   claim's commit, while an answer could still be journaled): if the
//!   database did make the claim, the gate processes the event (or journals
//!   it as aborted when confirmed too late to process), so the vendor's
//!   redelivery, which meets that claim and is ACKed as a duplicate, is not
//!   a loss. A plane silent for that whole time leaves it to its lease.
//!
//! The only non-2xx answer is [`Ack::Retry`]: the gate holds no claim (the
//! plane could not be reached, or did not answer in time). Background work
//! lives as long as the process: a worker that dies holding a claim leaves
//! it `processing` past its lease, visible to an operator (`idem get`), and
//! the redeliveries meeting it meanwhile were ACKed as duplicates. A vendor
//! that does not redeliver after an ACK cannot be made to; that is the price
//! of answering a live claim with an ACK.
//!
//! The lease is the processing timeout plus the journal's deadline plus
//! [`LEASE_MARGIN`]: 15 + 10 + 5 = the spec's 30 s for `webhook.nylas`.
//!
//! Against the vendors' retry rules: Slack waits 3 s for an answer and
//! retries an event three times (at once, after 1 minute, after 5 minutes)
//! when the answer is late or not 2xx; Nylas expects a 200 within 10 s and
//! retries failed deliveries with backoff. Both are served by an answer
//! within 2.5 s, 200 for everything the gate holds a claim on.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tracing::Instrument;
use uuid::Uuid;

use crate::error::{Error, InvalidInput};
use crate::repo::{IdempotencyRepository, ProviderJobRepository};

pub use crate::repo::ProviderJob;
use crate::service::{
    may_have_written, Answer, Attempt, Begun, Cut, Effect, EffectDriver, Held, IdempotencyService,
    LeaseOutlastsRetries, RequestHash, RetryHorizon, Settle, Timing, DEFAULT_JOURNAL_DEADLINE,
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

/// The first wait before processing is tried again after a retryable
/// failure; doubled each time up to [`MAX_PROCESSING_BACKOFF`].
const FIRST_PROCESSING_BACKOFF: Duration = Duration::from_millis(100);

/// The longest wait between two tries of processing.
const MAX_PROCESSING_BACKOFF: Duration = Duration::from_secs(2);

/// How long the gate takes to answer a delivery unless set otherwise: 2.5 s,
/// so the answer fits Slack's 3 s ACK window with room for the network.
/// Work still running then goes on after the answer.
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
    /// Processing kept failing with retryable failures until its timeout;
    /// the last failure is journaled as the event's answer.
    ProcessingFailed,
    /// Processing panicked or overran its timeout; what it did is unknown,
    /// and that is journaled as the event's answer.
    ProcessingAborted,
}

impl DropReason {
    /// The reason as logged and counted: `duplicate`, `hash_mismatch`,
    /// `unknown_job`, `job_mismatch`, `invalid_delivery`,
    /// `processing_failed`, `processing_aborted`.
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::Duplicate => "duplicate",
            DropReason::HashMismatch => "hash_mismatch",
            DropReason::UnknownJob => "unknown_job",
            DropReason::JobMismatch => "job_mismatch",
            DropReason::InvalidDelivery => "invalid_delivery",
            DropReason::ProcessingFailed => "processing_failed",
            DropReason::ProcessingAborted => "processing_aborted",
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
}

/// The gate's answer to one delivery.
#[derive(Debug, Clone, PartialEq)]
pub enum Ack {
    /// Processed and journaled (successfully, or with a failure that would
    /// repeat).
    Processed,
    /// Claimed and processing when the deadline came: it goes on after the
    /// answer and is journaled (processed, or failed with a drop reason).
    Accepted,
    /// Acknowledged without processing, for this reason.
    Dropped(DropReason),
    /// Not acknowledged: answer 503 so the vendor delivers it again.
    Retry(RetryReason),
}

impl Ack {
    /// The HTTP status to answer: 200 for every ACK, 503 for a retry.
    pub fn status(&self) -> u16 {
        match self {
            Ack::Processed | Ack::Accepted | Ack::Dropped(_) => 200,
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
    processing_failed: AtomicU64,
    processing_aborted: AtomicU64,
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
            DropReason::ProcessingFailed => &self.processing_failed,
            DropReason::ProcessingAborted => &self.processing_aborted,
        }
    }
}

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

/// The `agent.provider_jobs` directory.
#[derive(Debug, Clone)]
pub struct ProviderJobs<J> {
    repo: J,
}

impl<J: ProviderJobRepository> ProviderJobs<J> {
    /// The directory kept by `repo`.
    pub fn new(repo: J) -> Self {
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
pub struct WebhookGate<R, J> {
    driver: EffectDriver<R>,
    jobs: ProviderJobs<J>,
    timing: Timing,
    horizon: RetryHorizon,
    deadline: Option<Duration>,
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

/// One delivery, owned, for the task that carries it past the answer.
struct Carried<R> {
    driver: EffectDriver<R>,
    drops: Arc<DropCounters>,
    timing: Timing,
    organization_id: Uuid,
    scope: String,
    key: String,
    hash: RequestHash,
    /// Set once the gate holds the claim: an answer cut by the deadline is
    /// then [`Ack::Accepted`], else [`Ack::Retry`].
    held: Arc<AtomicBool>,
}

impl<R: IdempotencyRepository + 'static, J: ProviderJobRepository> WebhookGate<R, J> {
    /// A gate over `service`, resolving provider callbacks through `jobs`,
    /// with [`DEFAULT_PROCESSING_TIMEOUT`], [`DEFAULT_JOURNAL_DEADLINE`],
    /// [`LEASE_MARGIN`] (a 30 s lease), [`DEFAULT_GATE_DEADLINE`] and
    /// [`DEFAULT_VENDOR_HORIZON`].
    pub fn new(service: IdempotencyService<R>, jobs: ProviderJobs<J>) -> Self {
        WebhookGate {
            driver: EffectDriver::new(service),
            jobs,
            timing: default_timing(),
            horizon: DEFAULT_VENDOR_HORIZON,
            deadline: Some(DEFAULT_GATE_DEADLINE),
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

    /// Claims the delivery, runs `process` if we own it, and journals its
    /// answer; every duplicate ending is an ACK with its reason. Answers
    /// within the deadline; the work goes on after it when it must (see the
    /// module docs), so `process` is `'static`, and called again after a
    /// retryable failure.
    pub async fn handle<F, Fut>(&self, delivery: Delivery<'_>, process: F) -> Ack
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Value, ProcessingError>> + Send + 'static,
    {
        self.handle_by(self.answer_deadline(), delivery, process).await
    }

    fn answer_deadline(&self) -> Option<Instant> {
        self.deadline.map(|deadline| Instant::now() + deadline)
    }

    async fn handle_by<F, Fut>(&self, answer_by: Option<Instant>, delivery: Delivery<'_>, process: F) -> Ack
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Value, ProcessingError>> + Send + 'static,
    {
        let span = tracing::info_span!(
            "webhook.delivery",
            organization_id = %delivery.organization_id, scope = delivery.scope,
            delivery_id = delivery.delivery_id, ack = tracing::field::Empty,
            drop_reason = tracing::field::Empty, replayed = tracing::field::Empty
        );
        let held = Arc::new(AtomicBool::new(false));
        let carried = Carried {
            driver: self.driver.clone(),
            drops: self.drops.clone(),
            timing: self.timing,
            organization_id: delivery.organization_id,
            scope: delivery.scope.to_owned(),
            key: delivery.delivery_id.to_owned(),
            hash: RequestHash::of_bytes(delivery.body),
            held: held.clone(),
        };
        // The whole road runs as a task of its own: the answer may leave
        // before it ends, and the road must not be cut with it.
        let (answer, answered) = oneshot::channel();
        tokio::spawn(carried.carry(process, answer).instrument(span.clone()));
        let ack = match within(answer_by, answered).await {
            // A duplicate's drop is counted here, where it is answered; a
            // failure journaled with its reason was counted by its carrier.
            Some(Ok(Ack::Dropped(
                reason @ (DropReason::Duplicate | DropReason::HashMismatch | DropReason::InvalidDelivery),
            ))) => span.in_scope(|| drop_delivery(&self.drops, reason)),
            Some(Ok(ack)) => ack,
            Some(Err(_task_failed)) => {
                span.in_scope(|| tracing::error!("the delivery's task ended without an answer; not acknowledged"));
                Ack::Retry(RetryReason::PlaneUnavailable)
            }
            None if held.load(Ordering::SeqCst) => {
                span.in_scope(|| {
                    tracing::info!("still processing at the deadline: accepted, it goes on after the answer")
                });
                Ack::Accepted
            }
            None => {
                span.in_scope(|| {
                    tracing::warn!("the claim did not answer within the deadline; not acknowledged, still asking")
                });
                Ack::Retry(RetryReason::PlaneUnavailable)
            }
        };
        span.record(
            "ack",
            match &ack {
                Ack::Processed => "processed",
                Ack::Accepted => "accepted",
                Ack::Dropped(_) => "dropped",
                Ack::Retry(_) => "retry",
            },
        );
        ack
    }

    /// Resolves the callback's tenant from `agent.provider_jobs`, checks the
    /// body names the same job, then handles it under `webhook.<provider>`.
    /// `process` receives the job it belongs to.
    pub async fn handle_provider_callback<F, Fut>(&self, callback: ProviderCallback<'_>, process: F) -> Ack
    where
        F: Fn(ProviderJob) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Value, ProcessingError>> + Send + 'static,
    {
        let span = tracing::info_span!(
            "webhook.provider_callback",
            provider = callback.provider,
            job_id = callback.path_job_id,
            delivery_id = callback.delivery_id,
            drop_reason = tracing::field::Empty
        );
        let answer_by = self.answer_deadline();
        let lookup = self.jobs.lookup(callback.provider, callback.path_job_id).instrument(span.clone());
        let job = match within(answer_by, lookup).await {
            Some(Ok(Some(job))) => job,
            Some(Ok(None)) => return span.in_scope(|| drop_delivery(&self.drops, DropReason::UnknownJob)),
            Some(Err(error)) => return span.in_scope(|| unavailable(&error)),
            None => {
                return span.in_scope(|| {
                    tracing::error!("the job lookup did not answer within the gate's deadline; not acknowledged");
                    Ack::Retry(RetryReason::PlaneUnavailable)
                })
            }
        };
        if callback.body_job_id.is_some_and(|named| named != callback.path_job_id) {
            return span.in_scope(|| drop_delivery(&self.drops, DropReason::JobMismatch));
        }
        let scope = format!("webhook.{}", callback.provider);
        let delivery = Delivery {
            organization_id: job.organization_id,
            scope: &scope,
            delivery_id: callback.delivery_id,
            body: callback.body,
        };
        let for_job = job.clone();
        self.handle_by(answer_by, delivery, move || process(for_job.clone())).instrument(span).await
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

impl<R: IdempotencyRepository + 'static> Carried<R> {
    /// Claims, processes and journals one delivery, sending the answer on
    /// `answer` as soon as it is known (the caller may have stopped waiting).
    async fn carry<F, Fut>(self, process: F, answer: oneshot::Sender<Ack>)
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Value, ProcessingError>> + Send + 'static,
    {
        let mut answer = Some(answer);
        // Sends the answer, once: false when the caller had answered
        // already (its deadline came), so a drop it never heard is not counted.
        let mut say = |ack: Ack| match answer.take() {
            Some(answer) => answer.send(ack).is_ok(),
            None => false,
        };
        let effect = Effect {
            organization_id: self.organization_id,
            scope: &self.scope,
            key: &self.key,
            request_hash: &self.hash,
            timing: self.timing,
        };
        let held = match self.claim(&effect, &mut say).await {
            Some(held) => held,
            None => return,
        };
        self.held.store(true, Ordering::SeqCst);
        let (settle, dropped) = process_to_an_answer(&held, &process).await;
        let settled = held.settle(settle).await;
        if !settled.is_journaled() {
            tracing::error!(
                ending = settled.as_str(),
                "processed, but the answer is not journaled; the vendor is not asked to redeliver"
            );
        }
        // A failure journaled with its reason is counted whether or not the
        // vendor still hears the answer: it is the event's record.
        say(match dropped {
            None => Ack::Processed,
            Some(reason) => drop_delivery(&self.drops, reason),
        });
    }

    /// Claims the delivery as one attempt, asking again with the same lease
    /// token after an answer that did not come (a claim the database may
    /// have made), while there would be time left to process. `None` when
    /// the delivery was answered without a claim of ours.
    async fn claim(&self, effect: &Effect<'_>, say: &mut impl FnMut(Ack) -> bool) -> Option<Held<R>> {
        let attempt = Attempt::new();
        // Ask while an answer could still be journaled before the lease
        // passes: a claim confirmed after the processing timeout is
        // journaled as aborted rather than left for a redelivery that was
        // already ACKed.
        let ask_until = attempt.started() + self.timing.effect() + self.timing.journal() / 2;
        let mut begun = match tokio::time::timeout_at(ask_until, self.driver.begin_as(effect, &attempt)).await {
            Ok(begun) => begun,
            Err(_cut) => Err(crate::service::asking_cut(&attempt)),
        };
        let mut answered = false;
        if let Err(error) = &begun {
            if may_have_written(error) {
                // The vendor hears now; the gate keeps asking.
                say(unavailable(error));
                answered = true;
                begun = self.driver.begin_until(effect, &attempt, ask_until).await;
            }
        }
        match begun {
            Ok(Begun::Held(held)) => Some(held),
            // Answered 503 already: a late answer that holds no claim of ours
            // is no drop of this delivery, and nothing is left to do.
            Ok(late) if answered => {
                tracing::info!(
                    outcome = late_outcome(&late),
                    "the claim asked again holds no claim of ours; nothing to carry"
                );
                None
            }
            Ok(Begun::Replayed(_)) => {
                tracing::Span::current().record("replayed", true);
                say_drop(say, DropReason::Duplicate);
                None
            }
            Ok(Begun::InFlight { .. }) => {
                say_drop(say, DropReason::Duplicate);
                None
            }
            Ok(Begun::Conflict) => {
                say_drop(say, DropReason::HashMismatch);
                None
            }
            // Only the delivery's own id can make it unclaimable for good;
            // any other refusal is the gate's configuration, and answering
            // 503 keeps the delivery until that is fixed.
            Err(Error::Invalid(
                refused @ (InvalidInput::EmptyKey | InvalidInput::KeyTooLong { .. } | InvalidInput::KeyHasNul),
            )) => {
                tracing::warn!(%refused, "the delivery id cannot be claimed");
                say_drop(say, DropReason::InvalidDelivery);
                None
            }
            Err(error) => {
                say(unavailable(&error));
                None
            }
        }
    }
}

/// Answers a drop for `reason`; the gate counts it when the answer is
/// given (a claim that answered after the deadline is no drop the vendor
/// heard).
fn say_drop(say: &mut impl FnMut(Ack) -> bool, reason: DropReason) {
    if !say(Ack::Dropped(reason)) {
        tracing::info!(drop_reason = reason.as_str(), "the claim answered after the deadline; no drop was answered");
    }
}

/// What a claim answered, for the log.
fn late_outcome<R>(begun: &Begun<R>) -> &'static str {
    match begun {
        Begun::Held(_) => "held",
        Begun::Replayed(_) => "completed",
        Begun::InFlight { .. } => "processing",
        Begun::Conflict => "conflict",
    }
}

/// Runs `process` under `held` until it answers, trying again after a
/// retryable failure while its timeout allows: the ending to journal, and
/// the drop reason when that ending is a failure the gate records.
async fn process_to_an_answer<R, F, Fut>(held: &Held<R>, process: &F) -> (Settle, Option<DropReason>)
where
    R: IdempotencyRepository,
    F: Fn() -> Fut,
    Fut: Future<Output = Result<Value, ProcessingError>>,
{
    let mut backoff = FIRST_PROCESSING_BACKOFF;
    loop {
        match held.run(process()).await {
            Ok(Ok(output)) => return (Settle::Journal(Answer::success(output)), None),
            Ok(Err(failure)) if !failure.retryable => {
                tracing::warn!(error = %failure.message, "processing failed; the failure is the delivery's answer");
                return (Settle::Journal(Answer::failure(failure.message, Value::Null)), None);
            }
            Ok(Err(failure)) => {
                if Instant::now() + backoff < held.effect_deadline() {
                    tracing::info!(error = %failure.message, backoff_ms = backoff.as_millis() as u64, "processing failed without an effect; trying again");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_PROCESSING_BACKOFF);
                    continue;
                }
                tracing::error!(error = %failure.message, "processing kept failing until its timeout; journaling the failure");
                let answer = Answer::failure(failure.message, Value::Null);
                return (Settle::Journal(answer), Some(DropReason::ProcessingFailed));
            }
            Err(cut) => {
                tracing::error!(%cut, "processing was cut; what it did is unknown, and that is journaled");
                let error = match cut {
                    Cut::TimedOut => "processing_timed_out",
                    Cut::Panicked => "processing_panicked",
                };
                return (Settle::Journal(Answer::failure(error, Value::Null)), Some(DropReason::ProcessingAborted));
            }
        }
    }
}

/// Counts the drop (in `counters`, and in
/// `idempotency_webhook_drops_total{reason}`), logs it with its reason, and
/// ACKs.
fn drop_delivery(counters: &DropCounters, reason: DropReason) -> Ack {
    counters.add(reason);
    metrics::counter!(crate::telemetry::WEBHOOK_DROPS_TOTAL, "reason" => reason.as_str()).increment(1);
    tracing::Span::current().record("drop_reason", reason.as_str());
    tracing::info!(drop_reason = reason.as_str(), "delivery dropped and acknowledged");
    Ack::Dropped(reason)
}

fn unavailable(error: &Error) -> Ack {
    tracing::error!(%error, "the plane could not decide; not acknowledged so the vendor redelivers");
    Ack::Retry(RetryReason::PlaneUnavailable)
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
