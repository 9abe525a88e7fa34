//! The plane's queue functions over PostgREST: a take's answer checked for
//! truncation by the count in every row, a settle's and a heartbeat's one
//! row per claim, in input order.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use super::{millis, unknown_scope, PostgrestRepository};
use crate::error::Error;
use crate::postgrest::Repeat;
use crate::repo::surface::{QUEUE_EXTEND, QUEUE_SETTLE, QUEUE_TAKE};
use crate::repo::{PlaneQueues, QueueClaim, QueueEnding, QueueSettled, QueueTakeCall, TakenItem};

/// The arguments of `idempotency_queue_take`; what is not given is
/// omitted, never sent as `null`.
#[derive(Serialize)]
struct TakeArgs<'a> {
    p_queue: &'a str,
    p_dead_letter_queue: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    p_organization_id: Option<Uuid>,
    p_lease_ms: u64,
    p_lease_tokens: &'a [Uuid],
    p_max_reads: i32,
    p_scope: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    p_organizations: Option<&'a [Uuid]>,
    p_row_cap: u64,
    /// The consumer's W3C traceparent, stored with each claim the take
    /// makes (feature `otel`).
    #[serde(skip_serializing_if = "Option::is_none")]
    p_traceparent: Option<String>,
}

/// One claim of `p_items`, with its ending for a settle.
#[derive(Serialize)]
struct ClaimArg<'a> {
    organization_id: Uuid,
    claim_id: Uuid,
    lease_token: Uuid,
    msg_ids: &'a [i64],
    #[serde(skip_serializing_if = "Option::is_none")]
    ending: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    response: Option<&'a Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    resource_type: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    resource_id: Option<&'a str>,
}

impl<'a> ClaimArg<'a> {
    fn of(claim: &QueueClaim<'a>) -> Self {
        ClaimArg {
            organization_id: claim.organization_id,
            claim_id: claim.claim_id,
            lease_token: claim.lease_token,
            msg_ids: claim.msg_ids,
            ending: None,
            response: None,
            resource_type: None,
            resource_id: None,
        }
    }
}

#[derive(Serialize)]
struct SettleArgs<'a> {
    p_queue: &'a str,
    p_dead_letter_queue: &'a str,
    p_items: Vec<ClaimArg<'a>>,
    p_row_cap: u64,
}

#[derive(Serialize)]
struct ExtendArgs<'a> {
    p_queue: &'a str,
    p_lease_ms: u64,
    p_items: Vec<ClaimArg<'a>>,
    p_row_cap: u64,
}

#[derive(Deserialize)]
struct SettleAnswer {
    item: i64,
    #[serde(flatten)]
    settled: QueueSettled,
}

#[derive(Deserialize)]
struct ExtendAnswer {
    item: i64,
    lease_expires_at: Option<DateTime<Utc>>,
}

impl PlaneQueues for PostgrestRepository {
    async fn queue_take(&self, call: &QueueTakeCall<'_>) -> Result<Vec<TakenItem>, Error> {
        let bound = call.lease_tokens.len() as u64;
        if bound == 0 {
            return Ok(Vec::new());
        }
        let args = TakeArgs {
            p_queue: call.queue,
            p_dead_letter_queue: call.dead_letter_queue,
            p_organization_id: call.organization_id,
            p_lease_ms: millis(call.lease),
            p_lease_tokens: call.lease_tokens,
            p_max_reads: call.max_reads,
            p_scope: call.scope,
            p_organizations: call.organizations,
            p_row_cap: self.row_cap(),
            p_traceparent: crate::telemetry::current_traceparent(),
        };
        let taken = |row: &TakenItem| u64::try_from(row.taken).unwrap_or(0);
        let rows =
            self.client.rpc_bounded_write(QUEUE_TAKE.name, &args, bound, taken, Repeat::of(QUEUE_TAKE.name)).await;
        rows.map_err(|error| unknown_scope(error.into(), call.scope))
    }

    async fn queue_settle(
        &self,
        queue: &str,
        dead_letter_queue: &str,
        items: &[(QueueClaim<'_>, QueueEnding<'_>)],
    ) -> Result<Vec<QueueSettled>, Error> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let args = SettleArgs {
            p_queue: queue,
            p_dead_letter_queue: dead_letter_queue,
            p_items: items
                .iter()
                .map(|(claim, ending)| {
                    let mut arg = ClaimArg::of(claim);
                    match ending {
                        QueueEnding::Journal(completion) => {
                            arg.ending = Some("journal");
                            arg.response = completion.response.filter(|response| !response.is_null());
                            arg.resource_type = completion.resource_type;
                            arg.resource_id = completion.resource_id;
                        }
                        QueueEnding::Release => arg.ending = Some("release"),
                        QueueEnding::Leave => arg.ending = Some("leave"),
                    }
                    arg
                })
                .collect(),
            p_row_cap: self.row_cap(),
        };
        let rows = self.batch(QUEUE_SETTLE, &args, items.len() as u64, |row: &SettleAnswer| row.item).await?;
        Ok(rows.into_iter().map(|answer| answer.settled).collect())
    }

    async fn queue_extend(
        &self,
        queue: &str,
        lease: Duration,
        items: &[QueueClaim<'_>],
    ) -> Result<Vec<Option<DateTime<Utc>>>, Error> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let args = ExtendArgs {
            p_queue: queue,
            p_lease_ms: millis(lease),
            p_items: items.iter().map(ClaimArg::of).collect(),
            p_row_cap: self.row_cap(),
        };
        let rows = self.batch(QUEUE_EXTEND, &args, items.len() as u64, |row: &ExtendAnswer| row.item).await?;
        Ok(rows.into_iter().map(|answer| answer.lease_expires_at).collect())
    }
}
