//! What the store answered: checked against the call that asked, and read
//! as what a read finds or how a claim ended.

use super::hash::RequestHash;
use super::outcome::{Claim, ClaimOutcome, ReadOutcome, ResourceRef, ResponseRef};
use crate::error::Error;
use crate::repo::{ClaimCall, ClaimDecision, ClaimRow, ClaimStatus, IdempotencyRecord};
use uuid::Uuid;

/// `record`, if it is the row that was asked for (and, for a claim, holds
/// our token). A store that answers another row is not one to act on.
pub(super) fn checked(
    record: IdempotencyRecord,
    organization_id: Uuid,
    scope: &str,
    key: &str,
    lease_token: Option<Uuid>,
) -> Result<IdempotencyRecord, Error> {
    let same_row = record.organization_id == organization_id && record.scope == scope && record.key == key;
    let same_token = lease_token.is_none_or(|token| record.lease_token == Some(token));
    if same_row && same_token {
        return Ok(record);
    }
    Err(Error::Inconsistent(format!(
        "asked for {organization_id}/{scope}/{key:?}, the store answered {}/{}/{:?}{}",
        record.organization_id,
        record.scope,
        record.key,
        if same_token { "" } else { " with another lease token" }
    )))
}

/// The ending the one-call claim decided, once the service has checked it
/// is an answer to this call: the row asked for, and for a claim our token
/// with a lease that is live by the database clock (a lease already over
/// when handed out would let a second worker reclaim while this one runs).
pub(super) fn decided(row: ClaimRow, call: &ClaimCall<'_>) -> Result<ClaimOutcome, Error> {
    let inconsistent = |what: &str| {
        Err(Error::Inconsistent(format!(
            "asked to claim {}/{}/{:?}, the store answered {}/{}/{:?} {what}",
            call.organization_id, call.scope, call.key, row.organization_id, row.scope, row.key
        )))
    };
    if row.organization_id != call.organization_id || row.scope != call.scope || row.key != call.key {
        return inconsistent("(another row)");
    }
    let ours = row.request_hash.as_deref() == Some(call.request_hash);
    match row.outcome {
        ClaimDecision::Claimed | ClaimDecision::Reclaimed => {
            if !ours || row.lease_token != Some(call.lease_token) || row.status != ClaimStatus::Processing {
                return inconsistent("as claimed, but not under this call's hash and token");
            }
            if !row.lease_live {
                return Err(Error::LeaseLapsed { lease_expires_at: row.lease_expires_at });
            }
            let reclaimed = row.outcome == ClaimDecision::Reclaimed;
            Ok(ClaimOutcome::Claimed(Claim {
                id: row.id,
                organization_id: row.organization_id,
                scope: row.scope,
                key: row.key,
                lease_token: call.lease_token,
                lease_expires_at: row.lease_expires_at,
                retain_until: row.retain_until,
                reclaimed,
                attempt: (!reclaimed).then_some(1),
                origin: row.traceparent,
            }))
        }
        ClaimDecision::Completed if ours && row.status == ClaimStatus::Completed => {
            Ok(Stored::of(row.response, row.resource_type, row.resource_id).into())
        }
        ClaimDecision::Completed => inconsistent("as completed, but not completed under this call's hash"),
        ClaimDecision::Processing if ours => Ok(ClaimOutcome::Processing { lease_expires_at: row.lease_expires_at }),
        ClaimDecision::Processing => inconsistent("as processing, but under another hash"),
        ClaimDecision::Conflict if !ours => Ok(ClaimOutcome::Conflict),
        ClaimDecision::Conflict => inconsistent("as a conflict, but under this call's hash"),
    }
}

/// The answer a completed claim stores.
pub(super) struct Stored {
    pub(super) response: Option<serde_json::Value>,
    pub(super) resource: Option<ResourceRef>,
    pub(super) response_ref: Option<ResponseRef>,
}

impl Stored {
    /// The stored columns as an answer: a [`ResponseRef`] is read back as one.
    pub(super) fn of(
        response: Option<serde_json::Value>,
        resource_type: Option<String>,
        resource_id: Option<String>,
    ) -> Self {
        let response_ref = response.as_ref().and_then(ResponseRef::from_stored);
        Stored {
            response: if response_ref.is_some() { None } else { response },
            resource: match (resource_type, resource_id) {
                (Some(resource_type), Some(resource_id)) => Some(ResourceRef { resource_type, resource_id }),
                _ => None,
            },
            response_ref,
        }
    }
}

impl From<Stored> for ReadOutcome {
    fn from(stored: Stored) -> Self {
        ReadOutcome::Completed {
            response: stored.response,
            resource: stored.resource,
            response_ref: stored.response_ref,
        }
    }
}

impl From<Stored> for ClaimOutcome {
    fn from(stored: Stored) -> Self {
        ClaimOutcome::Completed {
            response: stored.response,
            resource: stored.resource,
            response_ref: stored.response_ref,
        }
    }
}

/// The duplicate semantics of a read, in order: the hash first, whatever the
/// lease says; then completed; then a live lease; else the row's worker is
/// gone, and the journal holds no answer (`claim` reclaims it).
pub(super) fn judge(record: IdempotencyRecord, hash: &RequestHash) -> ReadOutcome {
    if record.request_hash != hash.as_str() {
        return ReadOutcome::Conflict;
    }
    match record.status {
        ClaimStatus::Completed => Stored::of(record.response, record.resource_type, record.resource_id).into(),
        ClaimStatus::Processing if record.lease_live => {
            ReadOutcome::Processing { lease_expires_at: record.lease_expires_at }
        }
        ClaimStatus::Processing => ReadOutcome::Absent,
    }
}
