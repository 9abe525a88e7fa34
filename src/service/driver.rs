//! The one road from claim to journal that every caller takes: the tool
//! guard, the webhook gate, the saved-search start and the
//! `Idempotency-Key` layer are front doors over it.
//!
//! [`EffectDriver::begin`] claims (or answers the stored answer, a live
//! claim elsewhere, a conflict) and hands back the claim [`Held`], whose
//! effect runs cut at its timeout and which ends in exactly one of three
//! endings; the rules for each live with [`Held`] and nowhere else. A claim
//! whose outcome is unknown is asked again as the same [`Attempt`]
//! ([`EffectDriver::begin_until`]).

use std::sync::Arc;

use tokio::time::Instant;
use tracing::{field, Instrument};
use uuid::Uuid;

use super::answer::Answer;
use super::hash::RequestHash;
use super::held::{Beater, Held, KeepAlive, FIRST_ENDING_BACKOFF, MAX_ENDING_BACKOFF};
use super::idempotency::IdempotencyService;
use super::outcome::Claim;
use super::outcome::ClaimOutcome;
use super::timing::Timing;
use super::written::may_have_written;
use crate::error::Error;
use crate::repo::{ClaimCall, IdempotencyRepository, OrphanedWork, RedriveCall, WorkRow};
use crate::telemetry::{key_hash, span_count};

/// Drives effects through claim → run → journal. Cheap to clone.
#[derive(Debug)]
pub struct EffectDriver<R> {
    service: Arc<IdempotencyService<R>>,
}

impl<R> Clone for EffectDriver<R> {
    fn clone(&self) -> Self {
        EffectDriver { service: self.service.clone() }
    }
}

/// One effect to drive: the key it is claimed under, and its timing.
#[derive(Debug, Clone, Copy)]
pub struct Effect<'a> {
    /// The tenant.
    pub organization_id: Uuid,
    /// The scope; one the policy table names.
    pub scope: &'a str,
    /// The idempotency key within the scope.
    pub key: &'a str,
    /// The request's hash.
    pub request_hash: &'a RequestHash,
    /// The effect's timeout, its journal's deadline, and the lease they make.
    pub timing: Timing,
    /// The work the claim carries, stored with it so that another worker
    /// can re-drive it if this one dies (see
    /// [`OrphanedWork`](crate::repo::OrphanedWork)); `None` for an effect
    /// that nobody else could finish.
    pub request: Option<&'a serde_json::Value>,
}

/// What [`EffectDriver::begin`] found.
#[derive(Debug)]
#[must_use = "a held claim must be settled, and a live claim elsewhere is not a value"]
pub enum Begun<R> {
    /// The key is ours: run the effect, then settle.
    Held(Held<R>),
    /// An earlier attempt's answer: replay it.
    Replayed(Answer),
    /// Another worker holds a live lease: the effect may be in flight.
    InFlight {
        /// When that lease passes, by the database clock.
        lease_expires_at: chrono::DateTime<chrono::Utc>,
    },
    /// The key answers for a different request.
    Conflict,
}

impl<R: IdempotencyRepository> EffectDriver<R> {
    /// A driver over `service`.
    pub fn new(service: IdempotencyService<R>) -> Self {
        EffectDriver { service: Arc::new(service) }
    }

    /// A driver over a service shared with other callers.
    pub fn shared(service: Arc<IdempotencyService<R>>) -> Self {
        EffectDriver { service }
    }

    /// The service underneath.
    pub fn service(&self) -> &IdempotencyService<R> {
        &self.service
    }

    /// Claims `effect`'s key for its lease, or answers why not. The
    /// effect's timeout and its ending's deadline count from now, before
    /// the claim's request: the database stamps the lease later, so both
    /// end before it does.
    pub async fn begin(&self, effect: &Effect<'_>) -> Result<Begun<R>, Error> {
        self.begin_as(effect, &Attempt::new()).await
    }

    /// [`begin`](Self::begin) as `attempt`: call it again with the same
    /// attempt after an error whose outcome is unknown (the answer was
    /// lost, or cut by a deadline), and a claim the database made for it is
    /// answered as this attempt's own, with deadlines counted from the
    /// attempt's first try.
    pub async fn begin_as(&self, effect: &Effect<'_>, attempt: &Attempt) -> Result<Begun<R>, Error> {
        let timing = effect.timing;
        let claimed = self
            .service
            .claim_as(&ClaimCall {
                organization_id: effect.organization_id,
                scope: effect.scope,
                key: effect.key,
                request_hash: effect.request_hash.as_str(),
                lease_token: attempt.token,
                lease: timing.lease(),
                request: effect.request,
            })
            .await?;
        Ok(self.begun(claimed, timing, attempt.started))
    }

