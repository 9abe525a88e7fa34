//! The idempotency service: validates input, mints every lease token, asks
//! the repository, and checks what it answered before answering the caller.

use std::time::Duration;

use tracing::{field, Instrument};
use uuid::Uuid;

use super::hash::RequestHash;
use super::outcome::{Claim, ClaimOutcome, Completion, Ending, ReadOutcome, ResourceRef};
use super::replay_cache;
use super::stored::{checked, decided, judge, Stored};
use super::{journal, scope, validate};
use crate::error::{Error, InvalidInput};
use crate::repo::{ClaimCall, ClaimStatus, CompletionArgs, IdempotencyRecord, IdempotencyRepository};
use crate::storable::{self, Unstorable};
use crate::telemetry::{key_hash, record_error};

/// The largest response stored inline, as compact JSON: 64 KiB. Every replay
/// reads the row back, and a tool claim lives for 30 days, so the journal
/// keeps answers (ids, statuses, short texts) and points at anything bulkier
/// through its resource. Change it with
/// [`IdempotencyService::with_response_limit`].
pub const DEFAULT_RESPONSE_LIMIT: u64 = 64 * 1024;

/// The longest a completed claim is served from the replay cache: five
/// minutes of the process's clock, far below the shortest retention (24 h).
pub const MAX_REPLAY_CACHE_TTL: Duration = Duration::from_secs(300);

/// The idempotency service. Cheap to clone when its repository is.
#[derive(Debug, Clone)]
pub struct IdempotencyService<R> {
    repo: R,
    response_limit: u64,
    cache: Option<std::sync::Arc<replay_cache::ReplayCache>>,
}

impl<R: IdempotencyRepository> IdempotencyService<R> {
    /// A service over `repo`. Scopes and their retention are the database's
    /// (`agent.idempotency_scopes`).
    pub fn new(repo: R) -> Self {
        IdempotencyService { repo, response_limit: DEFAULT_RESPONSE_LIMIT, cache: None }
    }

    /// Keeps up to `capacity` completed claims, holding at most about
    /// `max_bytes` together, in process for `ttl`, so a replay (and a
    /// conflict against a completed claim) costs no round trip. Only
    /// completed claims are cached: they are terminal. The oldest is evicted
    /// first; an answer larger than `max_bytes` alone is not cached. Keep
    /// the TTL short (a minute or so): it is measured by this process's
    /// clock, and must stay far below the shortest retention (24 hours).
    /// The TTL is capped at [`MAX_REPLAY_CACHE_TTL`].
    pub fn with_replay_cache(mut self, capacity: usize, max_bytes: usize, ttl: Duration) -> Self {
        let ttl = ttl.min(MAX_REPLAY_CACHE_TTL);
        self.cache = Some(std::sync::Arc::new(replay_cache::ReplayCache::new(capacity, max_bytes, ttl)));
        self
    }

    /// Entries in the replay cache and the bytes they approximately hold;
    /// `None` without a cache.
    pub fn replay_cache_stats(&self) -> Option<(usize, usize)> {
        self.cache.as_ref().map(|cache| (cache.len(), cache.approx_bytes()))
    }

    /// What the replay cache knows of a completed claim: its answer for
    /// this request, or a conflict.
    fn cached(&self, organization_id: Uuid, scope: &str, key: &str, hash: &str) -> Option<Cached> {
        let answer = self.cache.as_ref()?.get(organization_id, scope, key)?;
        if answer.request_hash != hash {
            return Some(Cached::Conflict);
        }
        Some(Cached::Answer(Stored {
            response: answer.response,
            resource: answer.resource,
            response_ref: answer.response_ref,
        }))
    }

    /// Remembers the answer of a completed claim the store answered.
    pub(super) fn remember(&self, organization_id: Uuid, scope: &str, key: &str, hash: &str, stored: &Stored) {
        let Some(cache) = &self.cache else { return };
        let answer = replay_cache::CachedAnswer {
            request_hash: hash.to_owned(),
            response: stored.response.clone(),
            resource: stored.resource.clone(),
            response_ref: stored.response_ref.clone(),
        };
        cache.put(organization_id, scope, key, answer);
    }

    /// Sets the largest response stored inline, in bytes of compact JSON. A
    /// larger one is replaced by a [`ResponseRef`](super::ResponseRef) to the completion's
    /// resource, or refused when it names none.
    pub fn with_response_limit(mut self, bytes: u64) -> Self {
        self.response_limit = bytes;
        self
    }

