//! Batches: the claim, completion and release decisions for many items in
//! one call, one statement and one round trip.

use std::future::Future;
use std::time::Duration;

use uuid::Uuid;

use super::{ClaimFence, ClaimRow, CompletionArgs, IdempotencyRecord};
use crate::error::Error;

/// One item of a batch claim: what a single claim of it would carry.
#[derive(Debug, Clone, Copy)]
pub struct ClaimItem<'a> {
    /// The idempotency key within the batch's scope.
    pub key: &'a str,
    /// Lowercase hex SHA-256 of the item's request content.
    pub request_hash: &'a str,
    /// The fence for this item alone: a fresh random value per item (the
    /// plane refuses a token two items of one batch name).
    pub lease_token: Uuid,
    /// The work the claim carries, for a re-drive; see
    /// [`ClaimCall::request`](super::ClaimCall::request).
    pub request: Option<&'a serde_json::Value>,
}

/// A batch claim: many keys of one organization and one scope, one lease
/// length.
#[derive(Debug, Clone, Copy)]
pub struct ClaimManyCall<'a> {
    /// The tenant of every item.
    pub organization_id: Uuid,
    /// The scope of every item; one the policy table names.
    pub scope: &'a str,
    /// How long the worker holds each key it wins.
    pub lease: Duration,
    /// The items, at most [`BatchClaims::max_batch`] of them.
    pub items: &'a [ClaimItem<'a>],
}

/// One item of a batch completion: a claim, its fence and what to store.
#[derive(Debug, Clone, Copy)]
pub struct CompletionItem<'a> {
    /// The claim and the token that must still hold it.
    pub fence: ClaimFence,
    /// What the completion stores.
    pub completion: CompletionArgs<'a>,
}

/// The batch decisions: each item decided exactly as its single call would
/// decide it, all in one statement and one round trip, answered one per
/// item in input order.
///
/// A batch is one transaction: a refusal of any item (a malformed
/// argument, a request or response above the scope's limit) refuses the
/// whole batch, with the item's index in the error's message, and writes
/// nothing. A batch of more than [`max_batch`](Self::max_batch) items is
/// refused before any request; an empty batch answers nothing and sends
/// nothing. An answer that does not hold exactly one row per item, in
/// order, is an error, never a short batch.
pub trait BatchClaims: Send + Sync {
    /// The most items one batch may hold: the server's row cap, since a
    /// batch answers a row per item.
    fn max_batch(&self) -> u64;

    /// Claims every item as [`IdempotencyRepository::claim`] would, one
    /// after another in input order: a key repeated in the batch is decided
    /// once, at its first occurrence, and each later occurrence finds it as
    /// the first left it (processing, completed, or a conflict). No two
    /// items ever hold one claim.
    ///
    /// [`IdempotencyRepository::claim`]: super::IdempotencyRepository::claim
    fn claim_many(&self, call: &ClaimManyCall<'_>) -> impl Future<Output = Result<Vec<ClaimRow>, Error>> + Send;

    /// Completes every item as
    /// [`IdempotencyRepository::complete`](super::IdempotencyRepository::complete)
    /// would: `None` for an item whose fence moved on.
    fn complete_many(
        &self,
        organization_id: Uuid,
        items: &[CompletionItem<'_>],
    ) -> impl Future<Output = Result<Vec<Option<IdempotencyRecord>>, Error>> + Send;

    /// Releases every item as
    /// [`IdempotencyRepository::release`](super::IdempotencyRepository::release)
    /// would: `false` for an item whose fence moved on.
    fn release_many(
        &self,
        organization_id: Uuid,
        items: &[ClaimFence],
    ) -> impl Future<Output = Result<Vec<bool>, Error>> + Send;
}
