//! Run admission: `agent.runs` and its unique start key, never the
//! idempotency table. A Run's effect is a row we own, so inserting it is its
//! claim.

use uuid::Uuid;

use crate::error::{Error, InvalidInput};
use crate::postgrest::PostgrestClient;
use crate::repo::{PostgrestRepository, RunRepository};
use crate::service::validate_key;

pub use crate::repo::AdmittedRun;

/// Admits Runs once per `(organization, start key)`.
#[derive(Debug, Clone)]
pub struct RunAdmission<R = PostgrestRepository> {
    repo: R,
}

impl RunAdmission<PostgrestRepository> {
    /// Admission through PostgREST, over `client`.
    pub fn new(client: PostgrestClient) -> Self {
        RunAdmission { repo: PostgrestRepository::new(client) }
    }
}

impl<R: RunRepository> RunAdmission<R> {
    /// Admission over any [`RunRepository`].
    pub fn over(repo: R) -> Self {
        RunAdmission { repo }
    }

    /// Admits the Run `start_key` names, or answers the one already admitted
    /// under it (`admitted = false`, with its original input).
    ///
    /// A direct capability or generic definition start calls this alone: it
    /// writes no claim. Each call mints a fresh admission token and carries
    /// it across its retries, so a retry after a lost answer is recognized
    /// as the call that inserted the Run and still answers `admitted = true`;
    /// any other caller gets `false`.
    pub async fn admit(
        &self,
        organization_id: Uuid,
        start_key: &str,
        input: &serde_json::Value,
    ) -> Result<AdmittedRun, Error> {
        validate_key(start_key)?;
        if input.is_null() {
            return Err(InvalidInput::MissingRunInput.into());
        }
        let run = self.repo.admit(organization_id, start_key, input, Uuid::new_v4()).await?;
        tracing::info!(
            %organization_id, start_key, run_id = %run.id, admitted = run.admitted,
            "run admission"
        );
        Ok(run)
    }
}
