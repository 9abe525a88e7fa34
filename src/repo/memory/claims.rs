//! The claim table in memory: `agent.idempotency_decide` and the functions
//! over it, and the sweeper's bounded reads and deletes.

use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use uuid::Uuid;

use super::{refused, MemoryRepository, Row, State, DEFAULT_MAX_ATTEMPTS, MAX_BOUND};
use crate::error::Error;
use crate::postgrest::{codes, ClientError};
use crate::repo::{
    ClaimCall, ClaimDecision, ClaimRequest, ClaimRow, ClaimStatus, CompletionArgs, ExpiredClaim, ExpiredClaims,
    IdempotencyRecord, IdempotencyRepository, OrphanedWork, RedriveCall, Retired, WorkRow,
};
use crate::storable::{self, Unstorable};

/// The plane's checks of a key's arguments (`agent.idempotency_check_key`):
/// a scope of 1 to 128 characters of `a-z 0-9 . _ -`, a key of 1 to 512.
pub(super) fn key_arguments_well_formed(scope: &str, key: &str) -> bool {
    (1..=128).contains(&scope.len())
        && scope.bytes().all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'.' | b'_' | b'-'))
        && (1..=512).contains(&key.chars().count())
}

impl State {
    /// `agent.idempotency_decide`, the in-memory twin.
    pub(super) fn decide(
        &mut self,
        function: &'static str,
        call: &ClaimCall<'_>,
        retain: Option<Duration>,
        may_insert: bool,
        may_take_over: bool,
    ) -> Result<Option<ClaimRow>, Error> {
        if call.key.contains('\0') || call.scope.contains('\0') {
            return Err(refused(function, "22021"));
        }
        let lease_ms = call.lease.as_millis();
        let retain_ms = retain.map(|r| r.as_millis());
        let well_formed = key_arguments_well_formed(call.scope, call.key)
            && call.request_hash.len() == 64
            && call.request_hash.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
            && (1000..=86_400_000).contains(&lease_ms)
            && retain_ms.is_none_or(|r| (1..=31_622_400_000).contains(&r));
        if !well_formed {
            return Err(refused(function, codes::INVALID_PARAMETER_VALUE));
        }
        let request = call.request.filter(|request| !request.is_null());
        // The work is measured before anything else is looked at, as the
        // SQL measures it before locking the row.
        match request.and_then(|r| storable::unstorable(r, 0, u64::MAX)) {
            Some(Unstorable::TooDeep) => return Err(refused(function, codes::REQUEST_TOO_DEEP)),
            Some(_) => return Err(refused(function, "22P05")),
            None => {}
        }
        let policy = self.policy(call.scope).ok_or_else(|| Error::UnknownScope { scope: call.scope.to_owned() })?;
        if request.is_some_and(|r| storable::json_size(r) > policy.max_request_bytes) {
            return Err(refused(function, codes::REQUEST_TOO_LARGE));
        }
        let lease = TimeDelta::from_std(call.lease).unwrap_or(TimeDelta::MAX);
        let asked = retain.and_then(|r| TimeDelta::from_std(r).ok()).unwrap_or(TimeDelta::zero());
        let retain = policy.retain.max(asked).max(lease);
        let now = self.now();
        let slot = (call.organization_id, call.scope.to_owned(), call.key.to_owned());
        let (outcome, row) = match self.claims.get_mut(&slot) {
            None if !may_insert => return Ok(None),
            None => {
                let record = IdempotencyRecord {
                    id: Uuid::new_v4(),
                    organization_id: call.organization_id,
                    scope: call.scope.to_owned(),
                    key: call.key.to_owned(),
                    request_hash: call.request_hash.to_owned(),
                    status: ClaimStatus::Processing,
                    lease_token: Some(call.lease_token),
                    resource_type: None,
                    resource_id: None,
                    response: None,
                    claimed_at: now,
                    lease_expires_at: now + lease,
                    retain_until: now + lease + retain,
                    lease_live: true,
                };
                let row = Row { record, reclaims: 0, request: request.cloned(), replaced: Vec::new() };
                self.claims.insert(slot, row.clone());
                (ClaimDecision::Claimed, row)
            }
            Some(row) if row.record.request_hash != call.request_hash => (ClaimDecision::Conflict, row.clone()),
            Some(row) if row.record.status == ClaimStatus::Completed => (ClaimDecision::Completed, row.clone()),
            Some(row) if row.record.lease_expires_at > now => {
                let outcome = match (row.record.lease_token == Some(call.lease_token), row.reclaims > 0) {
                    (false, _) => ClaimDecision::Processing,
                    (true, true) => ClaimDecision::Reclaimed,
                    (true, false) => ClaimDecision::Claimed,
                };
                (outcome, row.clone())
            }
            // A passed lease the caller may not take over: nothing to answer.
            Some(_) if !may_take_over => return Ok(None),
            Some(row) => {
                row.record.lease_token = Some(call.lease_token);
                row.record.claimed_at = now;
                row.record.lease_expires_at = now + lease;
                row.record.retain_until = row.record.retain_until.max(now + lease + retain);
                row.reclaims += 1;
                if row.request.is_none() {
                    row.request = request.cloned();
                }
                (ClaimDecision::Reclaimed, row.clone())
            }
        };
        Ok(Some(shown(outcome, row.record, now)))
    }
}

