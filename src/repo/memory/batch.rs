//! Batches in memory: `agent.idempotency_claim_many`, `_complete_many` and
//! `_release_many`, the in-memory twins. One lock covers a whole batch, and
//! a refusal of any item puts every row back as it was: a batch is one
//! transaction, as in the plane.

use uuid::Uuid;

use super::claims::key_arguments_well_formed;
use super::{MemoryRepository, State, MAX_BOUND};
use crate::error::Error;
use crate::postgrest::{codes, ClientError, PostgrestError};
use crate::repo::{BatchClaims, ClaimCall, ClaimFence, ClaimManyCall, ClaimRow, CompletionItem, IdempotencyRecord};

/// `error` for the item at `index`, named in its message as the plane names
/// it (`p_items[3]: …`).
fn at_item(error: Error, index: usize) -> Error {
    match error {
        Error::Store(ClientError::Api { function, status, mut error, retry_after }) => {
            error.message = format!("p_items[{index}]: {}", error.message);
            Error::Store(ClientError::Api { function, status, error, retry_after })
        }
        other => other,
    }
}

/// The plane's refusal (22023) of the batch's argument `what`.
fn malformed(function: &'static str, what: String) -> Error {
    Error::Store(ClientError::Api {
        function,
        status: 400,
        error: Box::new(PostgrestError {
            code: codes::INVALID_PARAMETER_VALUE.to_owned(),
            message: format!("{what} (refused by the in-memory plane)"),
            details: None,
            hint: None,
        }),
        retry_after: None,
    })
}

fn check_count(count: usize) -> Result<(), Error> {
    let count = count as u64;
    if count > MAX_BOUND {
        return Err(ClientError::BoundAboveCap { bound: count, cap: MAX_BOUND }.into());
    }
    Ok(())
}

impl State {
    /// Runs `batch` over this state; when it fails, every row is put back.
    fn atomically<T>(&mut self, batch: impl FnOnce(&mut State) -> Result<T, Error>) -> Result<T, Error> {
        let before = self.claims.clone();
        let answer = batch(self);
        if answer.is_err() {
            self.claims = before;
        }
        answer
    }
}

impl BatchClaims for MemoryRepository {
    fn max_batch(&self) -> u64 {
        MAX_BOUND
    }

    async fn claim_many(&self, call: &ClaimManyCall<'_>) -> Result<Vec<ClaimRow>, Error> {
        const FUNCTION: &str = "idempotency_claim_many";
        if call.items.is_empty() {
            return Ok(Vec::new());
        }
        check_count(call.items.len())?;
        for (index, item) in call.items.iter().enumerate() {
            if let Some(earlier) = call.items[..index].iter().position(|other| other.lease_token == item.lease_token) {
                return Err(malformed(
                    FUNCTION,
                    format!("p_items[{index}].lease_token repeats p_items[{earlier}].lease_token"),
                ));
            }
        }
        if !key_arguments_well_formed(call.scope, "k") || !(1000..=86_400_000).contains(&call.lease.as_millis()) {
            return Err(malformed(FUNCTION, format!("p_scope {:?} or p_lease_ms {:?}", call.scope, call.lease)));
        }
        let mut state = self.lock();
        if state.policy(call.scope).is_none() {
            return Err(Error::UnknownScope { scope: call.scope.to_owned() });
        }
        state.atomically(|state| {
            let mut rows = Vec::with_capacity(call.items.len());
            for (index, item) in call.items.iter().enumerate() {
                let single = ClaimCall {
                    organization_id: call.organization_id,
                    scope: call.scope,
                    key: item.key,
                    request_hash: item.request_hash,
                    lease_token: item.lease_token,
                    lease: call.lease,
                    request: item.request,
                };
                let row = state.decide(FUNCTION, &single, None, true, true).map_err(|error| at_item(error, index))?;
                rows.push(row.ok_or_else(|| Error::Inconsistent("the in-memory claim decided nothing".into()))?);
            }
            Ok(rows)
        })
    }

    async fn complete_many(
        &self,
        organization_id: Uuid,
        items: &[CompletionItem<'_>],
    ) -> Result<Vec<Option<IdempotencyRecord>>, Error> {
        check_count(items.len())?;
        self.lock().atomically(|state| {
            let complete = |(index, item): (usize, &CompletionItem<'_>)| {
                let fence = item.fence;
                state
                    .complete(organization_id, fence.claim_id, fence.lease_token, item.completion)
                    .map_err(|error| at_item(error, index))
            };
            items.iter().enumerate().map(complete).collect()
        })
    }

    async fn release_many(&self, organization_id: Uuid, items: &[ClaimFence]) -> Result<Vec<bool>, Error> {
        check_count(items.len())?;
        let mut state = self.lock();
        Ok(items.iter().map(|fence| state.release(organization_id, fence.claim_id, fence.lease_token)).collect())
    }
}
