//! A claim this worker holds: its effect, run within its timeout
//! ([`Held::run`]), and its ending, one of exactly three ([`Settle`]),
//! written within the ending's deadline ([`Held::settle`]; or
//! [`Held::journal_exact`] for a caller with another way to end it).
//!
//! The rules for each ending live here and nowhere else:
//!
//! - [`Settle::Journal`]: success or business failure, stored so that a
//!   replay is indistinguishable from the first answer, whatever its size
//!   or bytes (see [`Answer`]). A database refusal of the answer falls back
//!   to a reference to the effect's resource (a summary when it names
//!   none), keeping `ok`, the error and the resource.
//! - [`Settle::Release`]: only when the caller knows no effect happened
//!   *and* no success can have been answered to anyone on the strength of
//!   this claim. The next attempt runs the effect.
//! - [`Settle::Unknown`]: the outcome is unknown (a timeout, a panic, a lost
//!   vendor answer). Nothing is written; the claim is left to its lease, the
//!   next attempt after it reclaims, and the vendor key or the reconciler
//!   decides whether the effect happened.
//!
//! The lease is the effect's timeout plus the journal's deadline plus a
//! margin ([`Timing`](super::Timing)). The journal (and a release) is cut at its deadline,
//! which ends before the lease does, and retried within it on transient
//! failures: a slow journal lands while the key is still ours, and once the
//! deadline passes this worker starts no other write (each is fenced by its
//! lease token besides).

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::answer::{self, Answer};
use super::idempotency::IdempotencyService;
use super::outcome::{Claim, Completion, Ending};
use crate::error::{Error, InvalidInput};
use crate::repo::IdempotencyRepository;
use crate::storable::Unstorable;
use crate::telemetry::key_hash;

/// The first wait between two attempts of an ending; doubled each time, up
/// to [`MAX_ENDING_BACKOFF`].
pub(super) const FIRST_ENDING_BACKOFF: Duration = Duration::from_millis(50);

/// The longest wait between two attempts of an ending.
pub(super) const MAX_ENDING_BACKOFF: Duration = Duration::from_secs(1);

/// A claim this worker holds, with the deadlines its effect and its ending
/// must keep. Settle it exactly once.
#[derive(Debug)]
pub struct Held<R> {
    pub(super) service: Arc<IdempotencyService<R>>,
    /// The effect's span (`idempotency.effect`), from the claim to its
    /// ending: the effect runs in it and the ending is recorded under it.
    pub(super) span: tracing::Span,
    pub(super) claim: Claim,
    /// When the claim was asked for: the effect's duration counts from here.
    pub(super) started: Instant,
    pub(super) effect_deadline: Instant,
    pub(super) ending_deadline: Instant,
    /// The heartbeat, when the claim is kept alive by one; stopped when the
    /// claim is settled or dropped.
    pub(super) keep_alive: Option<Box<KeepAlive>>,
    /// Fired when the effect must stop: the claim was taken over, or its
    /// lease could not be confirmed in time.
    pub(super) stop: CancellationToken,
}

tokio::task_local! {
    /// The stop of the effect [`Held::run`] is running on this task.
    static EFFECT_STOP: CancellationToken;
}

/// The stop of the effect running on this task under a held claim (inside
/// [`Held::run`]: a tool, a webhook's processing, a queue message's effect,
/// a handler behind the Idempotency-Key layer), or `None` outside one. It
/// fires when the effect must stop where it stands: the claim was taken
/// over, or its heartbeats could not confirm the lease in time. A task the
/// effect spawns does not inherit it: hand it a clone.
pub fn effect_stop() -> Option<CancellationToken> {
    EFFECT_STOP.try_with(CancellationToken::clone).ok()
}

/// What one heartbeat found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Beat {
    /// The lease was extended: the claim is still ours.
    Extended,
    /// The fence moved on: another worker holds the claim.
    Lost,
    /// The extension failed; whether the claim is ours is not known.
    Failed,
}