impl State {
    /// `agent.idempotency_complete`, the in-memory twin.
    pub(super) fn complete(
        &mut self,
        organization_id: Uuid,
        claim_id: Uuid,
        lease_token: Uuid,
        completion: CompletionArgs<'_>,
    ) -> Result<Option<IdempotencyRecord>, Error> {
        const FUNCTION: &str = "idempotency_complete";
        let resource_type = completion.resource_type.filter(|t| !t.is_empty());
        let resource_id = completion.resource_id.filter(|i| !i.is_empty());
        let response = completion.response.filter(|r| !r.is_null());
        if (response.is_none() && resource_id.is_none()) || (resource_id.is_some() && resource_type.is_none()) {
            return Err(refused(FUNCTION, codes::INVALID_PARAMETER_VALUE));
        }
        // One walk of the response: what the database refuses it for, if anything.
        let unstorable = response.and_then(|r| storable::unstorable(r, 0, u64::MAX));
        if unstorable == Some(Unstorable::TooDeep) {
            return Err(refused(FUNCTION, codes::RESPONSE_TOO_DEEP));
        }
        if unstorable == Some(Unstorable::Nul)
            || [resource_type, resource_id].iter().flatten().any(|text| text.contains('\0'))
        {
            return Err(refused(FUNCTION, "22P05"));
        }
        let now = self.now();
        let Some(slot) = self
            .claims
            .iter()
            .find(|(slot, row)| slot.0 == organization_id && row.record.id == claim_id)
            .map(|(slot, _)| slot.clone())
        else {
            return Ok(None);
        };
        // What no client could read back is refused before the fence is
        // looked at, as the SQL measures it before locking the row.
        if let Some(response) = response {
            match self.policy(&slot.1).map(|p| p.max_response_bytes) {
                None => return Err(Error::UnknownScope { scope: slot.1.clone() }),
                Some(max) if storable::json_size(response) > max => {
                    return Err(refused(FUNCTION, codes::RESPONSE_TOO_LARGE))
                }
                Some(_) => {}
            }
        }
        let Some(row) = self.claims.get_mut(&slot) else { return Ok(None) };
        let record = &mut row.record;
        if record.lease_token != Some(lease_token) {
            return Ok(None);
        }
        let same_answer = record.resource_type.as_deref() == resource_type
            && record.resource_id.as_deref() == resource_id
            && record.response.as_ref() == response;
        match record.status {
            ClaimStatus::Completed if same_answer => return Ok(Some(with_live(record.clone(), now))),
            ClaimStatus::Completed => return Ok(None),
            ClaimStatus::Processing => {}
        }
        let window = record.retain_until - record.lease_expires_at;
        record.status = ClaimStatus::Completed;
        record.resource_type = resource_type.map(str::to_owned);
        record.resource_id = resource_id.map(str::to_owned);
        record.response = response.cloned();
        record.retain_until = record.retain_until.max(now + window);
        Ok(Some(with_live(record.clone(), now)))
    }

    /// `agent.idempotency_release`, the in-memory twin.
    pub(super) fn release(&mut self, organization_id: Uuid, claim_id: Uuid, lease_token: Uuid) -> bool {
        let before = self.claims.len();
        self.claims.retain(|slot, row| {
            !(slot.0 == organization_id
                && row.record.id == claim_id
                && row.record.lease_token == Some(lease_token)
                && row.record.status == ClaimStatus::Processing)
        });
        self.claims.len() < before
    }
}

