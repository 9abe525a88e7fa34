//! The tool guard: one tool call inside a durable orchestrator's step.
//!
//! The journal is read before the policy checkpoint and claimed after it, so
//! a call a person has not yet allowed takes no key. A live claim raises
//! [`ToolError::ClaimInFlight`], which ends the step so the orchestrator runs
//! it again; it is never turned into a result. A retryable failure releases
//! the claim; success and business failures complete it.

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use tracing::{field, Instrument};
use uuid::Uuid;

use crate::error::Error;
use crate::repo::IdempotencyRepository;
use crate::service::{
    Answer, Attempt, Begun, Cut, Effect, EffectDriver, IdempotencyService, LeftToLease, ReadOutcome, RequestHash,
    ResourceRef, Settle, Settled, Timing, DEFAULT_JOURNAL_DEADLINE,
};

/// The longest a tool call may run: the orchestrator's step budget.
pub const STEP_BUDGET: Duration = Duration::from_secs(120);

/// Added to a tool's timeout to make its lease, so the lease outlives the
/// call it guards but passes well before an orchestrator's last retry.
pub const DEFAULT_LEASE_MARGIN: Duration = Duration::from_secs(15);

/// The margins [`ToolGuard::with_lease_margin`] accepts.
pub const LEASE_MARGIN_RANGE: std::ops::RangeInclusive<Duration> = Duration::from_secs(1)..=Duration::from_secs(300);

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
    scope: String,
    timeout: Duration,
    repeat: RepeatSafety,
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

pub use crate::service::RetryHorizon;

/// The idempotency key of one tool call, built from stable identifiers of
/// the Run and the orchestrator step that makes the call.
///
/// There is deliberately no way to build one from the model's tool-call id:
/// a restarted Agent segment makes the model mint a new one, so that key
/// would miss the earlier claim and repeat the effect.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ToolKey(String);

impl ToolKey {
    /// The key of the call made by step `step_id` of Run `run_id`. The step
    /// id is the orchestrator's (e.g. Inngest's), which a replay recomputes;
    /// never pass the model's tool-call id here.
    ///
    /// Distinct `(run, step)` and `(run, step, index)` never share a key: a
    /// `:` or `%` in the step id is percent-encoded, so the step id ends
    /// where the key says it does. (A step id without either is used as
    /// given.)
    pub fn for_step(run_id: Uuid, step_id: &str) -> Self {
        ToolKey(format!("run:{run_id}:step:{}", escape_step(step_id)))
    }

    /// The key of the `call_index`-th distinct call a step makes, for a step
    /// that fans out to several calls. The index is the call's position in
    /// the step's plan, which a replay recomputes. The same call proposed
    /// twice must keep one index, so the duplicate meets the live claim.
    pub fn for_step_call(run_id: Uuid, step_id: &str, call_index: u32) -> Self {
        ToolKey(format!("run:{run_id}:step:{}:call:{call_index}", escape_step(step_id)))
    }

    /// The key as stored.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// `step_id` with `%` and `:` percent-encoded: injective, and the identity
/// on the step ids orchestrators make, so their keys are unchanged.
fn escape_step(step_id: &str) -> Cow<'_, str> {
    if step_id.contains([':', '%']) {
        Cow::Owned(step_id.replace('%', "%25").replace(':', "%3A"))
    } else {
        Cow::Borrowed(step_id)
    }
}

/// What the tool is handed while it holds the claim.
#[derive(Debug, Clone)]
pub struct ToolCall {
    vendor_key: String,
    lease_expires_at: chrono::DateTime<chrono::Utc>,
    reclaimed: bool,
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
    fn from_answer(answer: Answer) -> Self {
        ToolResult {
            ok: answer.ok,
            retryable: false,
            output: answer.output,
            error: answer.error,
            resource: answer.resource,
        }
    }