/// Why an effect did not return.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Cut {
    /// It did not return within its timeout.
    #[error("the effect did not return within its timeout")]
    TimedOut,
    /// It panicked.
    #[error("the effect panicked")]
    Panicked,
    /// A heartbeat found that the fence moved on: another worker holds the
    /// claim now (this one's lease had passed, and it was taken over), so
    /// the effect was stopped where it stood. What it did is unknown; the
    /// new holder's ending is the one that counts.
    #[error("the claim was taken over by another worker; the effect was stopped")]
    FenceLost,
    /// The effect never started: its deadline had passed before it could
    /// (a claim that answered late), or, with a heartbeat, the lease could
    /// not be confirmed (every beat failed) before the effect's deadline or
    /// before the confirmed lease end less the stop margin. Nothing
    /// happened, but the claim may still be held: leave it to its lease.
    #[error("the effect never started: its deadline passed, or the lease could not be confirmed before it")]
    NotStarted,
    /// With a heartbeat, no beat confirmed the lease before its last
    /// confirmed end less the stop margin (the plane was unreachable: a
    /// partition, an outage): the effect's [`stop`](Held::stop) was fired
    /// then, and the effect was dropped at the confirmed end, when another
    /// worker may take the key over. Whatever it did is unknown, and
    /// whatever it returned meanwhile is discarded: leave the claim to its
    /// lease, never journal as its holder.
    #[error("the lease could not be confirmed: the plane did not answer a heartbeat in time; the effect was stopped")]
    LeaseUnconfirmed,
}

impl Cut {
    /// The cut's name, as logged: `timed_out`, `panicked`, `taken_over`,
    /// `not_started`, `lease_unconfirmed`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Cut::TimedOut => "timed_out",
            Cut::Panicked => "panicked",
            Cut::FenceLost => "taken_over",
            Cut::NotStarted => "not_started",
            Cut::LeaseUnconfirmed => "lease_unconfirmed",
        }
    }
}

/// One heartbeat of a claim whose lease is kept by another call than the
/// plane's `extend`: given the lease to ask for, it answers the lease's new
/// end, or `None` when the claim is no longer this worker's (as `extend`
/// does). A queue's heartbeat extends the claim and hides its messages in
/// one call.
#[derive(Clone)]
pub(crate) struct Beater(pub(crate) BeatFn);

/// The function a [`Beater`] calls.
pub(crate) type BeatFn = Arc<
    dyn Fn(Duration) -> futures_util::future::BoxFuture<'static, Result<Option<chrono::DateTime<chrono::Utc>>, Error>>
        + Send
        + Sync,
>;

impl std::fmt::Debug for Beater {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Beater")
    }
}

/// A claim's heartbeat: while the effect runs ([`Held::run`]) and while
/// its ending is written ([`Held::settle`]), the lease is extended every
/// third of `lease`, never to end after `lease_end` (the end the whole
/// lease would have had) and not from `last_beat` (the ending's deadline)
/// on. The beats run inside those calls, so nothing outlives the claim.
///
/// It also keeps the lease's *confirmed end*: when the last request the
/// database answered with the lease (the claim, or a beat) was sent, plus
/// the lease it asked for, on this worker's monotonic clock. The database
/// stamped that lease at least as late, so its end is no earlier: another
/// worker cannot take the key over before the confirmed end, and this
/// worker's clock can only stop it early, never keep it going longer.
#[derive(Debug)]
pub(super) struct KeepAlive {
    /// What extends the lease when it is not the plane's `extend` alone (a
    /// queue's heartbeat also keeps the claim's messages hidden).
    beater: Option<Beater>,
    lease: Duration,
    last_beat: Instant,
    lease_end: Instant,
    /// How long before the confirmed end an effect that could not confirm
    /// its lease is told to stop: the timing's margin, at most a third of
    /// the lease (a beat's interval).
    stop_margin: Duration,
    /// When the next beat is due, less a third of the lease.
    beaten: std::sync::Mutex<Instant>,
    /// The confirmed end of the lease.
    confirmed_end: std::sync::Mutex<Instant>,
    /// Set once an extension answered that the fence moved on.
    lost: std::sync::atomic::AtomicBool,
}

