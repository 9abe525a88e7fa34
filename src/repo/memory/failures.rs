//! Journaled failures in memory: `agent.idempotency_failures` and
//! `agent.idempotency_redrive_failed`, the in-memory twins.

use chrono::{DateTime, Utc};
use serde_json::{json, Value};

use super::claims::in_scope;
use super::{refused, MemoryRepository, Row, MAX_BOUND};
use crate::error::Error;
use crate::postgrest::{codes, ClientError};
use crate::repo::{
    ClaimStatus, FailureRow, FailuresCall, JournaledFailures, Redrivability, RedrivableRow, EVERY_SCOPE,
};

/// How many replaced answers a row keeps for the audit: the first and the
/// latest.
const MAX_REPLACED: usize = 20;

/// Whether `row` is a journaled failure `call` selects.
fn selected(row: &Row, call: &FailuresCall<'_>) -> bool {
    let record = &row.record;
    record.journaled_failure()
        && in_scope(call.scope, &record.scope)
        && call.organization_id.is_none_or(|org| org == record.organization_id)
        && call.since.is_none_or(|since| record.claimed_at >= since)
        && call.claim_ids.is_none_or(|ids| ids.contains(&record.id))
}

/// `row` as a failure row: `response` is the journaled answer (or, for a
/// row sent back, the one it replaced, with its attempts).
fn failure_row(row: &Row, response: Option<Value>, attempts: u32) -> FailureRow {
    let record = &row.record;
    let text = |name: &str| response.as_ref().and_then(|r| r.get(name)).and_then(Value::as_str).map(str::to_owned);
    FailureRow {
        id: record.id,
        organization_id: record.organization_id,
        scope: record.scope.clone(),
        key: record.key.clone(),
        status: record.status,
        error: text("error"),
        resource_type: record.resource_type.clone(),
        resource_id: record.resource_id.clone(),
        response,
        attempts,
        claimed_at: record.claimed_at,
        retain_until: record.retain_until,
        redrivable: row.request.is_some(),
        requeues: u32::try_from(row.replaced.len()).unwrap_or(u32::MAX),
        first_claimed_at: first_claimed_at(row),
        traceparent: None,
    }
}

/// The first send-back's record of the attempt it replaced, else the row's
/// own claim, as the plane answers `first_claimed_at`.
fn first_claimed_at(row: &Row) -> Option<DateTime<Utc>> {
    match row.replaced.first() {
        Some(entry) => entry.get("claimed_at").and_then(|at| serde_json::from_value(at.clone()).ok()),
        None => Some(row.record.claimed_at),
    }
}

impl MemoryRepository {
    /// The checks both functions make, in the plane's order.
    fn check_failures_call(&self, function: &'static str, call: &FailuresCall<'_>) -> Result<(), Error> {
        if call.bound > MAX_BOUND {
            return Err(ClientError::BoundAboveCap { bound: call.bound, cap: MAX_BOUND }.into());
        }
        let state = self.lock();
        if call.scope == EVERY_SCOPE {
            // Every scope: known while the plane has a policy at all.
            if state.policies.is_empty() {
                return Err(Error::UnknownScope { scope: call.scope.to_owned() });
            }
            return Ok(());
        }
        state.check_pattern(function, call.scope)
    }
}

impl JournaledFailures for MemoryRepository {
    fn max_bound(&self) -> u64 {
        MAX_BOUND
    }

    async fn failures(&self, call: &FailuresCall<'_>) -> Result<Vec<FailureRow>, Error> {
        if call.bound == 0 {
            return Ok(Vec::new());
        }
        self.check_failures_call("idempotency_failures", call)?;
        let call = FailuresCall { claim_ids: None, ..*call };
        let state = self.lock();
        let mut failed: Vec<&Row> = state.claims.values().filter(|row| selected(row, &call)).collect();
        failed.sort_by_key(|row| (row.record.claimed_at, row.record.id));
        failed.truncate(usize::try_from(call.bound).unwrap_or(usize::MAX));
        Ok(failed.into_iter().map(|row| failure_row(row, row.record.response.clone(), row.reclaims + 1)).collect())
    }

