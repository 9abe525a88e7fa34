//! The guard: a tool call's lease settings, and its run from the journal's
//! read to its answer, step by step.

use std::future::Future;
use std::time::Duration;

use serde_json::Value;
use tracing::{field, Instrument};
use uuid::Uuid;

use super::error::ToolError;
use super::key::{vendor_key, ToolKey};
use super::run::{Checkpoint, ToolCall, ToolResult, ToolRun};
use super::spec::{RepeatSafety, ToolSpec};
use crate::repo::IdempotencyRepository;
use crate::service::{
    Answer, Attempt, Begun, Cut, Effect, EffectDriver, Held, IdempotencyService, ReadOutcome, RequestHash,
    RetryHorizon, Settle, Settled, Timing, DEFAULT_JOURNAL_DEADLINE, MIN_LEASE_MARGIN,
};

/// Added to a tool's timeout to make its lease, so the lease outlives the
/// call it guards but passes well before an orchestrator's last retry.
pub const DEFAULT_LEASE_MARGIN: Duration = Duration::from_secs(15);

/// The margins [`ToolGuard::with_lease_margin`] accepts.
pub const LEASE_MARGIN_RANGE: std::ops::RangeInclusive<Duration> = MIN_LEASE_MARGIN..=Duration::from_secs(300);

/// Guards tool calls with the idempotency plane.
#[derive(Debug, Clone)]
pub struct ToolGuard<R> {
    driver: EffectDriver<R>,
    margin: Duration,
    journal: Duration,
    horizon: RetryHorizon,
    /// The heartbeat lease, when calls are kept alive by one.
    heartbeat: Option<Duration>,
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
            heartbeat: None,
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

    /// Claims each call for `lease` instead of the whole lease, and keeps
    /// the claim alive with a heartbeat every third of it while the tool
    /// runs and its answer is journaled, never past the end the whole lease
    /// would have had: a worker that dies mid-call frees the key after
    /// `lease`, while a slow live one keeps it. A heartbeat that finds the
    /// key taken over stops the call; the next attempt meets the new
    /// holder. The retry horizon is then checked against the heartbeat
    /// lease: a dead worker's claim passes that long after its last beat,
    /// so a long tool fits a short horizon. Refused below 3 s or above what
    /// the plane accepts.
    pub fn with_heartbeats(mut self, lease: Duration) -> Result<Self, ToolError> {
        Timing::new(Duration::from_secs(1), self.journal, self.margin)
            .and_then(|timing| timing.with_heartbeats(lease))
            .map_err(|refused| ToolError::Plane(refused.into()))?;
        self.heartbeat = Some(lease);
        Ok(self)
    }

    /// The timing of a call of `spec`: its timeout, the journal deadline,
    /// the margin, and the heartbeat.
    fn timing(&self, spec: &ToolSpec) -> Result<Timing, ToolError> {
        let timing = Timing::new(spec.timeout, self.journal, self.margin);
        let timing = match self.heartbeat {
            Some(lease) => timing.and_then(|timing| timing.with_heartbeats(lease)),
            None => timing,
        };
        timing.map_err(|refused| ToolError::Plane(refused.into()))
    }