impl KeepAlive {
    /// The heartbeat of a claim asked for at `claimed` for `lease`, with
    /// the timing's `margin`.
    pub(super) fn new(
        lease: Duration,
        claimed: Instant,
        last_beat: Instant,
        lease_end: Instant,
        margin: Duration,
    ) -> Self {
        KeepAlive {
            beater: None,
            lease,
            last_beat,
            lease_end,
            stop_margin: margin.min(lease / 3),
            beaten: std::sync::Mutex::new(claimed),
            confirmed_end: std::sync::Mutex::new(claimed + lease),
            lost: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// This heartbeat extends the lease through `beater`.
    pub(super) fn beating_with(mut self, beater: Option<Beater>) -> Self {
        self.beater = beater;
        self
    }

    /// When an effect that could not confirm its lease is told to stop:
    /// the confirmed end less the stop margin.
    fn stop_at(&self) -> Instant {
        let end = *self.confirmed_end.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        end.checked_sub(self.stop_margin).unwrap_or(end)
    }

    /// The confirmed end of the lease.
    fn confirmed_end(&self) -> Instant {
        *self.confirmed_end.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A beat sent at `sent`, asking for `ask`, was answered: the lease is
    /// ours until at least `sent + ask`, and no longer than the database
    /// said (a beat near the whole lease's end asks less, and shortens it).
    /// Beats go one at a time, so the last answered is the lease's end.
    fn confirmed(&self, sent: Instant, ask: Duration) {
        *self.confirmed_end.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = sent + ask;
    }

    fn lost(&self) -> bool {
        self.lost.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn beaten(&self) -> Instant {
        *self.beaten.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn beat_at(&self, at: Instant) {
        *self.beaten.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = at;
    }
}

impl<R: IdempotencyRepository> Held<R> {
    /// The claim: its key (for the vendor), whether it was reclaimed.
    pub fn claim(&self) -> &Claim {
        &self.claim
    }

    /// When the effect is cut.
    pub fn effect_deadline(&self) -> Instant {
        self.effect_deadline
    }

    /// When this worker stops trying to write the ending; before the lease passes.
    pub fn ending_deadline(&self) -> Instant {
        self.ending_deadline
    }

    /// Fired when the effect must stop where it stands: a heartbeat found
    /// the claim taken over ([`Cut::FenceLost`]), or could not confirm the
    /// lease before its confirmed end less the stop margin
    /// ([`Cut::LeaseUnconfirmed`]). Hand it to the effect (a clone) and
    /// stop at the next safe point when it fires: after it, another worker
    /// may hold the key. The effect's future is dropped at the confirmed
    /// lease end at the latest.
    pub fn stop(&self) -> CancellationToken {
        self.stop.clone()
    }

    /// Runs `effect`, cut at its timeout; a panic is caught and reported.
    /// Either cut leaves the outcome unknown, unless the caller knows
    /// better (settle with [`Settle::Unknown`] by default). With a
    /// heartbeat, the effect starts only under a lease the database
    /// confirmed within the last third of it (a beat is made first when one
    /// is due, as after a wait between two runs): a claim taken over
    /// meanwhile answers [`Cut::FenceLost`] and the effect never starts.
    /// While it runs, a heartbeat that finds the claim taken over stops it
    /// at once ([`Cut::FenceLost`]); when no beat confirms the lease before
    /// its confirmed end less the stop margin, [`stop`](Self::stop) fires
    /// and the effect is dropped at the confirmed end
    /// ([`Cut::LeaseUnconfirmed`]).
    pub async fn run<T>(&self, effect: impl Future<Output = T>) -> Result<T, Cut> {
        let ran = self.run_in_span(effect).instrument(self.span.clone()).await;
        if let Err(cut) = &ran {
            crate::telemetry::record_error(&self.span, cut.as_str());
        }
        ran
    }

    /// [`run`](Self::run), inside the effect's span.
    async fn run_in_span<T>(&self, effect: impl Future<Output = T>) -> Result<T, Cut> {
        // A deadline already past (a claim that answered late) never starts
        // the effect: a first poll could begin it. Nothing ran, which is
        // not what a timeout says (what a cut effect did is unknown).
        if Instant::now() >= self.effect_deadline {
            return Err(Cut::NotStarted);
        }
        if self.stop.is_cancelled() {
            return Err(if self.fence_lost() { Cut::FenceLost } else { Cut::LeaseUnconfirmed });
        }
        if let Some(keep_alive) = &self.keep_alive {
            self.confirm(keep_alive).await?;
            // The confirming beat may have taken what was left.
            if Instant::now() >= self.effect_deadline {
                return Err(Cut::NotStarted);
            }
        }
        let effect = EFFECT_STOP.scope(self.stop.clone(), AssertUnwindSafe(effect).catch_unwind());
        let running = tokio::time::timeout_at(self.effect_deadline, effect);
        let ran = match &self.keep_alive {
            None => running.await,
            Some(keep_alive) => {
                let mut running = std::pin::pin!(running);
                tokio::select! {
                    ran = &mut running => ran,
                    cut = self.keep(keep_alive, true) => {
                        self.stop.cancel();
                        if cut == Cut::LeaseUnconfirmed {
                            tracing::warn!(
                                claim_id = %self.claim.id, scope = %self.claim.scope, outcome = cut.as_str(),
                                "no heartbeat confirmed the lease in time; the effect is told to stop, and is dropped at the lease's confirmed end"
                            );
                            metrics::counter!(crate::telemetry::LEASES_UNCONFIRMED_TOTAL).increment(1);
                            // What the effect answers meanwhile is discarded:
                            // it was told to stop, and the key may be another's.
                            let _ = tokio::time::timeout_at(keep_alive.confirmed_end(), &mut running).await;
                        }
                        return Err(cut);
                    }
                }
            }
        };
        match ran {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(_panic)) => Err(Cut::Panicked),
            Err(_elapsed) => Err(Cut::TimedOut),
        }
    }

    /// Whether a heartbeat found that the fence moved on: another worker
    /// holds the claim, and this one must start nothing more.
    pub fn fence_lost(&self) -> bool {
        self.keep_alive.as_deref().is_some_and(KeepAlive::lost)
    }

    /// Before an effect starts: the lease must have been confirmed by the
    /// database within the last third of the heartbeat lease. Between two
    /// runs nothing beats (a caller may wait seconds before it runs the
    /// effect again), and by then the lease may have passed and another
    /// worker taken the claim over; so an overdue beat is made first, and
    /// the effect starts only once it answered that the claim is still ours.
    /// A failed beat is tried again a second later, until the effect's
    /// deadline: then [`Cut::NotStarted`].
    async fn confirm(&self, keep_alive: &KeepAlive) -> Result<(), Cut> {
        loop {
            if keep_alive.lost() {
                return Err(Cut::FenceLost);
            }
            let now = Instant::now();
            if now >= self.effect_deadline {
                return Err(Cut::NotStarted);
            }
            if now < keep_alive.beaten() + keep_alive.lease / 3 && now < keep_alive.stop_at() {
                return Ok(());
            }
            match tokio::time::timeout_at(self.effect_deadline, self.beat(keep_alive, now)).await {
                Ok(Beat::Failed) => {
                    tokio::time::sleep_until((now + Duration::from_secs(1)).min(self.effect_deadline)).await
                }
                Ok(Beat::Extended | Beat::Lost) => {}
                Err(_unanswered) => return Err(Cut::NotStarted),
            }
        }
    }

    /// Extends the lease every third of the heartbeat lease (at once when a
    /// beat is overdue), until an extension answers that the fence moved
    /// on ([`Cut::FenceLost`]); from the last beat on it beats no more.
    /// With `watch`, it also returns [`Cut::LeaseUnconfirmed`] when the
    /// lease's confirmed end less the stop margin arrives, whatever a beat
    /// still in flight will answer.
    async fn keep(&self, keep_alive: &KeepAlive, watch: bool) -> Cut {
        let beats = async {
            loop {
                tokio::time::sleep_until(keep_alive.beaten() + keep_alive.lease / 3).await;
                let now = Instant::now();
                if now >= keep_alive.last_beat {
                    return std::future::pending().await;
                }
                match self.beat(keep_alive, now).await {
                    Beat::Extended => {}
                    Beat::Lost => return Cut::FenceLost,
                    // Tried again a second later, as long as the lease may
                    // still be ours.
                    Beat::Failed => keep_alive
                        .beat_at(now.checked_sub(keep_alive.lease / 3).unwrap_or(now) + Duration::from_secs(1)),
                }
            }
        };
        if !watch {
            return beats.await;
        }
        let unconfirmed = async {
            loop {
                tokio::time::sleep_until(keep_alive.stop_at()).await;
                // A beat answered meanwhile moved the stop on.
                if Instant::now() >= keep_alive.stop_at() {
                    return Cut::LeaseUnconfirmed;
                }
            }
        };
        tokio::select! {
            cut = beats => cut,
            cut = unconfirmed => cut,
        }
    }

    /// One extension of the lease, asked at `now`: never past the whole
    /// lease's end, never below what the store accepts (the whole lease
    /// ends at least the 1 s margin floor after the last beat).
    async fn beat(&self, keep_alive: &KeepAlive, now: Instant) -> Beat {
        let claim = &self.claim;
        let ask = keep_alive.lease.min(keep_alive.lease_end.saturating_duration_since(now)).max(super::MIN_LEASE);
        let extended = match &keep_alive.beater {
            Some(beater) => (beater.0)(ask).await,
            None => self.service.repository().extend(claim.organization_id, claim.id, claim.lease_token, ask).await,
        };
        match extended {
            Ok(Some(_)) => {
                keep_alive.beat_at(now);
                keep_alive.confirmed(now, ask);
                tracing::debug!(claim_id = %claim.id, ask_ms = ask.as_millis() as u64, "lease extended");
                Beat::Extended
            }
            Ok(None) => {
                keep_alive.lost.store(true, std::sync::atomic::Ordering::SeqCst);
                self.stop.cancel();
                tracing::warn!(claim_id = %claim.id, scope = %claim.scope, "the heartbeat found the claim taken over; stopping the effect");
                metrics::counter!(crate::telemetry::HEARTBEATS_FENCED_TOTAL).increment(1);
                Beat::Lost
            }
            Err(error) => {
                tracing::warn!(claim_id = %claim.id, %error, "a heartbeat failed; trying again");
                Beat::Failed
            }
        }
    }

    /// Runs `ending` while the heartbeat keeps the lease alive, when there
    /// is one: a journal retried within its deadline lands under a lease
    /// still ours. A fence found moved on is the journal's to discover.
    async fn beating<T>(&self, ending: impl Future<Output = T>) -> T {
        let Some(keep_alive) = &self.keep_alive else { return ending.await };
        tokio::select! {
            ended = ending => ended,
            never = async {
                self.keep(keep_alive, false).await;
                std::future::pending::<T>().await
            } => never,
        }
    }
}

/// How a caller ends an effect: one of exactly three endings.
#[derive(Debug, Clone, PartialEq)]
pub enum Settle {
    /// Success or business failure: journal it, so every repeat replays it.
    Journal(Answer),
    /// No effect happened, and no success was answered on the strength of
    /// this claim: delete it so the next attempt runs.
    Release,
    /// The outcome is unknown: write nothing and leave the claim to its
    /// lease. The reason is logged.
    Unknown(&'static str),
}

/// An answer the store would not take as given, and the claim, still held.
#[derive(Debug)]
pub struct Refused<R> {
    /// The claim: end it another way.
    pub held: Held<R>,
    /// The refusal (above the service's limit, or the database's IDEM2/IDEM3).
    pub error: Error,
}

/// How [`Held::settle`] ended.
#[derive(Debug)]
#[must_use]
pub enum Settled {
    /// The answer is in the journal; every repeat replays it. `stand_in`
    /// says why part of it went by reference or summary, if any did.
    Journaled {
        /// Why a stand-in was stored, if one was.
        stand_in: Option<Unstorable>,
        /// The answer as every replay of the key will give it: the stored
        /// form read back (an error cut to its first bytes, an output above
        /// the limit by reference, a field the store holds as text read
        /// back as itself). Answer the first caller with this, not with
        /// what the effect returned, so the first answer equals its replays.
        answer: Answer,
    },
    /// The claim was deleted; the next attempt runs the effect.
    Released,
    /// Our lease had moved on: another worker holds the key and its ending
    /// is the one that counts. Nothing more to do.
    LeaseMovedOn,
    /// Nothing was written: the claim is left to its lease.
    LeftToLease(LeftToLease),
}

/// Why a claim was left to its lease.
#[derive(Debug, thiserror::Error)]
pub enum LeftToLease {
    /// The caller does not know whether the effect happened.
    #[error("the effect's outcome is unknown: {0}")]
    OutcomeUnknown(&'static str),
    /// The ending did not land before its deadline.
    #[error("the {ending} did not land before its deadline")]
    Deadline {
        /// `journal` or `release`.
        ending: &'static str,
    },
    /// The ending failed for good, or kept failing until its deadline.
    #[error("the {ending} failed: {error}")]
    Failed {
        /// `journal` or `release`.
        ending: &'static str,
        /// The last failure.
        #[source]
        error: Error,
    },
}

impl LeftToLease {
    /// The kind of failure, as spans record it (`error.type`):
    /// `outcome_unknown`, `deadline`, or the ending's error's
    /// [kind](Error::kind).
    pub fn kind(&self) -> &'static str {
        match self {
            LeftToLease::OutcomeUnknown(_) => "outcome_unknown",
            LeftToLease::Deadline { .. } => "deadline",
            LeftToLease::Failed { error, .. } => error.kind(),
        }
    }
}

impl Settled {
    /// True when a repeat will find this worker's answer (journaled).
    pub fn is_journaled(&self) -> bool {
        matches!(self, Settled::Journaled { .. })
    }

    /// The journaled answer, as every replay will give it; `None` for
    /// every other ending.
    pub fn journaled(&self) -> Option<&Answer> {
        match self {
            Settled::Journaled { answer, .. } => Some(answer),
            _ => None,
        }
    }

    /// The ending's name, as logged and counted: `journaled`, `released`,
    /// `lease_moved_on`, `left_to_lease`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Settled::Journaled { .. } => "journaled",
            Settled::Released => "released",
            Settled::LeaseMovedOn => "lease_moved_on",
            Settled::LeftToLease(_) => "left_to_lease",
        }
    }
}

impl<R: IdempotencyRepository> Held<R> {
    /// Ends the effect the way `settle` says, within the ending's deadline.
    pub async fn settle(self, settle: Settle) -> Settled {
        let span = self.settle_span();
        async move {
            let settled = match settle {
                Settle::Journal(answer) => match self.beating(self.journal(&answer, false)).await {
                    Ok(settled) => settled,
                    // Unreachable: only an exact journal gives a refusal back.
                    Err(error) => Settled::LeftToLease(LeftToLease::Failed { ending: "journal", error }),
                },
                Settle::Release => self.beating(self.release()).await,
                Settle::Unknown(reason) => Settled::LeftToLease(LeftToLease::OutcomeUnknown(reason)),
            };
            self.record(&settled);
            settled
        }
        .instrument(span)
        .await
    }

    /// The span an ending is recorded on: a child of the effect's.
    fn settle_span(&self) -> tracing::Span {
        tracing::info_span!(
            parent: &self.span,
            "idempotency.settle",
            organization_id = %self.claim.organization_id, idempotency.scope = %self.claim.scope,
            idempotency.key_hash = %key_hash(&self.claim.key), claim_id = %self.claim.id,
            idempotency.ending = tracing::field::Empty, stand_in = tracing::field::Empty,
            error.type = tracing::field::Empty, otel.status_code = tracing::field::Empty
        )
    }

    /// Records an ending written for this claim by a batch, as
    /// [`settle`](Self::settle) records its own.
    pub(super) fn ended(&self, settled: &Settled) {
        self.settle_span().in_scope(|| self.record(settled));
    }

    /// A release on its own after a batch release failed: with
    /// `may_have_landed`, a retry that deletes nothing is checked against
    /// the row, as after a lost answer.
    pub(super) async fn release_after(&self, may_have_landed: bool) -> Settled {
        self.beating(self.release_from(may_have_landed)).await
    }

    /// Journals `answer` whole, or gives the claim back: for a caller with
    /// another way to end the effect when the store refuses the answer as
    /// given (the saved-search start then keeps its snapshot in the Run).
    /// Where [`Settle::Journal`] would store a stand-in (above the
    /// service's limit, or refused by the database), this answers
    /// [`Refused`] with the claim still held; every other ending is as
    /// [`settle`](Self::settle) gives it.
    pub async fn journal_exact(self, answer: Answer) -> Result<Settled, Refused<R>> {
        let (size, limit) = (answer::stored_size(&answer), self.service.response_limit());
        if size > limit {
            let error = InvalidInput::ResponseTooLarge { size, limit }.into();
            return Err(Refused { held: self, error });
        }
        let span = self.settle_span();
        let journaled = self.beating(self.journal(&answer, true)).instrument(span.clone()).await;
        match journaled {
            Ok(settled) => {
                span.in_scope(|| self.record(&settled));
                Ok(settled)
            }
            Err(error) => Err(Refused { held: self, error }),
        }
    }

    /// Journals `answer` in its stored form; once more with the output by
    /// reference when the database refuses the full form, unless `exact`:
    /// then the refusal is answered.
    async fn journal(&self, answer: &Answer, exact: bool) -> Result<Settled, Error> {
        let limit = self.service.response_limit();
        let mut refused = false;
        let mut backoff = FIRST_ENDING_BACKOFF;
        loop {
            // A write is never started once the deadline passed (a first
            // poll could send it).
            if Instant::now() >= self.ending_deadline {
                return Ok(Settled::LeftToLease(LeftToLease::Deadline { ending: "journal" }));
            }
            let stored = answer::store(answer, limit, refused);
            let completion = Completion { response: Some(stored.response), resource: stored.resource };
            let completing = self.service.complete_stored(&self.claim, completion);
            let error = match tokio::time::timeout_at(self.ending_deadline, completing).await {
                // The row as the store answered it, which is what every replay
                // reads (its numbers as the database writes them, too).
                Ok(Ok(Some(row))) => {
                    let answer = Answer::from_stored(row.response, row.resource, row.response_ref);
                    return Ok(Settled::Journaled { stand_in: stored.stand_in, answer });
                }
                Ok(Ok(None)) => return Ok(Settled::LeaseMovedOn),
                Err(_elapsed) => return Ok(Settled::LeftToLease(LeftToLease::Deadline { ending: "journal" })),
                Ok(Err(error)) => error,
            };
            if error.is_unstorable_answer() && exact {
                return Err(error);
            }
            if error.is_unstorable_answer() && !refused {
                tracing::warn!(%error, "the store refused the answer; journaling its output by reference");
                refused = true;
                continue;
            }
            if !self.wait_to_retry(&error, &mut backoff).await {
                return Ok(Settled::LeftToLease(LeftToLease::Failed { ending: "journal", error }));
            }
        }
    }

    /// Deletes the claim, retrying transient failures within the deadline.
    ///
    /// A release whose answer was lost may have landed, and then a retry
    /// finds nothing to delete and answers as a moved-on fence would. So
    /// after such a failure, a retry that deletes nothing is checked
    /// against the row: none left means the release landed (or the key was
    /// freed since, which is the same for the caller), a row means another
    /// worker holds or answered the key.
    async fn release(&self) -> Settled {
        self.release_from(false).await
    }

    /// [`release`](Self::release), knowing whether an earlier attempt may
    /// have landed.
    async fn release_from(&self, may_have_landed: bool) -> Settled {
        let mut backoff = FIRST_ENDING_BACKOFF;
        let mut may_have_landed = may_have_landed;
        loop {
            if Instant::now() >= self.ending_deadline {
                return Settled::LeftToLease(LeftToLease::Deadline { ending: "release" });
            }
            let attempt = tokio::time::timeout_at(self.ending_deadline, self.service.release(&self.claim));
            let error = match attempt.await {
                Ok(Ok(Ending::Recorded)) => return Settled::Released,
                Ok(Ok(Ending::LeaseMovedOn)) if may_have_landed => return self.released_or_moved_on().await,
                Ok(Ok(Ending::LeaseMovedOn)) => return Settled::LeaseMovedOn,
                Err(_elapsed) => return Settled::LeftToLease(LeftToLease::Deadline { ending: "release" }),
                Ok(Err(error)) => error,
            };
            may_have_landed |= super::written::may_have_written(&error);
            if !self.wait_to_retry(&error, &mut backoff).await {
                return Settled::LeftToLease(LeftToLease::Failed { ending: "release", error });
            }
        }
    }

    /// After a release whose answer was lost, a retry deleted nothing: asks
    /// the row (retrying transient failures within the deadline) whether
    /// the first one landed.
    async fn released_or_moved_on(&self) -> Settled {
        let mut backoff = FIRST_ENDING_BACKOFF;
        let claim = &self.claim;
        loop {
            let read = self.service.repository().get(claim.organization_id, &claim.scope, &claim.key);
            let error = match tokio::time::timeout_at(self.ending_deadline, read).await {
                Ok(Ok(None)) => {
                    tracing::info!("a retried release deleted nothing, and no row is left: the first one landed");
                    return Settled::Released;
                }
                Ok(Ok(Some(_))) => return Settled::LeaseMovedOn,
                Err(_elapsed) => return Settled::LeftToLease(LeftToLease::Deadline { ending: "release" }),
                Ok(Err(error)) => error,
            };
            if !self.wait_to_retry(&error, &mut backoff).await {
                return Settled::LeftToLease(LeftToLease::Failed { ending: "release", error });
            }
        }
    }

    /// Waits before another attempt of an ending that failed with `error`:
    /// false when it is not transient or no attempt fits before the deadline.
    async fn wait_to_retry(&self, error: &Error, backoff: &mut Duration) -> bool {
        if !error.is_transient() || Instant::now() + *backoff >= self.ending_deadline {
            return false;
        }
        tracing::info!(%error, backoff_ms = backoff.as_millis() as u64, "the ending failed; trying again within its deadline");
        tokio::time::sleep(*backoff).await;
        *backoff = (*backoff * 2).min(MAX_ENDING_BACKOFF);
        true
    }
}

impl<R> Held<R> {
    /// Records how the effect ended on the current (settle) span and the
    /// effect's, in the log, in `idempotency_effect_endings_total{scope,
    /// ending}` and in `idempotency_effect_duration_seconds{scope, ending}`.
    fn record(&self, settled: &Settled) {
        let scope = self.claim.scope.as_str();
        record(scope, settled);
        self.span.record(crate::telemetry::SPAN_ENDING, settled.as_str());
        if let Settled::LeftToLease(why) = settled {
            crate::telemetry::record_error(&tracing::Span::current(), why.kind());
            // An unknown outcome follows a cut the effect's span already
            // carries (`timed_out`, …), or is the caller's call.
            if !matches!(why, LeftToLease::OutcomeUnknown(_)) {
                crate::telemetry::record_error(&self.span, why.kind());
            }
        }
        metrics::histogram!(
            crate::telemetry::EFFECT_DURATION_SECONDS,
            "scope" => scope.to_owned(),
            "ending" => settled.as_str()
        )
        .record(self.started.elapsed().as_secs_f64());
    }
}

/// The span of the effect `claim` holds: its scope, its key's hash, its
/// attempt, and a link to the trace that first claimed its work when that
/// is another trace (a re-drive, a queue redelivery, a reclaim).
pub(super) fn effect_span(claim: &Claim) -> tracing::Span {
    let span = tracing::info_span!(
        "idempotency.effect",
        organization_id = %claim.organization_id, idempotency.scope = %claim.scope,
        idempotency.key_hash = %key_hash(&claim.key), claim_id = %claim.id,
        idempotency.attempt = tracing::field::Empty, idempotency.reclaimed = claim.reclaimed,
        idempotency.ending = tracing::field::Empty,
        error.type = tracing::field::Empty, otel.status_code = tracing::field::Empty
    );
    if let Some(attempt) = claim.attempt {
        span.record(crate::telemetry::SPAN_ATTEMPT, i64::from(attempt));
    }
    crate::telemetry::link_to_origin(&span, claim.origin.as_deref());
    span
}

/// Records how an effect ended on the span, in the log and in
/// `idempotency_effect_endings_total{scope, ending}`.
fn record(scope: &str, settled: &Settled) {
    let span = tracing::Span::current();
    span.record(crate::telemetry::SPAN_ENDING, settled.as_str());
    match settled {
        Settled::Journaled { stand_in: Some(reason), .. } => {
            span.record("stand_in", reason.as_str());
            tracing::warn!(stand_in = reason.as_str(), "journaled with part of the answer by reference or summary");
        }
        Settled::Journaled { stand_in: None, .. } | Settled::Released => {}
        Settled::LeaseMovedOn => {
            tracing::warn!("the lease moved on before the ending landed; another worker holds the key")
        }
        Settled::LeftToLease(why) => {
            tracing::warn!(reason = %why, "nothing written; the claim is left to its lease and the next attempt after it reclaims")
        }
    }
    metrics::counter!(
        crate::telemetry::EFFECT_ENDINGS_TOTAL,
        "scope" => scope.to_owned(),
        "ending" => settled.as_str()
    )
    .increment(1);
}