    /// The largest response stored inline, in bytes of compact JSON.
    pub fn response_limit(&self) -> u64 {
        self.response_limit
    }

    /// The repository underneath.
    pub fn repository(&self) -> &R {
        &self.repo
    }

    /// The row of (organization, scope, key) as the database holds it, or
    /// `None`: what an operator inspects to see why a call did not run
    /// (`idem get`). Unlike [`read`](Self::read) it judges nothing and skips
    /// the replay cache; like every call, an empty or oversized scope or key
    /// is refused before any request ([`Error::Invalid`]).
    pub async fn record(
        &self,
        organization_id: Uuid,
        scope: &str,
        key: &str,
    ) -> Result<Option<IdempotencyRecord>, Error> {
        scope::validate_scope(scope)?;
        validate::key(key)?;
        self.repo.get(organization_id, scope, key).await
    }

    /// Reads the journal without writing anything.
    ///
    /// Answers `Absent` when there is no row, and also for a processing row
    /// whose lease has passed: its worker is gone, and the caller's `claim`
    /// will reclaim it. A scope with no policy is [`Error::UnknownScope`].
    pub async fn read(
        &self,
        organization_id: Uuid,
        scope: &str,
        key: &str,
        request_hash: &RequestHash,
    ) -> Result<ReadOutcome, Error> {
        let span = tracing::info_span!(
            "idempotency.read",
            %organization_id, idempotency.scope = scope, idempotency.key_hash = %key_hash(key),
            idempotency.outcome = field::Empty, idempotency.replayed = field::Empty,
            error.type = field::Empty, otel.status_code = field::Empty
        );
        async {
            scope::validate_scope(scope)?;
            validate::key(key)?;
            if let Some(cached) = self.cached(organization_id, scope, key, request_hash.as_str()) {
                let outcome = match cached {
                    Cached::Answer(stored) => stored.into(),
                    Cached::Conflict => ReadOutcome::Conflict,
                };
                record_outcome("read", scope, outcome.kind());
                return Ok(outcome);
            }
            let outcome = match self.repo.get(organization_id, scope, key).await? {
                None => ReadOutcome::Absent,
                Some(record) => judge(checked(record, organization_id, scope, key, None)?, request_hash),
            };
            if let ReadOutcome::Completed { response, resource, response_ref } = &outcome {
                let stored = Stored {
                    response: response.clone(),
                    resource: resource.clone(),
                    response_ref: response_ref.clone(),
                };
                self.remember(organization_id, scope, key, request_hash.as_str(), &stored);
            }
            record_outcome("read", scope, outcome.kind());
            Ok(outcome)
        }
        .instrument(span.clone())
        .await
        .inspect_err(|error: &Error| record_error(&span, error.kind()))
    }

    /// Claims the key for `lease`, or answers why not, in one round trip.
    ///
    /// `Claimed` when the key was free, or held by a worker whose lease passed
    /// (an atomic reclaim: of many concurrent callers exactly one wins). The
    /// retention is the scope's policy in the database, never under the
    /// lease; a scope with no policy is [`Error::UnknownScope`]. The lease is
    /// the operation's timeout plus a margin: the caller knows it, the scope
    /// does not.
    pub async fn claim(
        &self,
        organization_id: Uuid,
        scope: &str,
        key: &str,
        request_hash: &RequestHash,
        lease: Duration,
    ) -> Result<ClaimOutcome, Error> {
        let request_hash = request_hash.as_str();
        let lease_token = Uuid::new_v4();
        self.claim_as(&ClaimCall { organization_id, scope, key, request_hash, lease_token, lease, request: None }).await
    }

