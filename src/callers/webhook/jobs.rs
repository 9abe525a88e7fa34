//! The `agent.provider_jobs` directory: the jobs this platform started at
//! a provider, by which a callback finds its tenant.

use uuid::Uuid;

use crate::error::Error;
pub use crate::repo::ProviderJob;
use crate::repo::ProviderJobRepository;

/// The `agent.provider_jobs` directory.
#[derive(Debug, Clone)]
pub struct ProviderJobs<J> {
    repo: J,
}

impl<J: ProviderJobRepository> ProviderJobs<J> {
    /// The directory kept by `repo`.
    pub fn new(repo: J) -> Self {
        ProviderJobs { repo }
    }

    /// Records a job this platform started at `provider`. A repeat answers
    /// the stored job; the same job id under another organization is refused.
    pub async fn register(&self, organization_id: Uuid, provider: &str, job_id: &str) -> Result<ProviderJob, Error> {
        self.repo.register(organization_id, provider, job_id).await
    }

    /// The job `provider` knows as `job_id`, if we hold it.
    pub async fn lookup(&self, provider: &str, job_id: &str) -> Result<Option<ProviderJob>, Error> {
        self.repo.lookup(provider, job_id).await
    }
}
