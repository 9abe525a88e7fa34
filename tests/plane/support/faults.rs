//! A fault-injecting repository: [`Faulty`] wraps any
//! [`IdempotencyRepository`] and, per operation, delays its answers, loses
//! them after the inner call committed, refuses a call without making it, or
//! says the plane is unavailable, and counts every call.
//!
//! Modelled on the `object_store` crate's `ThrottledStore`, which wraps any
//! store and adds latency per operation; here the faults are switched at
//! run time, while services built over the wrapper keep running:
//!
//! ```ignore
//! let faulty = Faulty::new(MemoryRepository::new());
//! let driver = EffectDriver::new(IdempotencyService::new(faulty.clone()));
//! faulty.once(Op::Complete, Fault::LoseAnswer);   // the next complete commits, its answer is lost
//! faulty.set(Op::Claim, Fault::DelayBefore(ms));  // every claim waits first, until `clear(Op::Claim)`
//! ```
//!
//! Which fault a call meets: the oldest fault queued for its operation with
//! [`Faulty::once`], else what the chooser set with [`Faulty::choose_with`]
//! answers for it (a standing fault set with [`Faulty::set`] is a chooser
//! that always answers it), else none. A chooser sees the call's key, so a
//! randomized test can aim faults at one key; `complete` and `release` name
//! only a claim id, whose key the wrapper learned from the claim that
//! answered it.
//!
//! Clones share the faults, the counts and the inner repository: keep one
//! clone to steer the faults, hand another to the service.

// A toolkit for several test modules: not every one uses every part.
#![allow(dead_code)]

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use idempotency_plane::postgrest::{codes, ClientError, PostgrestError};
use idempotency_plane::repo::{
    BatchClaims, ClaimCall, ClaimFence, ClaimManyCall, ClaimRequest, ClaimRow, CompletionArgs, CompletionItem,
    IdempotencyRecord, OrphanedWork, RedriveCall, WorkRow,
};
use idempotency_plane::{Error, IdempotencyRepository};
use tokio::time::Instant;
use uuid::Uuid;

/// An operation of [`IdempotencyRepository`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// The one-call claim.
    Claim,
    /// The v1 insert.
    TryClaim,
    /// The v1 take-over of a passed lease.
    Reclaim,
    /// A read.
    Get,
    /// The journal: completing a claim.
    Complete,
    /// Deleting an unfinished claim.
    Release,
    /// The heartbeat: extending a held lease.
    Extend,
    /// A batch of claims.
    ClaimMany,
    /// A batch of journals.
    CompleteMany,
    /// A batch of releases.
    ReleaseMany,
}

impl Op {
    /// Every operation.
    pub const ALL: [Op; 10] = [
        Op::Claim,
        Op::TryClaim,
        Op::Reclaim,
        Op::Get,
        Op::Complete,
        Op::Release,
        Op::Extend,
        Op::ClaimMany,
        Op::CompleteMany,
        Op::ReleaseMany,
    ];

    /// The SQL function the operation calls, as errors name it.
    pub fn function(self) -> &'static str {
        match self {
            Op::Claim => "idempotency_claim",
            Op::TryClaim => "idempotency_try_claim",
            Op::Reclaim => "idempotency_reclaim",
            Op::Get => "idempotency_get",
            Op::Complete => "idempotency_complete",
            Op::Release => "idempotency_release",
            Op::Extend => "idempotency_extend",
            Op::ClaimMany => "idempotency_claim_many",
            Op::CompleteMany => "idempotency_complete_many",
            Op::ReleaseMany => "idempotency_release_many",
        }
    }
}

/// What one call meets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Waits this long, then makes the inner call and answers what it
    /// answered. A caller that gives up while waiting made no call.
    DelayBefore(Duration),
    /// Makes the inner call (it commits), then waits this long before
    /// answering. A caller that gives up while waiting did write.
    DelayAfter(Duration),
    /// Makes the inner call (it commits), then answers
    /// [`ClientError::DeadlineExceeded`] with `in_flight: true`: the outcome
    /// is unknown, and the error is transient ([`Error::is_transient`]), as
    /// when a response is lost on its way back beyond the client's retries.
    LoseAnswer,
    /// [`LoseAnswer`](Self::LoseAnswer), after waiting this long: a slow
    /// answer that never arrives.
    LoseAnswerAfter(Duration),
    /// Makes no inner call and answers a refusal by the database with this
    /// HTTP status and code, e.g. [`Fault::refuse_journal`]'s IDEM2.
    Refuse {
        /// The HTTP status PostgREST would answer.
        status: u16,
        /// The SQLSTATE or plane code (see [`codes`]).
        code: &'static str,
    },
    /// Makes no inner call and answers 503 `PGRST000` (PostgREST could not
    /// reach the database): transient, and known not to have run.
    Unavailable,
}