/// The row as the one-call claim shows it under `outcome`.
fn shown(outcome: ClaimDecision, record: IdempotencyRecord, now: DateTime<Utc>) -> ClaimRow {
    let owned = matches!(outcome, ClaimDecision::Claimed | ClaimDecision::Reclaimed);
    let completed = outcome == ClaimDecision::Completed;
    ClaimRow {
        outcome,
        id: record.id,
        organization_id: record.organization_id,
        scope: record.scope,
        key: record.key,
        request_hash: (outcome != ClaimDecision::Conflict).then_some(record.request_hash),
        status: record.status,
        lease_token: record.lease_token.filter(|_| owned),
        resource_type: record.resource_type.filter(|_| completed),
        resource_id: record.resource_id.filter(|_| completed),
        response: record.response.filter(|_| completed),
        claimed_at: record.claimed_at,
        lease_expires_at: record.lease_expires_at,
        retain_until: record.retain_until,
        lease_live: record.status == ClaimStatus::Processing && record.lease_expires_at > now,
        // The twin keeps no trace context.
        traceparent: None,
    }
}

/// The claim row of a v1 function: claimed or reclaimed only, token shown.
fn owned_record(row: ClaimRow) -> Option<IdempotencyRecord> {
    if !matches!(row.outcome, ClaimDecision::Claimed | ClaimDecision::Reclaimed) {
        return None;
    }
    Some(IdempotencyRecord {
        id: row.id,
        organization_id: row.organization_id,
        scope: row.scope,
        key: row.key,
        request_hash: row.request_hash?,
        status: row.status,
        lease_token: Some(row.lease_token?),
        resource_type: row.resource_type,
        resource_id: row.resource_id,
        response: row.response,
        claimed_at: row.claimed_at,
        lease_expires_at: row.lease_expires_at,
        retain_until: row.retain_until,
        lease_live: row.lease_live,
    })
}

fn with_live(mut record: IdempotencyRecord, now: DateTime<Utc>) -> IdempotencyRecord {
    record.lease_live = record.status == ClaimStatus::Processing && record.lease_expires_at > now;
    record
}

impl IdempotencyRepository for MemoryRepository {
    async fn claim(&self, call: &ClaimCall<'_>) -> Result<ClaimRow, Error> {
        let row = self.lock().decide("idempotency_claim", call, None, true, true)?;
        row.ok_or_else(|| Error::Inconsistent("the in-memory claim decided nothing".into()))
    }

    async fn try_claim(&self, request: &ClaimRequest<'_>) -> Result<Option<IdempotencyRecord>, Error> {
        let call = v1_call(request);
        Ok(self
            .lock()
            .decide("idempotency_try_claim", &call, Some(request.retain), true, false)?
            .and_then(owned_record))
    }

    async fn reclaim(&self, request: &ClaimRequest<'_>) -> Result<Option<IdempotencyRecord>, Error> {
        let call = v1_call(request);
        Ok(self.lock().decide("idempotency_reclaim", &call, Some(request.retain), false, true)?.and_then(owned_record))
    }

    async fn get(&self, organization_id: Uuid, scope: &str, key: &str) -> Result<Option<IdempotencyRecord>, Error> {
        if !key_arguments_well_formed(scope, key) {
            return Err(refused("idempotency_get", codes::INVALID_PARAMETER_VALUE));
        }
        let state = self.lock();
        if state.policy(scope).is_none() {
            return Err(Error::UnknownScope { scope: scope.to_owned() });
        }
        let now = state.now();
        let row = state.claims.get(&(organization_id, scope.to_owned(), key.to_owned()));
        // The token is its holder's alone: a read never answers it.
        Ok(row.map(|row| IdempotencyRecord { lease_token: None, ..with_live(row.record.clone(), now) }))
    }

    async fn complete(
        &self,
        organization_id: Uuid,
        claim_id: Uuid,
        lease_token: Uuid,
        completion: CompletionArgs<'_>,
    ) -> Result<Option<IdempotencyRecord>, Error> {
        self.lock().complete(organization_id, claim_id, lease_token, completion)
    }

    async fn release(&self, organization_id: Uuid, claim_id: Uuid, lease_token: Uuid) -> Result<bool, Error> {
        Ok(self.lock().release(organization_id, claim_id, lease_token))
    }

