//! The batch functions over PostgREST: one RPC per batch, its answer
//! checked whole (one row per item, in input order).

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use uuid::Uuid;

use super::{millis, unknown_scope, PostgrestRepository};
use crate::error::Error;
use crate::postgrest::{ClientError, Repeat};
use crate::repo::surface::{SqlFunction, CLAIM_MANY, COMPLETE_MANY, RELEASE_MANY};
use crate::repo::{BatchClaims, ClaimFence, ClaimManyCall, ClaimRow, CompletionItem, IdempotencyRecord};

/// An item as `p_items` carries it. Absent values are left out of the
/// item; inside a JSON argument a `null` would do as well, but leaving them
/// out keeps one rule for every argument.
#[derive(Serialize)]
struct ClaimItemArg<'a> {
    key: &'a str,
    request_hash: &'a str,
    lease_token: Uuid,
    #[serde(skip_serializing_if = "Option::is_none")]
    request: Option<&'a Value>,
    /// The W3C traceparent of the batch's span, with an item that carries
    /// work (feature `otel`).
    #[serde(skip_serializing_if = "Option::is_none")]
    traceparent: Option<&'a str>,
}

#[derive(Serialize)]
struct CompletionItemArg<'a> {
    claim_id: Uuid,
    lease_token: Uuid,
    #[serde(skip_serializing_if = "Option::is_none")]
    resource_type: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    resource_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    response: Option<&'a Value>,
}

#[derive(Serialize)]
struct FenceItemArg {
    claim_id: Uuid,
    lease_token: Uuid,
}

#[derive(Serialize)]
struct ClaimManyArgs<'a, T> {
    p_organization_id: Uuid,
    p_scope: &'a str,
    p_lease_ms: u64,
    p_items: Vec<T>,
    p_row_cap: u64,
}

#[derive(Serialize)]
struct ItemsArgs<T> {
    p_organization_id: Uuid,
    p_items: Vec<T>,
    p_row_cap: u64,
}

#[derive(Deserialize)]
struct ClaimAnswer {
    item: i64,
    #[serde(flatten)]
    row: ClaimRow,
}

/// A completion's answer row: the claim's columns are NULL where the fence
/// moved on, so they are read only when `completed` says they are there.
#[derive(Deserialize)]
struct CompletionAnswer {
    item: i64,
    completed: bool,
    #[serde(flatten)]
    row: Map<String, Value>,
}

#[derive(Deserialize)]
struct ReleaseAnswer {
    item: i64,
    released: bool,
}

impl PostgrestRepository {
    /// Calls the batch `function` for `count` items: refused before any
    /// request above the row cap; an answer of other than `count` rows is
    /// [`ClientError::Truncated`] (fewer) or a decode error (more), and rows
    /// out of input order are [`Error::Inconsistent`].
    pub(super) async fn batch<T: serde::de::DeserializeOwned>(
        &self,
        function: SqlFunction,
        args: &impl Serialize,
        count: u64,
        item: impl Fn(&T) -> i64,
    ) -> Result<Vec<T>, Error> {
        let rows: Vec<T> =
            self.client.rpc_bounded_write(function.name, args, count, |_| count, Repeat::of(function.name)).await?;
        if let Some((index, row)) =
            rows.iter().enumerate().find(|(index, row)| i64::try_from(*index).ok() != Some(item(row)))
        {
            return Err(Error::Inconsistent(format!(
                "{} answered item {} in place {index}: a batch answers its items in input order",
                function.name,
                item(row)
            )));
        }
        Ok(rows)
    }

    pub(super) fn row_cap(&self) -> u64 {
        u64::from(self.client.config().max_rows())
    }
}

/// Claims and completions are repeated after a lost answer (each item
/// answers its caller's own claim to a repeat with the same token); a
/// release is not, as a single release is not.
impl BatchClaims for PostgrestRepository {
    fn max_batch(&self) -> u64 {
        self.row_cap()
    }

    async fn claim_many(&self, call: &ClaimManyCall<'_>) -> Result<Vec<ClaimRow>, Error> {
        if call.items.is_empty() {
            return Ok(Vec::new());
        }
        let traceparent = crate::telemetry::current_traceparent();
        let args = ClaimManyArgs {
            p_organization_id: call.organization_id,
            p_scope: call.scope,
            p_lease_ms: millis(call.lease),
            p_items: call
                .items
                .iter()
                .map(|item| {
                    let request = item.request.filter(|request| !request.is_null());
                    ClaimItemArg {
                        key: item.key,
                        request_hash: item.request_hash,
                        lease_token: item.lease_token,
                        request,
                        traceparent: traceparent.as_deref().filter(|_| request.is_some()),
                    }
                })
                .collect(),
            p_row_cap: self.row_cap(),
        };
        let rows = self.batch(CLAIM_MANY, &args, call.items.len() as u64, |row: &ClaimAnswer| row.item).await;
        let rows = rows.map_err(|error| unknown_scope(error, call.scope))?;
        Ok(rows.into_iter().map(|answer| answer.row).collect())
    }

    async fn complete_many(
        &self,
        organization_id: Uuid,
        items: &[CompletionItem<'_>],
    ) -> Result<Vec<Option<IdempotencyRecord>>, Error> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let args = ItemsArgs {
            p_organization_id: organization_id,
            p_items: items
                .iter()
                .map(|item| CompletionItemArg {
                    claim_id: item.fence.claim_id,
                    lease_token: item.fence.lease_token,
                    resource_type: item.completion.resource_type,
                    resource_id: item.completion.resource_id,
                    response: item.completion.response.filter(|response| !response.is_null()),
                })
                .collect(),
            p_row_cap: self.row_cap(),
        };
        let rows = self.batch(COMPLETE_MANY, &args, items.len() as u64, |row: &CompletionAnswer| row.item).await?;
        rows.into_iter()
            .map(|answer| {
                if !answer.completed {
                    return Ok(None);
                }
                serde_json::from_value(Value::Object(answer.row)).map(Some).map_err(|error| {
                    Error::Store(ClientError::Decode { function: COMPLETE_MANY.name, reason: error.to_string() })
                })
            })
            .collect()
    }

    async fn release_many(&self, organization_id: Uuid, items: &[ClaimFence]) -> Result<Vec<bool>, Error> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let args = ItemsArgs {
            p_organization_id: organization_id,
            p_items: items
                .iter()
                .map(|fence| FenceItemArg { claim_id: fence.claim_id, lease_token: fence.lease_token })
                .collect(),
            p_row_cap: self.row_cap(),
        };
        let rows = self.batch(RELEASE_MANY, &args, items.len() as u64, |row: &ReleaseAnswer| row.item).await?;
        Ok(rows.into_iter().map(|answer| answer.released).collect())
    }
}
