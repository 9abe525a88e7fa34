//! Run admission: `agent.runs` and its unique start key, never the
//! idempotency table. A Run's effect is a row we own, so inserting it is its
//! claim.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::error::{Error, InvalidInput};
use crate::postgrest::{PostgrestClient, Repeat};
use crate::service::validate_key;

/// An admitted Run, as `agent.run_admit` answers it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct AdmittedRun {
    /// The Run's id.
    pub id: Uuid,
    /// Its organization.
    pub organization_id: Uuid,
    /// The start key it was admitted under.
    pub start_key: String,
    /// The input it was admitted with (a replay answers this, not its own).
    pub input: serde_json::Value,
    /// Its status.
    pub status: String,
    /// When it was admitted (database clock).
    pub admitted_at: DateTime<Utc>,
    /// How long the Run row is kept (396 days).
    pub retain_until: DateTime<Utc>,
    /// True for the call that inserted it (its retries included); a replay
    /// by anyone else answers false.
    pub admitted: bool,
}

/// Admits Runs once per `(organization, start key)`.
#[derive(Debug, Clone)]
pub struct RunAdmission {
    client: PostgrestClient,
}

#[derive(Serialize)]
struct AdmitArgs<'a> {
    p_organization_id: Uuid,
    p_start_key: &'a str,
    p_input: &'a serde_json::Value,
    p_admission_token: Uuid,
}

impl RunAdmission {
    /// Admission over `client`.
    pub fn new(client: PostgrestClient) -> Self {
        RunAdmission { client }
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
        let args = AdmitArgs {
            p_organization_id: organization_id,
            p_start_key: start_key,
            p_input: input,
            p_admission_token: Uuid::new_v4(),
        };
        let mut rows: Vec<AdmittedRun> = self.client.rpc("run_admit", &args, Repeat::Safe).await?;
        let run = match (rows.pop(), rows.is_empty()) {
            (Some(run), true) => run,
            _ => return Err(Error::Inconsistent("run_admit must answer exactly one row".into())),
        };
        tracing::info!(
            %organization_id, start_key, run_id = %run.id, admitted = run.admitted,
            "run admission"
        );
        Ok(run)
    }
}