    async fn extend(
        &self,
        organization_id: Uuid,
        claim_id: Uuid,
        lease_token: Uuid,
        lease: Duration,
    ) -> Result<Option<DateTime<Utc>>, Error> {
        if !(1000..=86_400_000).contains(&lease.as_millis()) {
            return Err(refused("idempotency_extend", codes::INVALID_PARAMETER_VALUE));
        }
        let lease = TimeDelta::from_std(lease).unwrap_or(TimeDelta::MAX);
        let mut state = self.lock();
        let now = state.now();
        let held = state.claims.iter_mut().find(|(slot, row)| {
            slot.0 == organization_id
                && row.record.id == claim_id
                && row.record.lease_token == Some(lease_token)
                && row.record.status == ClaimStatus::Processing
        });
        let Some((_, row)) = held else { return Ok(None) };
        let record = &mut row.record;
        let window = record.retain_until - record.lease_expires_at;
        record.lease_expires_at = now + lease;
        record.retain_until = record.retain_until.max(now + lease + window);
        Ok(Some(record.lease_expires_at))
    }
}

impl State {
    /// Refuses a scope pattern as the plane does: one that is not a scope
    /// or a family (22023), or that names no policy row (IDEM1).
    pub(super) fn check_pattern(&self, function: &'static str, pattern: &str) -> Result<(), Error> {
        if !scope_pattern_well_formed(pattern) {
            return Err(refused(function, codes::INVALID_PARAMETER_VALUE));
        }
        let known = self.policy(pattern).is_some()
            || pattern
                .strip_suffix('*')
                .is_some_and(|prefix| self.policies.iter().any(|p| p.scope.starts_with(prefix)));
        if known {
            Ok(())
        } else {
            Err(Error::UnknownScope { scope: pattern.to_owned() })
        }
    }
}

/// Whether `scope` is `pattern`, or a member of it when `pattern` is a
/// family (`webhook.*`).
pub(super) fn in_scope(pattern: &str, scope: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => scope.starts_with(prefix),
        None => scope == pattern,
    }
}

/// A scope or a family, as `agent.idempotency_redrive` accepts it.
fn scope_pattern_well_formed(pattern: &str) -> bool {
    let names = pattern.strip_suffix(".*").unwrap_or(pattern);
    pattern.len() <= 128
        && !names.is_empty()
        && names
            .split('.')
            .all(|name| !name.is_empty() && name.bytes().all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-')))
}

impl OrphanedWork for MemoryRepository {
    fn max_bound(&self) -> u64 {
        MAX_BOUND
    }

    async fn redrive(&self, call: &RedriveCall<'_>) -> Result<Vec<WorkRow>, Error> {
        const FUNCTION: &str = "idempotency_redrive";
        let bound = call.lease_tokens.len() as u64;
        if bound > MAX_BOUND {
            return Err(ClientError::BoundAboveCap { bound, cap: MAX_BOUND }.into());
        }
        if bound == 0 {
            return Ok(Vec::new());
        }
        let repeated = call.lease_tokens.iter().enumerate().any(|(i, token)| call.lease_tokens[..i].contains(token));
        if repeated || !(1000..=86_400_000).contains(&call.lease.as_millis()) {
            return Err(refused(FUNCTION, codes::INVALID_PARAMETER_VALUE));
        }
        let mut state = self.lock();
        state.check_pattern(FUNCTION, call.scope)?;
        let now = state.now();
        let lease = TimeDelta::from_std(call.lease).unwrap_or(TimeDelta::MAX);
        let in_call = |slot: &(Uuid, String, String), row: &Row| {
            in_scope(call.scope, &slot.1)
                && call.organization_id.is_none_or(|org| org == slot.0)
                && row.request.is_some()
                && row.record.status == ClaimStatus::Processing
        };
        // What an earlier call with these tokens took over and still holds:
        // answered again, at the same attempt.
        let mine: Vec<_> = state
            .claims
            .iter()
            .filter(|(slot, row)| {
                in_call(slot, row) && row.record.lease_token.is_some_and(|token| call.lease_tokens.contains(&token))
            })
            .map(|(slot, _)| slot.clone())
            .collect();
        let unused: Vec<Uuid> = call
            .lease_tokens
            .iter()
            .copied()
            .filter(|token| !mine.iter().any(|slot| state.claims[slot].record.lease_token == Some(*token)))
            .collect();
        let mut orphans: Vec<_> = state
            .claims
            .iter()
            .filter(|(slot, row)| in_call(slot, row) && row.record.lease_expires_at <= now && !mine.contains(slot))
            .map(|(slot, row)| (row.record.lease_expires_at, row.record.id, slot.clone()))
            .collect();
        orphans.sort();
        orphans.truncate(unused.len());
        let mut taken = Vec::with_capacity(orphans.len() + mine.len());
        for ((_, _, slot), token) in orphans.into_iter().zip(unused) {
            let max_attempts = state.policy(&slot.1).map_or(DEFAULT_MAX_ATTEMPTS, |p| p.max_attempts);
            let Some(row) = state.claims.get_mut(&slot) else { continue };
            let window = row.record.retain_until - row.record.lease_expires_at;
            let dead = row.reclaims + 1 >= max_attempts;
            if dead {
                row.record.status = ClaimStatus::Completed;
                row.record.response = Some(serde_json::json!({
                    "ok": false, "error": "dead_lettered", "output": {"attempts": row.reclaims + 1}
                }));
                row.record.retain_until = row.record.retain_until.max(now + window);
            } else {
                row.record.lease_token = Some(token);
                row.record.claimed_at = now;
                row.record.lease_expires_at = now + lease;
                row.record.retain_until = row.record.retain_until.max(now + lease + window);
                row.reclaims += 1;
            }
            taken.push(work_row(row, dead));
        }
        for slot in mine {
            if let Some(row) = state.claims.get(&slot) {
                taken.push(work_row(row, false));
            }
        }
        taken.sort_by_key(|work| (work.lease_expires_at, work.id));
        Ok(taken)
    }
}

/// What a re-drive answers of `row`: the work and its token while it is
/// held, the dead letter once it is one.
fn work_row(row: &Row, dead: bool) -> WorkRow {
    WorkRow {
        id: row.record.id,
        organization_id: row.record.organization_id,
        scope: row.record.scope.clone(),
        key: row.record.key.clone(),
        request_hash: row.record.request_hash.clone(),
        status: row.record.status,
        lease_token: row.record.lease_token.filter(|_| !dead),
        request: row.request.clone().filter(|_| !dead),
        attempt: row.reclaims + 1,
        claimed_at: row.record.claimed_at,
        lease_expires_at: row.record.lease_expires_at,
        retain_until: row.record.retain_until,
        response: row.record.response.clone().filter(|_| dead),
        traceparent: None,
    }
}

fn v1_call<'a>(request: &ClaimRequest<'a>) -> ClaimCall<'a> {
    ClaimCall {
        organization_id: request.organization_id,
        scope: request.scope,
        key: request.key,
        request_hash: request.request_hash,
        lease_token: request.lease_token,
        lease: request.lease,
        request: None,
    }
}