    /// The lease a call of `spec` is claimed for: its timeout, plus the
    /// journal deadline, plus the margin; or the heartbeat lease, when it
    /// is shorter.
    pub fn lease_for(&self, spec: &ToolSpec) -> Duration {
        let whole = spec.timeout + self.journal + self.margin;
        self.heartbeat.map_or(whole, |lease| lease.min(whole))
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
            %organization_id, idempotency.scope = spec.scope(),
            idempotency.key_hash = %crate::telemetry::key_hash(key.as_str()),
            outcome = field::Empty, replayed = field::Empty
        );
        async move {
            self.check(spec)?;
            let started = tokio::time::Instant::now();
            let call = Call { organization_id, spec, key, hash: RequestHash::of_json(arguments) };
            if let Next::Done(earlier) = self.read_journal(&call).await? {
                return Ok(earlier);
            }
            if checkpoint().await == Checkpoint::Hold {
                tracing::Span::current().record("outcome", "held");
                return Ok(ToolRun::Held);
            }
            self.check_after(spec, started.elapsed())?;
            let held = match self.claim(&call).await? {
                Next::Go(held) => held,
                Next::Done(replay) => return Ok(replay),
            };
            let handed = ToolCall {
                vendor_key: vendor_key(organization_id, spec.scope(), key.as_str()),
                lease_expires_at: held.claim().lease_expires_at(),
                reclaimed: held.claim().reclaimed(),
                stop: held.stop(),
            };
            let held = match reconcile(&call, held, &handed, arguments).await? {
                Next::Go(held) => held,
                Next::Done(reconciled) => return Ok(reconciled),
            };
            execute(&call, held, handed, tool).await
        }
        .instrument(span)
        .await
    }

    /// Before the checkpoint: reads the journal. A stored answer
    /// replays, a live claim raises [`ToolError::ClaimInFlight`], another
    /// request under the key [`ToolError::Conflict`]; an absent key goes on.
    async fn read_journal(&self, call: &Call<'_>) -> Result<Next<()>, ToolError> {
        let (scope, key) = (call.spec.scope(), call.key.as_str());
        match self.driver.service().read(call.organization_id, scope, key, &call.hash).await? {
            ReadOutcome::Absent => Ok(Next::Go(())),
            ReadOutcome::Completed { response, resource, response_ref } => {
                Ok(Next::Done(replayed(Answer::from_stored(response, resource, response_ref))))
            }
            ReadOutcome::Processing { lease_expires_at } => Err(in_flight(call, lease_expires_at)),
            ReadOutcome::Conflict => Err(conflict(call)),
        }
    }

    /// After the checkpoint allowed the call: claims the key. A
    /// claim whose answer was lost is asked again as the same attempt, for
    /// up to half the tool's time: otherwise the step's retry would meet its
    /// own claim, in flight until its lease passes. Every other answer ends
    /// the call as the read would have.
    async fn claim(&self, call: &Call<'_>) -> Result<Next<Held<R>>, ToolError> {
        let effect = Effect {
            organization_id: call.organization_id,
            scope: call.spec.scope(),
            key: call.key.as_str(),
            request_hash: &call.hash,
            timing: self.timing(call.spec)?,
            request: None,
        };
        let attempt = Attempt::new();
        let ask_until = attempt.started() + call.spec.timeout / 2;
        match self.driver.begin_until(&effect, &attempt, ask_until).await? {
            Begun::Held(held) => Ok(Next::Go(held)),
            Begun::Replayed(answer) => Ok(Next::Done(replayed(answer))),
            Begun::InFlight { lease_expires_at } => Err(in_flight(call, lease_expires_at)),
            Begun::Conflict => Err(conflict(call)),
        }
    }
}

/// One guarded call: who makes it, of which tool, under which key, with
/// which arguments (their hash).
struct Call<'a> {
    organization_id: Uuid,
    spec: &'a ToolSpec,
    key: &'a ToolKey,
    hash: RequestHash,
}

impl Call<'_> {
    fn scope_and_key(&self) -> (String, String) {
        (self.spec.scope().to_owned(), self.key.as_str().to_owned())
    }
}

/// Where a step of a guarded call leads.
enum Next<T> {
    /// On to the next step, with this.
    Go(T),
    /// The call ends with this.
    Done(ToolRun),
}

/// For a reclaimed call of a [`RepeatSafety::Reconcile`] tool
/// (every other call goes straight on): asks the reconciler whether the
/// earlier attempt made its effect. One found is journaled as the call's
/// answer ([`ToolRun::Reconciled`]) and the vendor is not called again;
/// none found goes on to run the tool. A reconciler that cannot tell, or is
/// cut off, leaves the claim to its lease.
async fn reconcile<R: IdempotencyRepository>(
    call: &Call<'_>,
    held: Held<R>,
    handed: &ToolCall,
    arguments: &Value,
) -> Result<Next<Held<R>>, ToolError> {
    let (true, RepeatSafety::Reconcile(reconciler)) = (handed.reclaimed, &call.spec.repeat) else {
        return Ok(Next::Go(held));
    };
    let reconciled = match held.run(reconciler(handed.clone(), arguments.clone())).await {
        Ok(reconciled) => reconciled,
        Err(why) => {
            let _ = held.settle(Settle::Unknown("the reconciler did not answer")).await;
            return Err(cut(call, why));
        }
    };
    match reconciled {
        Ok(Some(mut found)) => {
            // An effect was found: it is the answer, never a failure to retry.
            found.retryable = false;
            let settled = held.settle(Settle::Journal(found.answer())).await;
            Ok(Next::Done(ToolRun::Reconciled(ended(call, settled, "reconciled", found)?)))
        }
        Ok(None) => {
            tracing::info!("reconciled: the earlier attempt made no effect; executing");
            Ok(Next::Go(held))
        }
        Err(reason) => {
            tracing::Span::current().record("outcome", "reconcile_failed");
            let _ = held.settle(Settle::Unknown("the reconciler could not tell")).await;
            let (scope, key) = call.scope_and_key();
            Err(ToolError::ReconcileFailed { scope, key, reason })
        }
    }
}