impl Fault {
    /// The store refuses the journal's answer: 400 IDEM2, above the scope's
    /// response limit. [`Error::is_unstorable_answer`] is true for it.
    pub fn refuse_journal() -> Fault {
        Fault::Refuse { status: 400, code: codes::RESPONSE_TOO_LARGE }
    }

    /// Whether the inner call is made under this fault.
    pub fn reaches_the_store(self) -> bool {
        !matches!(self, Fault::Refuse { .. } | Fault::Unavailable)
    }
}

/// One call as a chooser sees it.
#[derive(Debug, Clone, Copy)]
pub struct Call<'a> {
    /// The operation.
    pub op: Op,
    /// The key: the call's own, or the one the wrapper learned for the
    /// claim id it names (`None` for a claim it never saw answered).
    pub key: Option<&'a str>,
    /// The claim id, for `complete` and `release`.
    pub claim_id: Option<Uuid>,
}

/// Decides the fault of a call no queued fault is waiting for.
pub type Chooser = Arc<dyn Fn(&Call<'_>) -> Option<Fault> + Send + Sync>;

/// Any repository, with faults. See the [module documentation](self).
pub struct Faulty<R> {
    inner: Arc<R>,
    state: Arc<Mutex<State>>,
}

#[derive(Default)]
struct State {
    queued: HashMap<Op, VecDeque<Fault>>,
    choosers: HashMap<Op, Chooser>,
    calls: HashMap<Op, Vec<Instant>>,
    reached: HashMap<Op, Vec<Instant>>,
    injected: HashMap<Op, usize>,
    keys: HashMap<Uuid, String>,
    /// Claims whose completion landed (heard or not): the database answers
    /// a repeat of it with the completed row, never a refusal, so a
    /// `Refuse` chosen for one is not injected.
    completed: std::collections::HashSet<Uuid>,
}

impl<R> Clone for Faulty<R> {
    fn clone(&self) -> Self {
        Faulty { inner: self.inner.clone(), state: self.state.clone() }
    }
}

impl<R: fmt::Debug> fmt::Debug for Faulty<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Faulty").field("inner", &self.inner).finish_non_exhaustive()
    }
}

impl<R> Faulty<R> {
    /// `inner`, with no faults yet.
    pub fn new(inner: R) -> Self {
        Faulty { inner: Arc::new(inner), state: Arc::default() }
    }

    /// The repository underneath, e.g. to pass a lease in memory.
    pub fn inner(&self) -> &R {
        &self.inner
    }

    /// Queues `fault` for the next call of `op` that finds no fault queued
    /// before it.
    pub fn once(&self, op: Op, fault: Fault) {
        self.lock().queued.entry(op).or_default().push_back(fault);
    }

    /// Every call of `op` meets `fault` (after any queued ones) until
    /// [`clear`](Self::clear). Replaces a chooser.
    pub fn set(&self, op: Op, fault: Fault) {
        self.choose_with(op, move |_| Some(fault));
    }