    /// [`claim`](Self::claim) with a lease token the caller minted: a
    /// repeat carrying the same token after an answer was lost (beyond the
    /// client's own retries) is recognized as this call, and answers its
    /// claim again while the lease holds. The request hash is the caller's
    /// [`RequestHash`], so it is well formed.
    pub(crate) async fn claim_as(&self, call: &ClaimCall<'_>) -> Result<ClaimOutcome, Error> {
        let ClaimCall { organization_id, scope, key, request_hash, lease, .. } = *call;
        let span = tracing::info_span!(
            "idempotency.claim",
            %organization_id, idempotency.scope = scope, idempotency.key_hash = %key_hash(key),
            lease_ms = i64::try_from(lease.as_millis()).unwrap_or(i64::MAX), carries_work = call.request.is_some(),
            idempotency.outcome = field::Empty, idempotency.replayed = field::Empty,
            idempotency.reclaimed = field::Empty, idempotency.attempt = field::Empty, claim_id = field::Empty,
            error.type = field::Empty, otel.status_code = field::Empty
        );
        async {
            scope::validate_scope(scope)?;
            validate::key(key)?;
            validate::lease(lease)?;
            if let Some(cached) = self.cached(organization_id, scope, key, request_hash) {
                let outcome = match cached {
                    Cached::Answer(stored) => stored.into(),
                    Cached::Conflict => ClaimOutcome::Conflict,
                };
                record_outcome("claim", scope, outcome.kind());
                return Ok(outcome);
            }
            let row = self.repo.claim(call).await?;
            let outcome = decided(row, call)?;
            record_claim_outcome(scope, &outcome);
            match &outcome {
                ClaimOutcome::Claimed(claim) => record_claimed(claim),
                ClaimOutcome::Completed { response, resource, response_ref } => {
                    let stored = Stored {
                        response: response.clone(),
                        resource: resource.clone(),
                        response_ref: response_ref.clone(),
                    };
                    self.remember(organization_id, scope, key, request_hash, &stored);
                }
                ClaimOutcome::Processing { .. } | ClaimOutcome::Conflict => {}
            }
            Ok(outcome)
        }
        .instrument(span.clone())
        .await
        .inspect_err(|error: &Error| record_error(&span, error.kind()))
    }

    /// Completes `claim` with its answer. `LeaseMovedOn` when another worker
    /// reclaimed the key after our lease passed: our answer is not stored,
    /// and the caller must neither retry nor raise.
    pub async fn complete(&self, claim: &Claim, completion: Completion) -> Result<Ending, Error> {
        Ok(match self.complete_stored(claim, completion).await? {
            Some(_) => Ending::Recorded,
            None => Ending::LeaseMovedOn,
        })
    }

    /// [`complete`](Self::complete), answering what the completed row
    /// stores, as every replay reads it, or `None` when the lease moved on.
    pub(super) async fn complete_stored(&self, claim: &Claim, completion: Completion) -> Result<Option<Stored>, Error> {
        let span = tracing::info_span!(
            "idempotency.complete",
            organization_id = %claim.organization_id, idempotency.scope = %claim.scope,
            idempotency.key_hash = %key_hash(&claim.key), claim_id = %claim.id, idempotency.ending = field::Empty,
            error.type = field::Empty, otel.status_code = field::Empty
        );
        async {
            completion.validate()?;
            let response = completion.response.as_ref().filter(|v| !v.is_null());
            let elided = match response {
                Some(response) => self.elide_if_large(response, completion.resource.as_ref())?,
                None => None,
            };
            let args = CompletionArgs {
                resource_type: completion.resource.as_ref().map(|r| r.resource_type.as_str()),
                resource_id: completion.resource.as_ref().map(|r| r.resource_id.as_str()),
                response: elided.as_ref().or(response),
            };
            let completed = match self.repo.complete(claim.organization_id, claim.id, claim.lease_token, args).await? {
                Some(record) => {
                    let record =
                        checked(record, claim.organization_id, &claim.scope, &claim.key, Some(claim.lease_token))?;
                    if record.status != ClaimStatus::Completed {
                        return Err(Error::Inconsistent(format!(
                            "completing claim {} left it {:?}",
                            claim.id, record.status
                        )));
                    }
                    if record.id != claim.id {
                        return Err(Error::Inconsistent(format!(
                            "completing claim {} answered row {}",
                            claim.id, record.id
                        )));
                    }
                    let hash = record.request_hash.clone();
                    let stored = Stored::of(record.response, record.resource_type, record.resource_id);
                    self.remember(claim.organization_id, &claim.scope, &claim.key, &hash, &stored);
                    Some(stored)
                }
                None => None,
            };
            let ending = if completed.is_some() { Ending::Recorded } else { Ending::LeaseMovedOn };
            record_ending("complete", &claim.scope, ending);
            Ok(completed)
        }
        .instrument(span.clone())
        .await
        .inspect_err(|error: &Error| record_error(&span, error.kind()))
    }

    /// The stored form of a response above the limit: a [`ResponseRef`] to
    /// `resource`. `None` when the response fits.
    pub(super) fn elide_if_large(
        &self,
        response: &serde_json::Value,
        resource: Option<&ResourceRef>,
    ) -> Result<Option<serde_json::Value>, Error> {
        let size = storable::json_size(response);
        if size <= self.response_limit {
            return Ok(None);
        }
        let too_large = Unstorable::TooLarge { size, limit: self.response_limit };
        if resource.is_none() {
            return Err(InvalidInput::ResponseTooLarge { size, limit: self.response_limit }.into());
        }
        tracing::info!(size, limit = self.response_limit, "response above the store limit; storing a reference");
        Ok(Some(journal::stand_in(response, too_large, resource)))
    }