impl ExpiredClaims for MemoryRepository {
    fn max_bound(&self) -> u64 {
        MAX_BOUND
    }

    async fn expired(&self, bound: u64) -> Result<Vec<ExpiredClaim>, Error> {
        if bound > MAX_BOUND {
            return Err(ClientError::BoundAboveCap { bound, cap: MAX_BOUND }.into());
        }
        let state = self.lock();
        let now = state.now();
        let mut expired: Vec<ExpiredClaim> = state
            .claims
            .values()
            .filter(|row| row.record.retain_until < now)
            .map(|row| ExpiredClaim { id: row.record.id, retain_until: row.record.retain_until })
            .collect();
        expired.sort_by_key(|claim| (claim.retain_until, claim.id));
        expired.truncate(usize::try_from(bound).unwrap_or(usize::MAX));
        Ok(expired)
    }

    async fn retire_expired(&self, ids: &[Uuid]) -> Result<Retired, Error> {
        let mut state = self.lock();
        let now = state.now();
        let mut retired = Retired::default();
        let expired: Vec<_> = state
            .claims
            .iter()
            .filter(|(_, row)| ids.contains(&row.record.id) && row.record.retain_until < now)
            .map(|(slot, _)| slot.clone())
            .collect();
        for slot in expired {
            let retain = state.policy(&slot.1).map(|policy| policy.retain);
            let Some(row) = state.claims.get_mut(&slot) else { continue };
            if row.record.status == ClaimStatus::Processing && row.request.is_some() {
                row.record.status = ClaimStatus::Completed;
                row.record.response = Some(serde_json::json!({
                    "ok": false, "error": "swept_unredriven", "output": {"attempts": row.reclaims + 1}
                }));
                row.record.lease_expires_at = row.record.lease_expires_at.min(now);
                row.record.retain_until = now + retain.unwrap_or(TimeDelta::days(1));
                retired.dead_lettered += 1;
            } else {
                state.claims.remove(&slot);
                retired.deleted += 1;
            }
        }
        Ok(retired)
    }
}
