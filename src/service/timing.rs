//! How long an effect may run, how long its ending may take, and the lease
//! that covers both; and the caller's retry horizon the lease must pass
//! before.

use std::time::Duration;

use crate::error::InvalidInput;

use super::validate;

/// How long writing an effect's ending (journal or release) may take unless
/// set otherwise: 10 s, retries included. It is part of the lease, so a slow
/// journal still lands while the key is ours.
pub const DEFAULT_JOURNAL_DEADLINE: Duration = Duration::from_secs(10);

/// The least margin a [`Timing`] accepts: 1 s. The journal's last attempt
/// may leave just before its deadline; the lease must still hold when it
/// reaches the database, or a reclaim fences it off after the effect ran and
/// a second worker runs it again. The margin is that flight's allowance: a
/// request's trip to the database (through PostgREST, a TLS gateway, a
/// region away) plus the database taking the row lock. Measured with
/// `idem bench`, a claim's round trip through the local server is a few
/// milliseconds at p99; to a hosted project in another region, tens to a
/// few hundred. One second covers that with room; the callers' defaults
/// are 5 s and more.
pub const MIN_LEASE_MARGIN: Duration = Duration::from_secs(1);

/// The three parts of an effect's lease: the effect's own timeout, the
/// deadline of the journal (or release) that ends it, and a margin.
///
/// An effect is cut at its timeout and its ending at the journal deadline,
/// both counted from just before the claim, whose lease the database stamps
/// later. So the lease (their sum plus the margin) passes only after this
/// worker stopped writing: no other worker can reclaim a key while its
/// holder still runs the effect or journals its answer.
///
/// With [heartbeats](Timing::with_heartbeats) the claim is made for a short
/// lease instead, which the holder extends while its effect and its ending
/// run, never past the end the three parts set: a worker that dies is then
/// recovered after the short lease, while a live one keeps its claim for
/// as long as its own deadlines allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    effect: Duration,
    journal: Duration,
    margin: Duration,
    heartbeat: Option<Duration>,
}

/// The shortest lease [`Timing::with_heartbeats`] accepts: 3 s, so a beat
/// every third of it (one second) has room for a round trip that is slow.
pub const MIN_HEARTBEAT_LEASE: Duration = Duration::from_secs(3);

impl Timing {
    /// Refused unless `effect` and `journal` are above zero, `margin` is at
    /// least [`MIN_LEASE_MARGIN`], and the lease they make is one the store
    /// accepts ([`MIN_LEASE`](super::MIN_LEASE) to [`MAX_LEASE`](super::MAX_LEASE)).
    pub fn new(effect: Duration, journal: Duration, margin: Duration) -> Result<Self, InvalidInput> {
        for (what, value) in [("effect timeout", effect), ("journal deadline", journal)] {
            if value.is_zero() {
                return Err(InvalidInput::ZeroDuration { what });
            }
        }
        if margin < MIN_LEASE_MARGIN {
            return Err(InvalidInput::MarginBelowFloor { margin, floor: MIN_LEASE_MARGIN });
        }
        validate::lease(effect.saturating_add(journal).saturating_add(margin))?;
        Ok(Timing { effect, journal, margin, heartbeat: None })
    }

    /// Claims for `lease` instead of the whole of effect + journal + margin,
    /// and keeps it alive with a heartbeat every third of it while the
    /// claim is held (see [`Held`](super::Held)), never past the end the
    /// whole lease would have had. Refused below [`MIN_HEARTBEAT_LEASE`] or
    /// above the store's longest lease; a `lease` at or above the whole
    /// lease needs no heartbeat and is the whole lease.
    pub fn with_heartbeats(self, lease: Duration) -> Result<Self, InvalidInput> {
        if lease < MIN_HEARTBEAT_LEASE {
            return Err(InvalidInput::LeaseTooShort { lease, min: MIN_HEARTBEAT_LEASE });
        }
        validate::lease(lease)?;
        let whole = self.effect + self.journal + self.margin;
        Ok(Timing { heartbeat: (lease < whole).then_some(lease), ..self })
    }

    /// A timing from constants a test checks against [`Timing::new`]: for
    /// defaults, which cannot fail.
    pub(crate) const fn from_checked_constants(effect: Duration, journal: Duration, margin: Duration) -> Self {
        Timing { effect, journal, margin, heartbeat: None }
    }

    /// How long the effect may run.
    pub fn effect(&self) -> Duration {
        self.effect
    }

    /// How long its ending may take.
    pub fn journal(&self) -> Duration {
        self.journal
    }

    /// What the lease adds beyond both.
    pub fn margin(&self) -> Duration {
        self.margin
    }

    /// The lease a claim is made for: effect + journal + margin, or the
    /// heartbeat lease when the claim is kept alive by heartbeats. It is
    /// how long a worker that died holds the key.
    pub fn lease(&self) -> Duration {
        self.heartbeat.unwrap_or(self.effect + self.journal + self.margin)
    }

    /// The heartbeat lease, when the claim is kept alive by heartbeats.
    pub fn heartbeat(&self) -> Option<Duration> {
        self.heartbeat
    }