    /// Releases `claim` without an answer, so the next attempt executes. For
    /// a failure that made no effect (a vendor 429). `LeaseMovedOn` when the
    /// key is no longer ours: then nothing was deleted.
    pub async fn release(&self, claim: &Claim) -> Result<Ending, Error> {
        let span = tracing::info_span!(
            "idempotency.release",
            organization_id = %claim.organization_id, idempotency.scope = %claim.scope,
            idempotency.key_hash = %key_hash(&claim.key), claim_id = %claim.id, idempotency.ending = field::Empty,
            error.type = field::Empty, otel.status_code = field::Empty
        );
        async {
            let ending = if self.repo.release(claim.organization_id, claim.id, claim.lease_token).await? {
                Ending::Recorded
            } else {
                Ending::LeaseMovedOn
            };
            record_ending("release", &claim.scope, ending);
            Ok(ending)
        }
        .instrument(span.clone())
        .await
        .inspect_err(|error: &Error| record_error(&span, error.kind()))
    }
}

/// What the replay cache answers for a completed claim.
enum Cached {
    /// The stored answer, for the same request.
    Answer(Stored),
    /// The key answers for another request.
    Conflict,
}

/// Records a claim's outcome as [`record_outcome`] does, `reclaimed` on the
/// span for a claim that took over a passed lease.
pub(super) fn record_claim_outcome(scope: &str, outcome: &ClaimOutcome) {
    let reclaimed = matches!(outcome, ClaimOutcome::Claimed(claim) if claim.reclaimed());
    record_outcome_as("claim", scope, outcome.kind(), if reclaimed { "reclaimed" } else { outcome.kind() });
}

/// Records an outcome on the current span (`idempotency.outcome`, with a
/// completed key's answer `replayed`, and `idempotency.replayed`), in the
/// `idempotency_outcomes_total{operation, scope, outcome}` counter, and a
/// live claim elsewhere in `idempotency_waits_total{operation, scope}`.
pub(super) fn record_outcome(operation: &'static str, scope: &str, outcome: &'static str) {
    record_outcome_as(operation, scope, outcome, outcome);
}

/// [`record_outcome`], the span's outcome named `shown` (unless replayed).
fn record_outcome_as(operation: &'static str, scope: &str, outcome: &'static str, shown: &'static str) {
    let span = tracing::Span::current();
    let replayed = outcome == "completed";
    span.record(crate::telemetry::SPAN_OUTCOME, if replayed { "replayed" } else { shown });
    span.record(crate::telemetry::SPAN_REPLAYED, replayed);
    tracing::debug!(outcome, "idempotency outcome");
    metrics::counter!(
        crate::telemetry::OUTCOMES_TOTAL,
        "operation" => operation,
        "scope" => scope.to_owned(),
        "outcome" => outcome
    )
    .increment(1);
    if outcome == "processing" {
        metrics::counter!(crate::telemetry::WAITS_TOTAL, "operation" => operation, "scope" => scope.to_owned())
            .increment(1);
    }
}

/// Records a claim this worker now holds on the current span: whether it
/// was reclaimed, its attempt when known, and its id.
pub(super) fn record_claimed(claim: &Claim) {
    let span = tracing::Span::current();
    span.record(crate::telemetry::SPAN_RECLAIMED, claim.reclaimed());
    if let Some(attempt) = claim.attempt() {
        span.record(crate::telemetry::SPAN_ATTEMPT, i64::from(attempt));
    }
    span.record("claim_id", field::display(claim.id()));
}

/// Records an ending on the current span and in the
/// `idempotency_endings_total{operation, scope, ending}` counter.
pub(super) fn record_ending(operation: &'static str, scope: &str, ending: Ending) {
    let name = match ending {
        Ending::Recorded => "recorded",
        Ending::LeaseMovedOn => "lease_moved_on",
    };
    tracing::Span::current().record(crate::telemetry::SPAN_ENDING, name);
    metrics::counter!(
        crate::telemetry::ENDINGS_TOTAL,
        "operation" => operation,
        "scope" => scope.to_owned(),
        "ending" => name
    )
    .increment(1);
    if ending == Ending::LeaseMovedOn {
        tracing::info!(ending = name, "the lease moved on; this worker's ending was not recorded");
    }
}