    /// What a claim's outcome means to a caller about to run its effect,
    /// the deadlines of a held claim counted from `started`.
    pub(super) fn begun(&self, claimed: ClaimOutcome, timing: Timing, started: Instant) -> Begun<R> {
        match claimed {
            ClaimOutcome::Claimed(claim) => Begun::Held(self.hold(claim, timing, started)),
            ClaimOutcome::Completed { response, resource, response_ref } => {
                Begun::Replayed(Answer::from_stored(response, resource, response_ref))
            }
            ClaimOutcome::Processing { lease_expires_at } => Begun::InFlight { lease_expires_at },
            ClaimOutcome::Conflict => Begun::Conflict,
        }
    }
}

impl<R: IdempotencyRepository> EffectDriver<R> {
    /// The claim held, with its deadlines counted from `started` (just
    /// before the claim was asked for) and its heartbeat, if `timing` has one.
    fn hold(&self, claim: Claim, timing: Timing, started: Instant) -> Held<R> {
        self.hold_with(claim, timing, started, None)
    }

    /// [`hold`](Self::hold), its heartbeat (if `timing` has one) made by
    /// `beater` when given.
    pub(crate) fn hold_with(&self, claim: Claim, timing: Timing, started: Instant, beater: Option<Beater>) -> Held<R> {
        let ending_deadline = started + timing.effect() + timing.journal();
        let keep_alive = timing.heartbeat().map(|lease| {
            Box::new(
                KeepAlive::new(lease, started, ending_deadline, ending_deadline + timing.margin(), timing.margin())
                    .beating_with(beater),
            )
        });
        Held {
            service: self.service.clone(),
            span: super::held::effect_span(&claim),
            claim,
            started,
            effect_deadline: started + timing.effect(),
            ending_deadline,
            keep_alive,
            stop: tokio_util::sync::CancellationToken::new(),
        }
    }
}

/// What a re-drive took over: work now held by this worker, or a dead letter.
#[derive(Debug)]
#[must_use = "work a re-drive hands out must be run and settled, or it waits for its lease again"]
pub enum Redriven<R> {
    /// The work is ours: run `request`, then settle `held` as any effect.
    Held {
        /// The claim, held under a fresh lease token.
        held: Held<R>,
        /// The work the claim carries, as its first claimant stored it.
        request: serde_json::Value,
        /// Which attempt this is: 2 for the first re-drive.
        attempt: u32,
    },
    /// The work had been handed out as often as its scope allows: journaled
    /// as a failure (`dead_lettered`), which every later claim replays.
    DeadLettered {
        /// The dead letter.
        work: WorkRow,
    },
}

impl<R: IdempotencyRepository + OrphanedWork> EffectDriver<R> {
    /// Takes over up to `bound` orphans of `scope` (or a family,
    /// `webhook.*`), of `organization_id` alone when given: claims whose
    /// worker is gone, with the work they carry. Each is held with
    /// `timing`'s lease (and heartbeat), its deadlines counted from now.
    /// Concurrent re-drivers split the orphans. See
    /// [`OrphanedWork::redrive`].
    pub async fn redrive(
        &self,
        scope: &str,
        bound: u64,
        organization_id: Option<Uuid>,
        timing: Timing,
    ) -> Result<Vec<Redriven<R>>, Error> {
        let span = tracing::info_span!(
            "idempotency.redrive",
            idempotency.scope = scope, bound = i64::try_from(bound).unwrap_or(i64::MAX),
            redriven = field::Empty, dead_lettered = field::Empty,
            error.type = field::Empty, otel.status_code = field::Empty
        );
        let taken = self.redrive_in(scope, bound, organization_id, timing).instrument(span.clone()).await;
        match &taken {
            Ok(taken) => {
                let dead = taken.iter().filter(|taken| matches!(taken, Redriven::DeadLettered { .. })).count();
                span.record("redriven", span_count(taken.len() - dead));
                span.record("dead_lettered", span_count(dead));
            }
            Err(error) => crate::telemetry::record_error(&span, error.kind()),
        }
        taken
    }

