//! The backends every generic case runs on, and what a case needs of one
//! beyond the repository traits: a way to move its time ([`TimeTravel`]),
//! every repository trait at once ([`Backend`]), and for the callers a
//! shareable handle to one store with a count of its claims ([`Plane`]).
//!
//! The in-memory side ([`OnMemory`]) needs nothing; the stack side is a
//! [`LocalStack`](idempotency_plane::local::LocalStack) and needs feature
//! `local`.

use std::fmt::Debug;
use std::future::Future;
use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

use idempotency_plane::repo::{
    ClaimCall, ClaimRequest, ClaimRow, CompletionArgs, ExpiredClaim, ExpiredClaims, IdempotencyRecord, ProviderJob,
    ProviderJobRepository, RunRepository,
};
use idempotency_plane::{Error, IdempotencyRepository, MemoryRepository};
use uuid::Uuid;

/// Moves time for a backend, the way each can.
pub(crate) trait TimeTravel {
    /// Puts a claim's lease in the past, as if it had passed.
    fn pass_lease(&self, claim_id: Uuid) -> impl Future<Output = ()>;
    /// Puts every claim `by` further in the past.
    fn age(&self, by: Duration) -> impl Future<Output = ()>;
}

impl TimeTravel for MemoryRepository {
    async fn pass_lease(&self, claim_id: Uuid) {
        MemoryRepository::pass_lease(self, claim_id);
    }

    async fn age(&self, by: Duration) {
        self.advance(by);
    }
}

#[cfg(feature = "local")]
impl TimeTravel for idempotency_plane::local::LocalStack {
    async fn pass_lease(&self, claim_id: Uuid) {
        crate::support::harness::pass_lease(self, claim_id).await;
    }

    async fn age(&self, by: Duration) {
        sqlx::query(
            "update agent.idempotency_keys
                set claimed_at = claimed_at - $1::interval,
                    lease_expires_at = lease_expires_at - $1::interval,
                    retain_until = retain_until - $1::interval",
        )
        .bind(format!("{} milliseconds", by.as_millis()))
        .execute(self.db())
        .await
        .expect("move every claim back");
    }
}

/// Every repository trait, as the conformance cases need them.
pub(crate) trait Backend: IdempotencyRepository + ExpiredClaims + RunRepository + ProviderJobRepository {}
impl<T: IdempotencyRepository + ExpiredClaims + RunRepository + ProviderJobRepository> Backend for T {}

/// One store the callers' decision tests run on: handles to it for the
/// services, gates and job directories a case builds, its clock, and a
/// count of its claims.
pub(crate) trait Plane: TimeTravel + Sync {
    /// The claim store; its clones share it.
    type Repo: IdempotencyRepository + ExpiredClaims + Clone + Debug + 'static;
    /// The provider-job directory; its clones share it.
    type Jobs: ProviderJobRepository + Clone + Debug + 'static;
    /// A handle to the claim store.
    fn repository(&self) -> Self::Repo;
    /// A handle to the provider-job directory.
    fn jobs(&self) -> Self::Jobs;
    /// Claims held now, completed or not, of every organization.
    fn claims(&self) -> impl Future<Output = u64> + Send;
}

/// The in-memory plane: one [`MemoryRepository`] behind an `Arc`, so
/// services, gates and the test share it.
#[derive(Debug, Clone, Default)]
pub(crate) struct OnMemory(Arc<MemoryRepository>);

impl Deref for OnMemory {
    type Target = MemoryRepository;

    fn deref(&self) -> &MemoryRepository {
        &self.0
    }
}

impl IdempotencyRepository for OnMemory {
    async fn claim(&self, call: &ClaimCall<'_>) -> Result<ClaimRow, Error> {
        self.0.claim(call).await
    }

    async fn try_claim(&self, request: &ClaimRequest<'_>) -> Result<Option<IdempotencyRecord>, Error> {
        self.0.try_claim(request).await
    }

    async fn reclaim(&self, request: &ClaimRequest<'_>) -> Result<Option<IdempotencyRecord>, Error> {
        self.0.reclaim(request).await
    }

    async fn get(&self, organization_id: Uuid, scope: &str, key: &str) -> Result<Option<IdempotencyRecord>, Error> {
        self.0.get(organization_id, scope, key).await
    }

    async fn complete(
        &self,
        claim_id: Uuid,
        lease_token: Uuid,
        completion: CompletionArgs<'_>,
    ) -> Result<Option<IdempotencyRecord>, Error> {
        self.0.complete(claim_id, lease_token, completion).await
    }

    async fn release(&self, claim_id: Uuid, lease_token: Uuid) -> Result<bool, Error> {
        self.0.release(claim_id, lease_token).await
    }
}

impl ProviderJobRepository for OnMemory {
    async fn register(&self, organization_id: Uuid, provider: &str, job_id: &str) -> Result<ProviderJob, Error> {
        self.0.register(organization_id, provider, job_id).await
    }

    async fn lookup(&self, provider: &str, job_id: &str) -> Result<Option<ProviderJob>, Error> {
        self.0.lookup(provider, job_id).await
    }
}

impl ExpiredClaims for OnMemory {
    fn max_bound(&self) -> u64 {
        self.0.max_bound()
    }

    async fn expired(&self, bound: u64) -> Result<Vec<ExpiredClaim>, Error> {
        self.0.expired(bound).await
    }

    async fn delete_expired(&self, ids: &[Uuid]) -> Result<u64, Error> {
        self.0.delete_expired(ids).await
    }
}

impl TimeTravel for OnMemory {
    async fn pass_lease(&self, claim_id: Uuid) {
        MemoryRepository::pass_lease(&self.0, claim_id);
    }

    async fn age(&self, by: Duration) {
        self.0.advance(by);
    }
}

impl Plane for OnMemory {
    type Repo = OnMemory;
    type Jobs = OnMemory;

    fn repository(&self) -> OnMemory {
        self.clone()
    }

    fn jobs(&self) -> OnMemory {
        self.clone()
    }

    async fn claims(&self) -> u64 {
        self.0.len() as u64
    }
}

#[cfg(feature = "local")]
impl Plane for idempotency_plane::local::LocalStack {
    type Repo = idempotency_plane::PostgrestRepository;
    type Jobs = idempotency_plane::PostgrestRepository;

    fn repository(&self) -> Self::Repo {
        idempotency_plane::PostgrestRepository::new(crate::support::harness::client(self))
    }

    fn jobs(&self) -> Self::Jobs {
        self.repository()
    }

    async fn claims(&self) -> u64 {
        crate::support::harness::count_rows(self).await as u64
    }
}