    /// Checks that a claim made `spent` after the caller's first attempt
    /// (the time its checkpoints took) passes its lease before `horizon`'s
    /// last attempt: a worker that died holding the claim otherwise blocks
    /// every attempt left.
    pub fn check(&self, horizon: RetryHorizon, spent: Duration) -> Result<(), LeaseOutlastsRetries> {
        let lease = self.lease();
        if spent.saturating_add(lease) >= horizon.until_last() {
            return Err(LeaseOutlastsRetries { lease, spent, horizon: horizon.until_last() });
        }
        Ok(())
    }
}

/// A lease that would still hold at the caller's last retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the lease {lease:?}, claimed {spent:?} after the first attempt, does not pass before the last retry, {horizon:?} after it")]
pub struct LeaseOutlastsRetries {
    /// The lease a claim would be made for.
    pub lease: Duration,
    /// Time spent before the claim (checkpoints).
    pub spent: Duration,
    /// The time from the first attempt to the last.
    pub horizon: Duration,
}

/// How long after its first attempt a caller's retrier (an orchestrator,
/// a scheduler, a webhook vendor) makes the last one. A claim's lease must
/// pass before then: a worker that died holding the claim otherwise blocks
/// every remaining attempt, and the work fails on a worker that died
/// seconds after it started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryHorizon(Duration);

impl RetryHorizon {
    /// The last attempt starts at least `after` the first one.
    pub const fn until_last_attempt(after: Duration) -> Self {
        RetryHorizon(after)
    }

    /// An orchestrator that retries a failed step `retries` times, waiting
    /// `initial` before the first retry and doubling the wait up to
    /// `max_delay`. Counts the least it waits: jitter only adds.
    pub fn exponential(retries: u32, initial: Duration, max_delay: Duration) -> Self {
        let mut delay = initial.min(max_delay);
        let mut total = Duration::ZERO;
        for _ in 0..retries {
            total = total.saturating_add(delay);
            delay = delay.saturating_mul(2).min(max_delay);
        }
        RetryHorizon(total)
    }

    /// The time from the first attempt to the last.
    pub fn until_last(&self) -> Duration {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn the_lease_covers_effect_journal_and_margin_and_is_bounded() {
        let timing = Timing::new(S(20), S(10), S(5)).unwrap();
        assert_eq!(timing.lease(), S(35));
        assert_eq!(Timing::new(Duration::ZERO, S(1), S(1)), Err(InvalidInput::ZeroDuration { what: "effect timeout" }));
        assert_eq!(
            Timing::new(S(1), Duration::ZERO, S(1)),
            Err(InvalidInput::ZeroDuration { what: "journal deadline" })
        );
        assert!(matches!(Timing::new(S(86_400), S(1), S(1)), Err(InvalidInput::LeaseTooLong { .. })));
    }

    #[test]
    fn a_margin_below_the_floor_is_refused_since_the_last_journal_attempt_could_land_after_the_lease() {
        for margin in [Duration::ZERO, Duration::from_millis(1), MIN_LEASE_MARGIN - Duration::from_millis(1)] {
            assert_eq!(
                Timing::new(S(5), S(5), margin),
                Err(InvalidInput::MarginBelowFloor { margin, floor: MIN_LEASE_MARGIN }),
                "{margin:?}"
            );
        }
        assert_eq!(Timing::new(S(5), S(5), MIN_LEASE_MARGIN).map(|t| t.lease()), Ok(S(11)));
    }

    #[test]
    fn with_heartbeats_the_claim_is_made_for_the_short_lease_and_the_horizon_counts_it() {
        let whole = Timing::new(S(300), S(10), S(5)).unwrap();
        let beating = whole.with_heartbeats(S(6)).unwrap();
        assert_eq!((beating.lease(), beating.heartbeat()), (S(6), Some(S(6))));
        assert_eq!((beating.effect(), beating.journal(), beating.margin()), (S(300), S(10), S(5)));
        // A dead worker frees the key after 6 s, so a vendor retrying after a
        // minute is served, where the whole lease (315 s) would block it.
        let horizon = RetryHorizon::until_last_attempt(S(60));
        assert!(beating.check(horizon, Duration::ZERO).is_ok());
        assert!(whole.check(horizon, Duration::ZERO).is_err());
        assert_eq!(
            whole.with_heartbeats(S(2)),
            Err(InvalidInput::LeaseTooShort { lease: S(2), min: MIN_HEARTBEAT_LEASE })
        );
        assert!(matches!(whole.with_heartbeats(S(86_401)), Err(InvalidInput::LeaseTooLong { .. })));
        assert_eq!(whole.with_heartbeats(S(400)).map(|t| (t.lease(), t.heartbeat())), Ok((S(315), None)));
    }

    #[test]
    fn time_spent_before_the_claim_counts_against_the_horizon() {
        let timing = Timing::new(S(5), S(5), S(2)).unwrap();
        let horizon = RetryHorizon::until_last_attempt(S(20));
        assert!(timing.check(horizon, Duration::ZERO).is_ok());
        assert_eq!(
            timing.check(horizon, S(8)),
            Err(LeaseOutlastsRetries { lease: S(12), spent: S(8), horizon: S(20) }),
            "12 s of lease from 8 s in reaches the last attempt"
        );
        assert_eq!(RetryHorizon::exponential(4, S(1), S(60)).until_last(), S(15));
    }
}