    /// [`redrive`](Self::redrive), inside its span.
    async fn redrive_in(
        &self,
        scope: &str,
        bound: u64,
        organization_id: Option<Uuid>,
        timing: Timing,
    ) -> Result<Vec<Redriven<R>>, Error> {
        let started = Instant::now();
        // One token per orphan this call may take over: the client repeats
        // the call with them after a lost answer, and gets the same claims.
        let cap = self.service.repository().max_bound();
        if bound > cap {
            return Err(crate::postgrest::ClientError::BoundAboveCap { bound, cap }.into());
        }
        let tokens: Vec<Uuid> = (0..bound).map(|_| Uuid::new_v4()).collect();
        let call = RedriveCall { scope, lease_tokens: &tokens, lease: timing.lease(), organization_id };
        let taken = self.service.repository().redrive(&call).await?;
        let mut redriven = Vec::with_capacity(taken.len());
        for work in taken {
            let outcome = if work.is_dead_letter() { "dead_lettered" } else { "redriven" };
            metrics::counter!(crate::telemetry::REDRIVES_TOTAL, "scope" => work.scope.clone(), "outcome" => outcome)
                .increment(1);
            if work.is_dead_letter() {
                tracing::warn!(claim_id = %work.id, idempotency.scope = %work.scope, idempotency.key_hash = %key_hash(&work.key), attempts = work.attempt, drop_reason = "dead_lettered", "handed out as often as its scope allows: journaled as a dead letter");
                redriven.push(Redriven::DeadLettered { work });
                continue;
            }
            redriven.push(match (work.lease_token, work.request.clone()) {
                (Some(lease_token), Some(request)) => {
                    tracing::info!(claim_id = %work.id, idempotency.scope = %work.scope, idempotency.key_hash = %key_hash(&work.key), idempotency.attempt = work.attempt, "re-driven: the work is ours");
                    let attempt = work.attempt;
                    let claim = Claim {
                        id: work.id,
                        organization_id: work.organization_id,
                        scope: work.scope,
                        key: work.key,
                        lease_token,
                        lease_expires_at: work.lease_expires_at,
                        retain_until: work.retain_until,
                        reclaimed: true,
                        attempt: Some(attempt),
                        origin: work.traceparent,
                    };
                    Redriven::Held { held: self.hold(claim, timing, started), request, attempt }
                }
                _ => {
                    return Err(Error::Inconsistent(format!(
                        "idempotency_redrive handed out claim {} without its lease token or its work",
                        work.id
                    )))
                }
            });
        }
        Ok(redriven)
    }
}

impl<R: IdempotencyRepository> EffectDriver<R> {
    /// [`begin_as`](Self::begin_as), asked again as the same attempt after
    /// any failure that may have followed the claim's commit (see
    /// [`may_have_written`]), with backoff, each request cut at `until`. The
    /// last failure is answered when no try can start before `until`.
    pub async fn begin_until(&self, effect: &Effect<'_>, attempt: &Attempt, until: Instant) -> Result<Begun<R>, Error> {
        let mut backoff = FIRST_ENDING_BACKOFF;
        loop {
            let asked = match tokio::time::timeout_at(until, self.begin_as(effect, attempt)).await {
                Ok(asked) => asked,
                Err(_cut) => Err(asking_cut(attempt)),
            };
            match asked {
                Err(error) if may_have_written(&error) && Instant::now() + backoff < until => {
                    tracing::info!(%error, backoff_ms = backoff.as_millis() as u64, "the claim's outcome is unknown; asking again as the same attempt");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_ENDING_BACKOFF);
                }
                answered => return answered,
            }
        }
    }
}

/// A claim cut at its asking deadline: a request in flight, whose outcome
/// is unknown (transient, as the client's own deadline is).
pub(crate) fn asking_cut(attempt: &Attempt) -> Error {
    let elapsed = attempt.started.elapsed();
    Error::Store(crate::postgrest::ClientError::DeadlineExceeded {
        function: "idempotency_claim",
        deadline: elapsed,
        elapsed,
        attempts: 1,
        in_flight: true,
        last_error: None,
    })
}

/// One attempt at a claim: the lease token it carries and when it started.
/// Reuse it to ask again after an unknown outcome.
#[derive(Debug, Clone, Copy)]
pub struct Attempt {
    token: Uuid,
    started: Instant,
}

impl Attempt {
    /// A new attempt, starting now, with a fresh lease token.
    pub fn new() -> Self {
        Attempt { token: Uuid::new_v4(), started: Instant::now() }
    }

    /// When the attempt started: its effect's and ending's deadlines count
    /// from here.
    pub fn started(&self) -> Instant {
        self.started
    }
}

impl Default for Attempt {
    fn default() -> Self {
        Attempt::new()
    }
}