    /// `choose` decides the fault of every call of `op` no queued fault is
    /// waiting for. It is called outside the wrapper's lock, from any task.
    pub fn choose_with(&self, op: Op, choose: impl Fn(&Call<'_>) -> Option<Fault> + Send + Sync + 'static) {
        self.lock().choosers.insert(op, Arc::new(choose));
    }

    /// Drops `op`'s queued faults and its chooser.
    pub fn clear(&self, op: Op) {
        let mut state = self.lock();
        state.queued.remove(&op);
        state.choosers.remove(&op);
    }

    /// Drops every queued fault and chooser: from now on every call passes
    /// through. Counts are kept.
    pub fn clear_all(&self) {
        for op in Op::ALL {
            self.clear(op);
        }
    }

    /// Calls of `op` made to the wrapper.
    pub fn calls(&self, op: Op) -> usize {
        self.lock().calls.get(&op).map_or(0, Vec::len)
    }

    /// When each call of `op` was made to the wrapper, in order.
    pub fn calls_at(&self, op: Op) -> Vec<Instant> {
        self.lock().calls.get(&op).cloned().unwrap_or_default()
    }

    /// Calls of `op` the inner repository received: the ones that could
    /// write.
    pub fn reached(&self, op: Op) -> usize {
        self.lock().reached.get(&op).map_or(0, Vec::len)
    }

    /// When each call of `op` reached the inner repository, in order.
    pub fn reached_at(&self, op: Op) -> Vec<Instant> {
        self.lock().reached.get(&op).cloned().unwrap_or_default()
    }

    /// Calls of `op` that met a fault.
    pub fn injected(&self, op: Op) -> usize {
        self.lock().injected.get(&op).copied().unwrap_or(0)
    }

    /// The key of `claim_id`, as learned from the answers the wrapper saw.
    pub fn key_of(&self, claim_id: Uuid) -> Option<String> {
        self.lock().keys.get(&claim_id).cloned()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking chooser is called outside the lock; every change
        // under it is one assignment, so a poisoned state is still whole.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Counts the call and picks its fault.
    fn enter(&self, op: Op, key: Option<&str>, claim_id: Option<Uuid>) -> Option<Fault> {
        let (queued, chooser, learned) = {
            let mut state = self.lock();
            state.calls.entry(op).or_default().push(Instant::now());
            let queued = state.queued.get_mut(&op).and_then(VecDeque::pop_front);
            let learned = claim_id.and_then(|id| state.keys.get(&id).cloned());
            (queued, state.choosers.get(&op).cloned(), learned)
        };
        let key = key.or(learned.as_deref());
        let fault = queued.or_else(|| chooser.and_then(|choose| choose(&Call { op, key, claim_id })));
        if fault.is_some() {
            *self.lock().injected.entry(op).or_default() += 1;
        }
        fault
    }

    fn learn(&self, claim_id: Uuid, key: &str) {
        self.lock().keys.entry(claim_id).or_insert_with(|| key.to_owned());
    }

    /// Runs `call` against the inner repository under `op`'s fault;
    /// `learn` sees what it answered, even when the answer is then lost.
    async fn faulted<T, F>(
        &self,
        op: Op,
        key: Option<&str>,
        claim_id: Option<Uuid>,
        call: impl FnOnce() -> F,
        learn: impl FnOnce(&T),
    ) -> Result<T, Error>
    where
        F: Future<Output = Result<T, Error>>,
    {
        let mut fault = self.enter(op, key, claim_id);
        let landed = op == Op::Complete && claim_id.is_some_and(|id| self.lock().completed.contains(&id));
        if landed && matches!(fault, Some(Fault::Refuse { .. })) {
            // The same answer under the same token already landed: the store
            // answers the completed row, as a repeat-safe completion must.
            fault = None;
        }
        let started = Instant::now();
        match fault {
            Some(Fault::Refuse { status, code }) => return Err(refusal(op, status, code, None)),
            Some(Fault::Unavailable) => {
                return Err(refusal(op, 503, codes::PGRST000, Some(Duration::ZERO)));
            }
            Some(Fault::DelayBefore(wait)) => tokio::time::sleep(wait).await,
            _ => {}
        }
        self.lock().reached.entry(op).or_default().push(Instant::now());
        let answered = call().await;
        if let Ok(value) = &answered {
            learn(value);
        }
        match fault {
            Some(Fault::DelayAfter(wait)) => tokio::time::sleep(wait).await,
            Some(Fault::LoseAnswer) => return Err(lost(op, started.elapsed())),
            Some(Fault::LoseAnswerAfter(wait)) => {
                tokio::time::sleep(wait).await;
                return Err(lost(op, started.elapsed()));
            }
            _ => {}
        }
        answered
    }
}

/// The error of an answer lost after the call ran: a deadline that cut the
/// request in flight, whose outcome is unknown.
pub fn lost(op: Op, elapsed: Duration) -> Error {
    Error::Store(ClientError::DeadlineExceeded {
        function: op.function(),
        deadline: elapsed,
        elapsed,
        attempts: 1,
        in_flight: true,
        last_error: None,
    })
}

/// The error PostgREST answers for a call the database refused with `code`.
pub fn refusal(op: Op, status: u16, code: &str, retry_after: Option<Duration>) -> Error {
    Error::Store(ClientError::Api {
        function: op.function(),
        status,
        error: Box::new(PostgrestError {
            code: code.to_owned(),
            message: format!("a fault injected by the test ({code})"),
            details: None,
            hint: None,
        }),
        retry_after,
    })
}

impl<R: IdempotencyRepository> IdempotencyRepository for Faulty<R> {
    async fn claim(&self, call: &ClaimCall<'_>) -> Result<ClaimRow, Error> {
        self.faulted(
            Op::Claim,
            Some(call.key),
            None,
            || self.inner.claim(call),
            |row: &ClaimRow| self.learn(row.id, &row.key),
        )
        .await
    }

    async fn try_claim(&self, request: &ClaimRequest<'_>) -> Result<Option<IdempotencyRecord>, Error> {
        self.faulted(
            Op::TryClaim,
            Some(request.key),
            None,
            || self.inner.try_claim(request),
            |row| self.learn_record(row),
        )
        .await
    }

    async fn reclaim(&self, request: &ClaimRequest<'_>) -> Result<Option<IdempotencyRecord>, Error> {
        self.faulted(Op::Reclaim, Some(request.key), None, || self.inner.reclaim(request), |row| self.learn_record(row))
            .await
    }

    async fn get(&self, organization_id: Uuid, scope: &str, key: &str) -> Result<Option<IdempotencyRecord>, Error> {
        self.faulted(
            Op::Get,
            Some(key),
            None,
            || self.inner.get(organization_id, scope, key),
            |row| self.learn_record(row),
        )
        .await
    }

    async fn complete(
        &self,
        organization_id: Uuid,
        claim_id: Uuid,
        lease_token: Uuid,
        completion: CompletionArgs<'_>,
    ) -> Result<Option<IdempotencyRecord>, Error> {
        self.faulted(
            Op::Complete,
            None,
            Some(claim_id),
            || self.inner.complete(organization_id, claim_id, lease_token, completion),
            |row| {
                if row.is_some() {
                    self.lock().completed.insert(claim_id);
                }
            },
        )
        .await
    }

    async fn release(&self, organization_id: Uuid, claim_id: Uuid, lease_token: Uuid) -> Result<bool, Error> {
        let release = || self.inner.release(organization_id, claim_id, lease_token);
        self.faulted(Op::Release, None, Some(claim_id), release, |_| {}).await
    }

    async fn extend(
        &self,
        organization_id: Uuid,
        claim_id: Uuid,
        lease_token: Uuid,
        lease: Duration,
    ) -> Result<Option<chrono::DateTime<chrono::Utc>>, Error> {
        let extend = || self.inner.extend(organization_id, claim_id, lease_token, lease);
        self.faulted(Op::Extend, None, Some(claim_id), extend, |_| {}).await
    }
}

impl<R: BatchClaims> BatchClaims for Faulty<R> {
    fn max_batch(&self) -> u64 {
        self.inner.max_batch()
    }

    async fn claim_many(&self, call: &ClaimManyCall<'_>) -> Result<Vec<ClaimRow>, Error> {
        let learn = |rows: &Vec<ClaimRow>| {
            for row in rows {
                self.learn(row.id, &row.key);
            }
        };
        self.faulted(Op::ClaimMany, None, None, || self.inner.claim_many(call), learn).await
    }

    async fn complete_many(
        &self,
        organization_id: Uuid,
        items: &[CompletionItem<'_>],
    ) -> Result<Vec<Option<IdempotencyRecord>>, Error> {
        let learn = |rows: &Vec<Option<IdempotencyRecord>>| {
            for row in rows.iter().flatten() {
                self.lock().completed.insert(row.id);
            }
        };
        self.faulted(Op::CompleteMany, None, None, || self.inner.complete_many(organization_id, items), learn).await
    }

    async fn release_many(&self, organization_id: Uuid, items: &[ClaimFence]) -> Result<Vec<bool>, Error> {
        let release = || self.inner.release_many(organization_id, items);
        self.faulted(Op::ReleaseMany, None, None, release, |_| {}).await
    }
}

/// Re-drives pass through unfaulted: the fault cases aim at the claims and
/// endings of deliveries, and a re-driver over a faulted store is a
/// separate worker.
impl<R: OrphanedWork> OrphanedWork for Faulty<R> {
    fn max_bound(&self) -> u64 {
        self.inner.max_bound()
    }

    async fn redrive(&self, call: &RedriveCall<'_>) -> Result<Vec<WorkRow>, Error> {
        self.inner.redrive(call).await
    }
}

impl<R> Faulty<R> {
    fn learn_record(&self, row: &Option<IdempotencyRecord>) {
        if let Some(row) = row {
            self.learn(row.id, &row.key);
        }
    }
}

/// The wrapper does what it says, on the in-memory repository.
mod tests {
    use idempotency_plane::repo::{ClaimStatus, MemoryRepository};
    use idempotency_plane::RequestHash;
    use serde_json::json;

    use super::*;
    use crate::support::LEASE;

    fn call<'a>(org: Uuid, key: &'a str, hash: &'a RequestHash, token: Uuid) -> ClaimCall<'a> {
        ClaimCall {
            organization_id: org,
            scope: "tool.email.send",
            key,
            request_hash: hash.as_str(),
            lease_token: token,
            lease: LEASE,
            request: None,
        }
    }

    #[tokio::test]
    async fn a_lost_answer_committed_and_is_a_transient_error() {
        let faulty = Faulty::new(MemoryRepository::new());
        let (org, hash, token) = (Uuid::new_v4(), RequestHash::of_json(&json!(1)), Uuid::new_v4());
        faulty.once(Op::Claim, Fault::LoseAnswer);
        let lost = faulty.claim(&call(org, "k", &hash, token)).await.expect_err("the answer is lost");
        assert!(lost.is_transient() && !lost.is_unstorable_answer(), "{lost}");
        let row = faulty.get(org, "tool.email.send", "k").await.unwrap().expect("the claim committed");
        assert_eq!((row.status, row.lease_live, row.lease_token), (ClaimStatus::Processing, true, None));
        assert_eq!(faulty.key_of(row.id).as_deref(), Some("k"), "learned from the lost answer");
        assert_eq!((faulty.calls(Op::Claim), faulty.reached(Op::Claim), faulty.injected(Op::Claim)), (1, 1, 1));

        faulty.once(Op::Complete, Fault::LoseAnswer);
        let answer = json!({"sent": true});
        let args = CompletionArgs { response: Some(&answer), ..CompletionArgs::default() };
        assert!(faulty.complete(row.organization_id, row.id, token, args).await.expect_err("lost").is_transient());
        let done = faulty.get(org, "tool.email.send", "k").await.unwrap().expect("a row");
        assert_eq!((done.status, done.response), (ClaimStatus::Completed, Some(answer)));
    }

    #[tokio::test]
    async fn a_refusal_and_an_outage_never_reach_the_store_and_a_chooser_sees_the_key() {
        let faulty = Faulty::new(MemoryRepository::new());
        let (org, hash, token) = (Uuid::new_v4(), RequestHash::of_json(&json!(1)), Uuid::new_v4());
        faulty.choose_with(Op::Claim, |call| (call.key == Some("down")).then_some(Fault::Unavailable));
        let down = faulty.claim(&call(org, "down", &hash, Uuid::new_v4())).await.expect_err("unavailable");
        assert!(down.is_transient(), "{down}");
        let row = faulty.claim(&call(org, "up", &hash, token)).await.expect("passes through");
        assert_eq!((faulty.calls(Op::Claim), faulty.reached(Op::Claim)), (2, 1));
        assert!(faulty.get(org, "tool.email.send", "down").await.unwrap().is_none(), "nothing written");

        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        faulty.choose_with(Op::Complete, move |call| {
            log.lock().unwrap().push((call.key.map(str::to_owned), call.claim_id));
            Some(Fault::refuse_journal())
        });
        let answer = json!(1);
        let args = CompletionArgs { response: Some(&answer), ..CompletionArgs::default() };
        let refused = faulty.complete(row.organization_id, row.id, token, args).await.expect_err("refused");
        assert!(refused.is_unstorable_answer() && !refused.is_transient(), "{refused}");
        assert_eq!(*seen.lock().unwrap(), [(Some("up".to_owned()), Some(row.id))]);
        assert_eq!((faulty.calls(Op::Complete), faulty.reached(Op::Complete)), (1, 0));
        faulty.clear_all();
        assert!(
            faulty.complete(row.organization_id, row.id, token, args).await.unwrap().is_some(),
            "cleared: passes through"
        );
    }

    #[tokio::test]
    async fn a_caller_that_gives_up_during_a_delay_before_writes_nothing_and_after_it_did_write() {
        let faulty = Faulty::new(MemoryRepository::new());
        let (org, hash) = (Uuid::new_v4(), RequestHash::of_json(&json!(1)));
        faulty.once(Op::Claim, Fault::DelayBefore(Duration::from_secs(60)));
        let claim = call(org, "k", &hash, Uuid::new_v4());
        let cut = tokio::time::timeout(Duration::from_millis(20), faulty.claim(&claim));
        assert!(cut.await.is_err(), "still waiting");
        assert_eq!((faulty.calls(Op::Claim), faulty.reached(Op::Claim)), (1, 0));
        assert!(faulty.get(org, "tool.email.send", "k").await.unwrap().is_none());

        faulty.once(Op::Claim, Fault::DelayAfter(Duration::from_secs(60)));
        let claim = call(org, "k", &hash, Uuid::new_v4());
        let cut = tokio::time::timeout(Duration::from_millis(20), faulty.claim(&claim));
        assert!(cut.await.is_err(), "still waiting");
        assert!(faulty.get(org, "tool.email.send", "k").await.unwrap().is_some(), "the claim committed");
        assert_eq!(faulty.reached_at(Op::Claim).len(), 1);
    }
}