    /// The answer this result journals.
    fn answer(&self) -> Answer {
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
    /// The tool ran in this attempt.
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

/// Why a guarded call did not produce an answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ToolError {
    /// Another worker holds a live lease on this call: the effect may be in
    /// flight. Raise it so the orchestrator runs the step again later; never
    /// report it as a result.
    #[error("tool call {scope}/{key} is in flight elsewhere until {lease_expires_at}")]
    ClaimInFlight {
        /// The scope.
        scope: String,
        /// The key.
        key: String,
        /// When that lease passes.
        lease_expires_at: chrono::DateTime<chrono::Utc>,
    },
    /// The key already answers for a call with different arguments.
    #[error("tool call {scope}/{key} was made before with different arguments")]
    Conflict {
        /// The scope.
        scope: String,
        /// The key.
        key: String,
    },
    /// The scope is not a tool scope.
    #[error("{scope:?} is not a tool scope (tool.<name>)")]
    NotAToolScope {
        /// The scope given.
        scope: String,
    },
    /// The tool's timeout is zero or above the step budget.
    #[error("tool timeout {timeout:?} must be above zero and at most the {budget:?} step budget")]
    TimeoutOutOfRange {
        /// The timeout given.
        timeout: Duration,
        /// The step budget.
        budget: Duration,
    },
    /// The tool did not return within its timeout. Its effect is unknown, so
    /// the claim is neither completed nor released: it becomes reclaimable
    /// when its lease (timeout + journal deadline + margin) passes, and the
    /// retry reaches the vendor with the same idempotency key.
    #[error("tool call {scope}/{key} did not return within {timeout:?}")]
    TimedOut {
        /// The scope.
        scope: String,
        /// The key.
        key: String,
        /// The tool's timeout.
        timeout: Duration,
    },
    /// The tool panicked. Its effect is unknown, so the claim is left to its
    /// lease, like a timeout's.
    #[error("tool call {scope}/{key} panicked")]
    Panicked {
        /// The scope.
        scope: String,
        /// The key.
        key: String,
    },
    /// The tool ran, but its answer could not be journaled before the
    /// journal's deadline. The claim is left to its lease: the step runs
    /// again after it, reaching the vendor with the same idempotency key
    /// (or asking the reconciler).
    #[error("tool call {scope}/{key} ran, but its answer was not journaled: {reason}")]
    NotJournaled {
        /// The scope.
        scope: String,
        /// The key.
        key: String,
        /// Why.
        #[source]
        reason: Box<LeftToLease>,
    },
    /// The lease margin is outside [`LEASE_MARGIN_RANGE`].
    #[error("lease margin {0:?} must be between 1 s and 5 min")]
    MarginOutOfRange(Duration),
    /// The journal deadline is outside [`LEASE_MARGIN_RANGE`].
    #[error("journal deadline {0:?} must be between 1 s and 5 min")]
    JournalDeadlineOutOfRange(Duration),
    /// The call's lease (timeout + journal deadline + margin), taken after
    /// the checkpoint's time, would still hold when the orchestrator makes
    /// its last attempt, so a worker that died holding the claim would fail
    /// the whole Run.
    #[error("tool {scope}: its lease {lease:?}, claimed {spent:?} into the step, does not pass before the orchestrator's last attempt, {horizon:?} after the first")]
    LeaseOutlastsRetries {
        /// The scope.
        scope: String,
        /// The lease a call would be claimed for.
        lease: Duration,
        /// Time the step spent before the claim (its checkpoint).
        spent: Duration,
        /// The time until the orchestrator's last attempt.
        horizon: Duration,
    },
    /// The reconciler could not tell whether an earlier attempt's effect
    /// happened. The claim is kept (releasing it would let the next attempt
    /// run without asking); it is reconciled again once its lease passes.
    #[error("tool call {scope}/{key}: could not reconcile an earlier attempt: {reason}")]
    ReconcileFailed {
        /// The scope.
        scope: String,
        /// The key.
        key: String,
        /// What the reconciler reported.
        reason: String,
    },
    /// The plane failed (invalid input, store unreachable, …).
    #[error(transparent)]
    Plane(#[from] Error),
}

impl ToolError {
    /// True when running the step again later may succeed: a call in flight
    /// elsewhere, a timed-out call (its lease will pass), a transient store
    /// failure. False for a conflict or a configuration error.
    pub fn is_retryable(&self) -> bool {
        match self {
            ToolError::ClaimInFlight { .. }
            | ToolError::TimedOut { .. }
            | ToolError::Panicked { .. }
            | ToolError::NotJournaled { .. }
            | ToolError::ReconcileFailed { .. } => true,
            ToolError::Plane(error) => error.is_transient(),
            _ => false,
        }
    }
}

/// Guards tool calls with the idempotency plane.
#[derive(Debug, Clone)]
pub struct ToolGuard<R> {
    driver: EffectDriver<R>,
    margin: Duration,
    journal: Duration,
    horizon: RetryHorizon,
}

impl<R: IdempotencyRepository> ToolGuard<R> {
    /// A guard over `service` for steps that `horizon` retries, with
    /// [`DEFAULT_LEASE_MARGIN`] and [`DEFAULT_JOURNAL_DEADLINE`].
    pub fn new(service: IdempotencyService<R>, horizon: RetryHorizon) -> Self {
        ToolGuard {
            driver: EffectDriver::new(service),
            margin: DEFAULT_LEASE_MARGIN,
            journal: DEFAULT_JOURNAL_DEADLINE,
            horizon,
        }
    }

    /// Sets the margin added to a tool's timeout and journal deadline to
    /// make its lease: 1 s to 5 min.
    pub fn with_lease_margin(mut self, margin: Duration) -> Result<Self, ToolError> {
        if !LEASE_MARGIN_RANGE.contains(&margin) {
            return Err(ToolError::MarginOutOfRange(margin));
        }
        self.margin = margin;
        Ok(self)
    }

    /// Sets how long journaling a call's answer may take, retries included
    /// (default [`DEFAULT_JOURNAL_DEADLINE`]); 1 s to 5 min. It is part of
    /// the lease.
    pub fn with_journal_deadline(mut self, deadline: Duration) -> Result<Self, ToolError> {
        if !LEASE_MARGIN_RANGE.contains(&deadline) {
            return Err(ToolError::JournalDeadlineOutOfRange(deadline));
        }
        self.journal = deadline;
        Ok(self)
    }

    /// The timing of a call of `spec`: its timeout, the journal deadline,
    /// the margin.
    fn timing(&self, spec: &ToolSpec) -> Result<Timing, ToolError> {
        Timing::new(spec.timeout, self.journal, self.margin).map_err(|refused| ToolError::Plane(refused.into()))
    }

    /// The lease a call of `spec` is claimed for: its timeout, plus the
    /// journal deadline, plus the margin.
    pub fn lease_for(&self, spec: &ToolSpec) -> Duration {
        spec.timeout + self.journal + self.margin
    }

    /// Checks that a call of `spec` can run under this guard: its lease
    /// passes before the orchestrator's last attempt. Check every spec when
    /// it is defined; [`run`](Self::run) refuses one that fails, too, with
    /// the time its checkpoint took counted.
    pub fn check(&self, spec: &ToolSpec) -> Result<(), ToolError> {
        self.check_after(spec, Duration::ZERO)
    }

    fn check_after(&self, spec: &ToolSpec, spent: Duration) -> Result<(), ToolError> {
        self.timing(spec)?.check(self.horizon, spent).map_err(|outlasts| ToolError::LeaseOutlastsRetries {
            scope: spec.scope.clone(),
            lease: outlasts.lease,
            spent: outlasts.spent,
            horizon: outlasts.horizon,
        })
    }

    /// Runs one tool call at most once.
    ///
    /// 1. Reads the journal: a stored answer is replayed (span `replayed =
    ///    true`), a live claim raises [`ToolError::ClaimInFlight`], a
    ///    different request under the key raises [`ToolError::Conflict`].
    ///    The checkpoint is not consulted for any of these.
    /// 2. Runs `checkpoint`; [`Checkpoint::Hold`] returns [`ToolRun::Held`]
    ///    without taking the key. The time it took counts against the
    ///    retry horizon ([`ToolError::LeaseOutlastsRetries`]).
    /// 3. Claims the key. A reclaimed call of a [`RepeatSafety::Reconcile`]
    ///    tool asks its reconciler first ([`ToolRun::Reconciled`]). Then runs
    ///    `tool` with the vendor key, and journals its answer (success,
    ///    business failure) or releases (retryable failure) through the
    ///    [`EffectDriver`].
    ///
    /// `tool` (and a reconciler) is cut off at the spec's timeout
    /// ([`ToolError::TimedOut`]), and the journal at its deadline, both
    /// before the lease (timeout + journal deadline + margin) passes, so no
    /// other worker can reclaim the call while this one still runs or
    /// journals it.
    pub async fn run<C, CF, T, TF>(
        &self,
        organization_id: Uuid,
        spec: &ToolSpec,
        key: &ToolKey,
        arguments: &Value,
        checkpoint: C,
        tool: T,
    ) -> Result<ToolRun, ToolError>
    where
        C: FnOnce() -> CF,
        CF: Future<Output = Checkpoint>,
        T: FnOnce(ToolCall) -> TF,
        TF: Future<Output = ToolResult>,
    {
        let span = tracing::info_span!(
            "tool.call",
            %organization_id, scope = spec.scope(), key = key.as_str(),
            outcome = field::Empty, replayed = field::Empty
        );
        async move {
            self.check(spec)?;
            let started = tokio::time::Instant::now();
            let hash = RequestHash::of_json(arguments);
            let scope = spec.scope();
            match self.driver.service().read(organization_id, scope, key.as_str(), &hash).await? {
                ReadOutcome::Absent => {}
                ReadOutcome::Completed { response, resource, response_ref } => {
                    return Ok(replayed(Answer::from_stored(response, resource, response_ref)))
                }
                ReadOutcome::Processing { lease_expires_at } => return Err(in_flight(spec, key, lease_expires_at)),
                ReadOutcome::Conflict => return Err(conflict(spec, key)),
            }
            if checkpoint().await == Checkpoint::Hold {
                tracing::Span::current().record("outcome", "held");
                return Ok(ToolRun::Held);
            }
            self.check_after(spec, started.elapsed())?;
            let effect =
                Effect { organization_id, scope, key: key.as_str(), request_hash: &hash, timing: self.timing(spec)? };
            // A claim whose answer was lost is asked again as the same
            // attempt, for up to half the tool's time: otherwise the step's
            // retry would meet its own claim, in flight until its lease passes.
            let attempt = Attempt::new();
            let ask_until = attempt.started() + spec.timeout / 2;
            let held = match self.driver.begin_until(&effect, &attempt, ask_until).await? {
                Begun::Held(held) => held,
                Begun::Replayed(answer) => return Ok(replayed(answer)),
                Begun::InFlight { lease_expires_at } => return Err(in_flight(spec, key, lease_expires_at)),
                Begun::Conflict => return Err(conflict(spec, key)),
            };
            let call = ToolCall {
                vendor_key: vendor_key(organization_id, scope, key.as_str()),
                lease_expires_at: held.claim().lease_expires_at(),
                reclaimed: held.claim().reclaimed(),
            };
            let cut = |cut: Cut| {
                tracing::Span::current().record("outcome", if cut == Cut::TimedOut { "timed_out" } else { "panicked" });
                let (scope, key) = (scope.to_owned(), key.as_str().to_owned());
                match cut {
                    Cut::TimedOut => ToolError::TimedOut { scope, key, timeout: spec.timeout },
                    Cut::Panicked => ToolError::Panicked { scope, key },
                }
            };
            if let (true, RepeatSafety::Reconcile(reconciler)) = (call.reclaimed, &spec.repeat) {
                let reconciled = match held.run(reconciler(call.clone(), arguments.clone())).await {
                    Ok(reconciled) => reconciled,
                    Err(why) => {
                        let _ = held.settle(Settle::Unknown("the reconciler did not answer")).await;
                        return Err(cut(why));
                    }
                };
                match reconciled {
                    Ok(Some(mut found)) => {
                        // An effect was found: it is the answer, never a
                        // failure to retry.
                        found.retryable = false;
                        let settled = held.settle(Settle::Journal(found.answer())).await;
                        return ended(spec, key, settled, "reconciled").map(|()| ToolRun::Reconciled(found));
                    }
                    Ok(None) => tracing::info!("reconciled: the earlier attempt made no effect; executing"),
                    Err(reason) => {
                        tracing::Span::current().record("outcome", "reconcile_failed");
                        let _ = held.settle(Settle::Unknown("the reconciler could not tell")).await;
                        return Err(ToolError::ReconcileFailed {
                            scope: scope.to_owned(),
                            key: key.as_str().to_owned(),
                            reason,
                        });
                    }
                }
            }
            let result = match held.run(tool(call)).await {
                Ok(result) => result,
                Err(why) => {
                    let _ = held.settle(Settle::Unknown("the tool did not return")).await;
                    return Err(cut(why));
                }
            };
            if result.retryable {
                // No effect, and no other attempt was answered on the
                // strength of this claim (they raise ClaimInFlight).
                let settled = held.settle(Settle::Release).await;
                if let Settled::LeftToLease(why) = &settled {
                    tracing::warn!(reason = %why, "the retryable failure's release did not land; the claim frees itself when its lease passes");
                }
                record_ending(&settled, "released");
            } else {
                let settled = held.settle(Settle::Journal(result.answer())).await;
                ended(spec, key, settled, "completed")?;
            }
            Ok(ToolRun::Executed(result))
        }
        .instrument(span)
        .await
    }
}

/// How a journaled ending ended for the caller: an answer that could not be
/// journaled raises [`ToolError::NotJournaled`], so the step is run again
/// (after the lease, with the same vendor key).
fn ended(spec: &ToolSpec, key: &ToolKey, settled: Settled, done: &'static str) -> Result<(), ToolError> {
    record_ending(&settled, done);
    match settled {
        Settled::LeftToLease(reason) => Err(ToolError::NotJournaled {
            scope: spec.scope().to_owned(),
            key: key.as_str().to_owned(),
            reason: Box::new(reason),
        }),
        _ => Ok(()),
    }
}

/// A replay of the stored answer (a response above the store limit replays
/// as its reference), marked on the `tool.call` span.
fn replayed(answer: Answer) -> ToolRun {
    let span = tracing::Span::current();
    span.record("outcome", "replayed");
    span.record("replayed", true);
    ToolRun::Replayed(ToolResult::from_answer(answer))
}

/// A live claim elsewhere: raised, never a result.
fn in_flight(spec: &ToolSpec, key: &ToolKey, lease_expires_at: chrono::DateTime<chrono::Utc>) -> ToolError {
    tracing::Span::current().record("outcome", "in_flight");
    ToolError::ClaimInFlight { scope: spec.scope().to_owned(), key: key.as_str().to_owned(), lease_expires_at }
}

/// The key answers for other arguments.
fn conflict(spec: &ToolSpec, key: &ToolKey) -> ToolError {
    tracing::Span::current().record("outcome", "conflict");
    ToolError::Conflict { scope: spec.scope().to_owned(), key: key.as_str().to_owned() }
}

/// Records how an executed call ended on the `tool.call` span: `outcome` is
/// `done` (completed, released, reconciled) unless the lease moved on or the
/// ending was left to the lease.
fn record_ending(settled: &Settled, done: &'static str) {
    let span = tracing::Span::current();
    span.record(
        "outcome",
        match settled {
            Settled::LeaseMovedOn => "lease_moved_on",
            Settled::LeftToLease(_) => "left_to_lease",
            Settled::Journaled { .. } | Settled::Released => done,
        },
    );
    span.record("replayed", false);
}

/// `hex(sha256(organization ":" scope ":" key))`: stable across attempts,
/// distinct across tenants sharing one vendor account.
fn vendor_key(organization_id: Uuid, scope: &str, key: &str) -> String {
    let mut hasher = Sha256::new();
    hasher.update(organization_id.as_bytes());
    hasher.update(b":");
    hasher.update(scope.as_bytes());
    hasher.update(b":");
    hasher.update(key.as_bytes());
    hex::encode(hasher.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(scope: &str, timeout: Duration) -> Result<ToolSpec, ToolError> {
        ToolSpec::new(scope, timeout, RepeatSafety::VendorKey)
    }

    fn guard(horizon: RetryHorizon) -> ToolGuard<crate::PostgrestRepository> {
        let client = crate::PostgrestClient::new(crate::ClientConfig::new("http://localhost:1", "k").unwrap()).unwrap();
        ToolGuard::new(IdempotencyService::new(crate::PostgrestRepository::new(client)), horizon)
    }

    const TEN_MINUTES: RetryHorizon = RetryHorizon::until_last_attempt(Duration::from_secs(600));

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

    #[test]
    fn a_margin_outside_one_second_to_five_minutes_is_refused() {
        assert!(matches!(guard(TEN_MINUTES).with_lease_margin(Duration::ZERO), Err(ToolError::MarginOutOfRange(_))));
        assert!(matches!(
            guard(TEN_MINUTES).with_lease_margin(Duration::from_secs(301)),
            Err(ToolError::MarginOutOfRange(_))
        ));
        let guard = guard(TEN_MINUTES).with_lease_margin(Duration::from_secs(7)).unwrap();
        assert_eq!(
            guard.lease_for(&spec("tool.x", Duration::from_secs(3)).unwrap()),
            Duration::from_secs(3 + 10 + 7),
            "timeout + journal deadline + margin"
        );
    }

    #[test]
    fn retry_horizon_a_lease_that_outlasts_the_last_attempt_is_refused_and_one_that_passes_before_it_is_not() {
        // An orchestrator retrying 4 times from 1 s, doubling up to 1 min: its
        // last attempt comes 1 + 2 + 4 + 8 = 15 s after the first.
        let horizon = RetryHorizon::exponential(4, Duration::from_secs(1), Duration::from_secs(60));
        assert_eq!(horizon.until_last(), Duration::from_secs(15));
        let guard = guard(horizon)
            .with_lease_margin(Duration::from_secs(4))
            .unwrap()
            .with_journal_deadline(Duration::from_secs(1))
            .unwrap();
        assert!(guard.check(&spec("tool.x", Duration::from_secs(9)).unwrap()).is_ok(), "lease 14 s < 15 s");
        let refused = guard.check(&spec("tool.x", Duration::from_secs(10)).unwrap());
        assert!(
            matches!(refused, Err(ToolError::LeaseOutlastsRetries { lease, horizon, .. })
                if lease == Duration::from_secs(15) && horizon == Duration::from_secs(15)),
            "lease 15 s is still held at the last attempt: {refused:?}"
        );
        assert_eq!(
            RetryHorizon::exponential(10, Duration::from_secs(10), Duration::from_secs(30)).until_last(),
            Duration::from_secs(10 + 20 + 30 * 8),
            "each wait is capped"
        );
    }

    #[test]
    fn step_keys_are_stable_and_distinct_per_call() {
        let run = Uuid::new_v4();
        assert_eq!(ToolKey::for_step(run, "s1"), ToolKey::for_step(run, "s1"));
        assert_eq!(ToolKey::for_step(run, "s1").as_str(), format!("run:{run}:step:s1"), "unchanged for plain ids");
        assert_ne!(ToolKey::for_step_call(run, "s1", 0), ToolKey::for_step_call(run, "s1", 1));
        assert_ne!(ToolKey::for_step(run, "s1"), ToolKey::for_step_call(run, "s1", 0));
    }

    #[test]
    fn tool_keys_never_collide_when_a_step_id_looks_like_a_call_suffix() {
        let run = Uuid::new_v4();
        assert_ne!(ToolKey::for_step(run, "charge:call:0"), ToolKey::for_step_call(run, "charge", 0));
        assert_ne!(ToolKey::for_step(run, "a%3Ab"), ToolKey::for_step(run, "a:b"));
        assert_ne!(ToolKey::for_step_call(run, "a:call:1", 2), ToolKey::for_step_call(run, "a", 1));
    }

    /// Which call a key was built for: `(run, step, index)`.
    type Call = (u8, String, Option<u32>);

    fn key_of((run, step, index): &Call) -> ToolKey {
        let run = Uuid::from_u128(u128::from(*run));
        match index {
            None => ToolKey::for_step(run, step),
            Some(index) => ToolKey::for_step_call(run, step, *index),
        }
    }

    proptest::proptest! {
        #[test]
        fn distinct_run_step_index_tuples_never_produce_the_same_key(
            a in (0u8..3, "[a-c:%0-9]{0,12}", proptest::option::of(0u32..3)),
            b in (0u8..3, "[a-c:%0-9]{0,12}", proptest::option::of(0u32..3)),
        ) {
            proptest::prop_assert_eq!(a == b, key_of(&a) == key_of(&b), "{:?} and {:?}", a, b);
        }
    }

    #[test]
    fn the_vendor_key_is_stable_and_distinct_per_tenant() {
        // The TypeScript client's tests pin the same value.
        let pinned = Uuid::parse_str("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0").unwrap();
        assert_eq!(
            vendor_key(pinned, "tool.email.send", "run:1:step:2"),
            "3aa05fba1bec70f2b5b4cda4819d67efe3d250b2e4970c266b7b9448155f71df"
        );
        let org = Uuid::new_v4();
        let key = vendor_key(org, "tool.email.send", "run:1:step:2");
        assert_eq!(key, vendor_key(org, "tool.email.send", "run:1:step:2"));
        assert_ne!(key, vendor_key(Uuid::new_v4(), "tool.email.send", "run:1:step:2"));
        assert_ne!(key, vendor_key(org, "tool.email.send", "run:1:step:3"));
        assert_eq!(key.len(), 64);
    }

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