/// Runs the tool under the claim, cut off at its timeout, and
/// journals its answer (success, business failure) or releases the claim
/// (retryable failure). A tool cut off leaves the claim to its lease.
async fn execute<R, T, TF>(call: &Call<'_>, held: Held<R>, handed: ToolCall, tool: T) -> Result<ToolRun, ToolError>
where
    R: IdempotencyRepository,
    T: FnOnce(ToolCall) -> TF,
    TF: Future<Output = ToolResult>,
{
    let result = match held.run(tool(handed)).await {
        Ok(result) => result,
        Err(why) => {
            let _ = held.settle(Settle::Unknown("the tool did not return")).await;
            return Err(cut(call, why));
        }
    };
    if result.retryable {
        // No effect, and no other attempt was answered on the strength of
        // this claim (they raise ClaimInFlight).
        let settled = held.settle(Settle::Release).await;
        if let Settled::LeftToLease(why) = &settled {
            tracing::warn!(reason = %why, "the retryable failure's release did not land; the claim frees itself when its lease passes");
        }
        record_ending(&settled, "released");
        return Ok(ToolRun::Executed(result));
    }
    let settled = held.settle(Settle::Journal(result.answer())).await;
    Ok(ToolRun::Executed(ended(call, settled, "completed", result)?))
}

/// A tool (or reconciler) cut off at the tool's timeout, or panicked: its
/// effect is unknown. Marked on the `tool.call` span.
fn cut(call: &Call<'_>, cut: Cut) -> ToolError {
    tracing::Span::current().record("outcome", cut.as_str());
    let (scope, key) = call.scope_and_key();
    match cut {
        Cut::TimedOut => ToolError::TimedOut { scope, key, timeout: call.spec.timeout },
        Cut::Panicked => ToolError::Panicked { scope, key },
        // Another worker holds the call now: in flight elsewhere, as a
        // claim that met its live lease would be told.
        Cut::FenceLost => ToolError::ClaimInFlight { scope, key, lease_expires_at: chrono::Utc::now() },
        // The lease could not be confirmed: the call never started, and its
        // claim may still be held. Told as in flight, so the orchestrator
        // retries; the retry meets the claim or takes it over.
        Cut::NotStarted => ToolError::ClaimInFlight { scope, key, lease_expires_at: chrono::Utc::now() },
        Cut::LeaseUnconfirmed => ToolError::LeaseUnconfirmed { scope, key },
    }
}

/// How a journaled ending ended for the caller, who gets `result` as the
/// journal keeps it: every replay answers exactly that (an error cut to
/// its first bytes, an output above the limit by reference, and so on), so
/// the first answer does too. An answer that could not be journaled raises
/// [`ToolError::NotJournaled`], so the step is run again (after the lease,
/// with the same vendor key). When the lease moved on, another worker's
/// ending counts and nothing of ours was stored: `result` as it is.
fn ended(call: &Call<'_>, settled: Settled, done: &'static str, result: ToolResult) -> Result<ToolResult, ToolError> {
    record_ending(&settled, done);
    match settled {
        Settled::Journaled { answer, .. } => Ok(ToolResult::from_answer(answer)),
        Settled::LeftToLease(reason) => {
            let (scope, key) = call.scope_and_key();
            Err(ToolError::NotJournaled { scope, key, reason: Box::new(reason) })
        }
        Settled::Released | Settled::LeaseMovedOn => Ok(result),
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
fn in_flight(call: &Call<'_>, lease_expires_at: chrono::DateTime<chrono::Utc>) -> ToolError {
    tracing::Span::current().record("outcome", "in_flight");
    let (scope, key) = call.scope_and_key();
    ToolError::ClaimInFlight { scope, key, lease_expires_at }
}

/// The key answers for other arguments.
fn conflict(call: &Call<'_>) -> ToolError {
    tracing::Span::current().record("outcome", "conflict");
    let (scope, key) = call.scope_and_key();
    ToolError::Conflict { scope, key }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(scope: &str, timeout: Duration) -> Result<ToolSpec, ToolError> {
        ToolSpec::new(scope, timeout, RepeatSafety::VendorKey)
    }

    fn guard(horizon: RetryHorizon) -> ToolGuard<crate::repo::MemoryRepository> {
        ToolGuard::new(IdempotencyService::new(crate::repo::MemoryRepository::new()), horizon)
    }

    const TEN_MINUTES: RetryHorizon = RetryHorizon::until_last_attempt(Duration::from_secs(600));

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
}
