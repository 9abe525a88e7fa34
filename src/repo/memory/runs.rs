//! Run admission and provider jobs in memory: `agent.run_admit` (fenced
//! too), `agent.run_get`, and `agent.provider_jobs`.

use chrono::TimeDelta;
use uuid::Uuid;

use super::{refused, MemoryRepository, State};
use crate::error::Error;
use crate::postgrest::codes;
use crate::repo::{AdmittedRun, ClaimFence, ClaimStatus, ProviderJob, ProviderJobRepository, RunRepository};

impl State {
    /// `agent.run_admit` after its argument checks (and, fenced, its fence):
    /// the Run inserted, or the one admitted under the key already.
    fn admit(
        &mut self,
        organization_id: Uuid,
        start_key: &str,
        input: &serde_json::Value,
        admission_token: Uuid,
    ) -> AdmittedRun {
        let now = self.now();
        let slot = (organization_id, start_key.to_owned());
        if let Some((run, token)) = self.runs.get(&slot) {
            return AdmittedRun { admitted: *token == admission_token, ..run.clone() };
        }
        let run = AdmittedRun {
            id: Uuid::new_v4(),
            organization_id,
            start_key: start_key.to_owned(),
            input: input.clone(),
            status: "admitted".to_owned(),
            admitted_at: now,
            retain_until: now + TimeDelta::days(396),
            admitted: true,
        };
        self.runs.insert(slot, (run.clone(), admission_token));
        run
    }

    /// Whether `fence` holds a claim of `organization_id`: processing, under
    /// its token, with a live lease.
    fn holds(&self, organization_id: Uuid, fence: ClaimFence) -> bool {
        let now = self.now();
        self.claims.values().any(|row| {
            let record = &row.record;
            record.id == fence.claim_id
                && record.status == ClaimStatus::Processing
                && record.lease_token == Some(fence.lease_token)
                && record.organization_id == organization_id
                && record.lease_expires_at > now
        })
    }
}

/// The arguments `agent.run_admit` and `agent.run_get` refuse (22023).
fn run_arguments_well_formed(start_key: &str, input: Option<&serde_json::Value>) -> bool {
    (1..=512).contains(&start_key.chars().count()) && input.is_none_or(|input| !input.is_null())
}

/// Whether `agent.run_admit` takes a Run's max_run_duration: above zero, at
/// most 30 days (22023 otherwise), whole milliseconds as sent.
fn run_duration_accepted(max_run_duration: Option<std::time::Duration>) -> bool {
    max_run_duration.is_none_or(|duration| {
        let ms = duration.as_millis();
        ms > 0 && ms <= crate::callers::runs::MAX_RUN_DURATION.as_millis()
    })
}

impl RunRepository for MemoryRepository {
    async fn admit(
        &self,
        organization_id: Uuid,
        start_key: &str,
        input: &serde_json::Value,
        admission_token: Uuid,
        max_run_duration: Option<std::time::Duration>,
    ) -> Result<AdmittedRun, Error> {
        if !run_arguments_well_formed(start_key, Some(input)) || !run_duration_accepted(max_run_duration) {
            return Err(refused("run_admit", codes::INVALID_PARAMETER_VALUE));
        }
        Ok(self.lock().admit(organization_id, start_key, input, admission_token))
    }

    async fn admit_fenced(
        &self,
        organization_id: Uuid,
        start_key: &str,
        input: &serde_json::Value,
        admission_token: Uuid,
        fence: ClaimFence,
    ) -> Result<Option<AdmittedRun>, Error> {
        if !run_arguments_well_formed(start_key, Some(input)) {
            return Err(refused("run_admit", codes::INVALID_PARAMETER_VALUE));
        }
        // One lock for the check and the insert, as one SQL statement.
        let mut state = self.lock();
        if !state.holds(organization_id, fence) {
            return Ok(None);
        }
        Ok(Some(state.admit(organization_id, start_key, input, admission_token)))
    }

    async fn find(
        &self,
        organization_id: Uuid,
        start_key: &str,
        admission_token: Option<Uuid>,
    ) -> Result<Option<AdmittedRun>, Error> {
        if !run_arguments_well_formed(start_key, None) {
            return Err(refused("run_get", codes::INVALID_PARAMETER_VALUE));
        }
        let state = self.lock();
        let found = state.runs.get(&(organization_id, start_key.to_owned()));
        Ok(found.map(|(run, token)| AdmittedRun { admitted: Some(*token) == admission_token, ..run.clone() }))
    }
}

impl ProviderJobRepository for MemoryRepository {
    async fn register(&self, organization_id: Uuid, provider: &str, job_id: &str) -> Result<ProviderJob, Error> {
        let mut state = self.lock();
        let job = state.jobs.entry((provider.to_owned(), job_id.to_owned())).or_insert_with(|| ProviderJob {
            id: Uuid::new_v4(),
            organization_id,
            provider: provider.to_owned(),
            job_id: job_id.to_owned(),
        });
        if job.organization_id != organization_id {
            return Err(refused("provider_job_register", codes::UNIQUE_VIOLATION));
        }
        Ok(job.clone())
    }

    async fn lookup(&self, provider: &str, job_id: &str) -> Result<Option<ProviderJob>, Error> {
        Ok(self.lock().jobs.get(&(provider.to_owned(), job_id.to_owned())).cloned())
    }
}
