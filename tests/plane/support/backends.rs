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
use std::sync::Arc;
use std::time::Duration;

use idempotency_plane::repo::{
    BatchClaims, ExpiredClaim, ExpiredClaims, JournaledFailures, OrphanedWork, ProviderJob, ProviderJobRepository,
    RunRepository,
};
use idempotency_plane::{Error, IdempotencyRepository, MemoryRepository};
use uuid::Uuid;

use crate::support::faults::Faulty;

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
                    retain_until = retain_until - $1::interval,
                    redrive_at = redrive_at - $1::interval",
        )
        .bind(format!("{} milliseconds", by.as_millis()))
        .execute(self.db())
        .await
        .expect("move every claim back");
    }
}

/// Every repository trait, as the conformance cases need them.
pub(crate) trait Backend:
    IdempotencyRepository
    + ExpiredClaims
    + OrphanedWork
    + JournaledFailures
    + BatchClaims
    + RunRepository
    + ProviderJobRepository
{
}
impl<
        T: IdempotencyRepository
            + ExpiredClaims
            + OrphanedWork
            + JournaledFailures
            + BatchClaims
            + RunRepository
            + ProviderJobRepository,
    > Backend for T
{
}

/// One store the callers' decision tests run on: handles to it for the
/// services, gates and job directories a case builds, its clock, and a
/// count of its claims.
pub(crate) trait Plane: TimeTravel + Sync {
    /// The claim store; its clones share it.
    type Repo: IdempotencyRepository + OrphanedWork + Clone + Debug + 'static;
    /// The provider-job directory; its clones share it.
    type Jobs: ProviderJobRepository + Clone + Debug + 'static;
    /// A handle to the claim store.
    fn repository(&self) -> Self::Repo;
    /// A handle to the provider-job directory.
    fn jobs(&self) -> Self::Jobs;
    /// Claims held now, completed or not, of every organization.
    fn claims(&self) -> impl Future<Output = u64> + Send;
    /// Up to `bound` claims past their retention, oldest first, as a
    /// sweeper reads them.
    fn expired(&self, bound: u64) -> impl Future<Output = Vec<ExpiredClaim>> + Send;
}

/// The in-memory plane: one claim store behind a [`Faulty`] wrapper with no
/// fault set (its clones share the store, as a database's clients do) and
/// one provider-job directory.
#[derive(Debug, Clone)]
pub(crate) struct OnMemory {
    claims: Faulty<MemoryRepository>,
    jobs: MemoryJobs,
}

impl Default for OnMemory {
    fn default() -> Self {
        OnMemory { claims: Faulty::new(MemoryRepository::new()), jobs: MemoryJobs::default() }
    }
}

/// An in-memory provider-job directory; its clones share it.
#[derive(Debug, Clone, Default)]
pub(crate) struct MemoryJobs(Arc<MemoryRepository>);

impl ProviderJobRepository for MemoryJobs {
    async fn register(&self, organization_id: Uuid, provider: &str, job_id: &str) -> Result<ProviderJob, Error> {
        self.0.register(organization_id, provider, job_id).await
    }

    async fn lookup(&self, provider: &str, job_id: &str) -> Result<Option<ProviderJob>, Error> {
        self.0.lookup(provider, job_id).await
    }
}

impl TimeTravel for OnMemory {
    async fn pass_lease(&self, claim_id: Uuid) {
        self.claims.inner().pass_lease(claim_id);
    }

    async fn age(&self, by: Duration) {
        self.claims.inner().advance(by);
    }
}

impl Plane for OnMemory {
    type Repo = Faulty<MemoryRepository>;
    type Jobs = MemoryJobs;

    fn repository(&self) -> Self::Repo {
        self.claims.clone()
    }

    fn jobs(&self) -> MemoryJobs {
        self.jobs.clone()
    }

    async fn claims(&self) -> u64 {
        self.claims.inner().len() as u64
    }

    async fn expired(&self, bound: u64) -> Vec<ExpiredClaim> {
        self.claims.inner().expired(bound).await.expect("expired claims")
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

    async fn expired(&self, bound: u64) -> Vec<ExpiredClaim> {
        self.repository().expired(bound).await.expect("expired claims")
    }
}