    async fn redrive_failed(&self, call: &FailuresCall<'_>) -> Result<Vec<FailureRow>, Error> {
        const FUNCTION: &str = "idempotency_redrive_failed";
        if call.bound == 0 {
            return Ok(Vec::new());
        }
        self.check_failures_call(FUNCTION, call)?;
        if call.claim_ids.is_some_and(<[_]>::is_empty) || (call.claim_ids.is_none() && call.since.is_none()) {
            return Err(refused(FUNCTION, codes::INVALID_PARAMETER_VALUE));
        }
        let mut state = self.lock();
        let now = state.now();
        // As the plane: a scope without a policy row, or one that allows no
        // run after the first, sends nothing back.
        let mut chosen: Vec<_> = state
            .claims
            .iter()
            .filter(|(_, row)| row.request.is_some() && selected(row, call))
            .filter_map(|(slot, row)| {
                let retain = state.policy(&slot.1).filter(|p| p.max_attempts > 1)?.retain;
                Some((row.record.claimed_at, row.record.id, slot.clone(), retain))
            })
            .collect();
        chosen.sort_by_key(|(claimed_at, id, _, _)| (*claimed_at, *id));
        chosen.truncate(usize::try_from(call.bound).unwrap_or(usize::MAX));
        let mut sent = Vec::with_capacity(chosen.len());
        for (_, _, slot, retain) in chosen {
            let Some(row) = state.claims.get_mut(&slot) else { continue };
            let record = &mut row.record;
            let replaced = json!({
                "response": record.response,
                "resource_type": record.resource_type,
                "resource_id": record.resource_id,
                "attempts": row.reclaims + 1,
                "claimed_at": record.claimed_at,
                "sent_back_at": now,
            });
            let attempts = row.reclaims + 1;
            let response = record.response.take();
            let resource = (record.resource_type.take(), record.resource_id.take());
            record.status = ClaimStatus::Processing;
            record.lease_token = Some(uuid::Uuid::new_v4());
            record.claimed_at = now;
            record.lease_expires_at = now;
            record.retain_until = record.retain_until.max(now + retain);
            row.reclaims = 0;
            row.replaced.push(replaced);
            // The first (the first failure's) and the latest: the first is
            // what first_claimed_at reads.
            if row.replaced.len() > MAX_REPLACED {
                row.replaced.drain(1..row.replaced.len() - (MAX_REPLACED - 1));
            }
            let mut failure = failure_row(row, response, attempts);
            (failure.resource_type, failure.resource_id) = resource;
            sent.push(failure);
        }
        sent.sort_by_key(|row| row.id);
        Ok(sent)
    }

    async fn redrivable(&self, call: &FailuresCall<'_>) -> Result<Vec<RedrivableRow>, Error> {
        const FUNCTION: &str = "idempotency_redrivable";
        let Some(ids) = call.claim_ids.filter(|ids| !ids.is_empty()) else { return Ok(Vec::new()) };
        let bound = u64::try_from(ids.len()).unwrap_or(u64::MAX);
        if bound > MAX_BOUND {
            return Err(ClientError::BoundAboveCap { bound, cap: MAX_BOUND }.into());
        }
        self.check_failures_call(FUNCTION, &FailuresCall { bound: 1, ..*call })?;
        let state = self.lock();
        let now = state.now();
        let verdict = |row: &Row| {
            let record = &row.record;
            let failed = record.journaled_failure();
            if call.organization_id.is_some_and(|org| org != record.organization_id) {
                Redrivability::OtherOrganization
            } else if !in_scope(call.scope, &record.scope) {
                Redrivability::OtherScope
            } else if record.status == ClaimStatus::Processing && record.lease_expires_at > now {
                Redrivability::InFlight
            } else if record.status == ClaimStatus::Processing {
                Redrivability::Orphaned
            } else if !failed {
                Redrivability::Succeeded
            } else if row.request.is_none() {
                Redrivability::NoWork
            } else if state.policy(&record.scope).is_none_or(|policy| policy.max_attempts <= 1) {
                Redrivability::SingleAttempt
            } else if call.since.is_some_and(|since| record.claimed_at < since) {
                Redrivability::BeforeSince
            } else {
                Redrivability::Redrivable
            }
        };
        Ok(ids
            .iter()
            .map(|id| match state.claims.values().find(|row| row.record.id == *id) {
                None => RedrivableRow {
                    claim_id: *id,
                    organization_id: None,
                    scope: None,
                    key: None,
                    status: None,
                    error: None,
                    attempts: None,
                    claimed_at: None,
                    reason: Redrivability::Absent,
                },
                Some(row) => RedrivableRow {
                    claim_id: *id,
                    organization_id: Some(row.record.organization_id),
                    scope: Some(row.record.scope.clone()),
                    key: Some(row.record.key.clone()),
                    status: Some(row.record.status),
                    error: row
                        .record
                        .response
                        .as_ref()
                        .and_then(|response| response.get("error"))
                        .and_then(Value::as_str)
                        .map(str::to_owned),
                    attempts: Some(row.reclaims + 1),
                    claimed_at: Some(row.record.claimed_at),
                    reason: verdict(row),
                },
            })
            .collect())
    }
}
