//! Run admission: `agent.runs` and its unique start key, never the
//! idempotency table. A Run's effect is a row we own, so inserting it is its
//! claim.
//!
//! Whoever inserted the Run is told `admitted = true`; anyone else gets the
//! Run already admitted, `admitted = false`, with its original input. Who
//! "inserted" it is the [`AdmissionToken`] the insert carried: a repeat of
//! the same admission passes the same token, and is still the admitter.

use std::fmt;

use uuid::Uuid;

use crate::error::{Error, InvalidInput};
use crate::repo::{ClaimFence, RunRepository};
use crate::service::{validate_key, Claim};

pub use crate::repo::AdmittedRun;

/// The longest `max_run_duration` a Run's definition may set: 30 days, the
/// retention of every tool claim ([`TOOL_RETENTION`](crate::service::TOOL_RETENTION)).
/// A tool claim is the replay journal of the Run that made it, so it must
/// outlive the longest Run; the plane refuses a longer duration (here
/// before any request, and in `agent.run_admit` and on `agent.runs`
/// whoever writes).
pub const MAX_RUN_DURATION: std::time::Duration = crate::service::TOOL_RETENTION;

/// Checks a definition's `max_run_duration`: above zero, at most
/// [`MAX_RUN_DURATION`]. Check it where a definition is accepted; an
/// admission checks it again.
pub fn validate_max_run_duration(duration: std::time::Duration) -> Result<(), InvalidInput> {
    if duration.as_millis() == 0 || duration > MAX_RUN_DURATION {
        return Err(InvalidInput::RunDurationOutOfRange { duration, cap: MAX_RUN_DURATION });
    }
    Ok(())
}

/// Who admits a Run: the Run answers `admitted = true` to every admission
/// carrying the token it was inserted with.
///
/// Pass the same token on every attempt of one logical admission (an
/// orchestrator step and its re-runs, a start and its retries), so an
/// attempt whose answer was lost, beyond the client's own retries, is still
/// recognized as the one that admitted the Run. Two different admitters must
/// never share a token: the token is what tells them apart.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct AdmissionToken(Uuid);

impl AdmissionToken {
    /// A fresh random token: one admission, recognized across its own
    /// retries only ([`RunAdmission::admit`]'s default).
    pub fn random() -> Self {
        AdmissionToken(Uuid::new_v4())
    }

    /// A token derived from the admitter's stable identity (for example the
    /// Run and step ids of an orchestrator step), the same on every re-run:
    /// SHA-256 of a domain tag, the organization and `identity`, as an RFC
    /// 9562 version 8 UUID.
    pub fn derived(organization_id: Uuid, identity: &str) -> Self {
        use sha2::{Digest, Sha256};
        let mut hasher = Sha256::new();
        hasher.update(b"idempotency-plane:run-admission-token:v1\0");
        hasher.update(organization_id.as_bytes());
        hasher.update(identity.as_bytes());
        let digest = hasher.finalize();
        let mut bytes = [0u8; 16];
        bytes.copy_from_slice(&digest[..16]);
        AdmissionToken(uuid::Builder::from_custom_bytes(bytes).into_uuid())
    }

    /// The token as the store keeps it.
    pub fn as_uuid(&self) -> Uuid {
        self.0
    }
}

impl From<Uuid> for AdmissionToken {
    fn from(token: Uuid) -> Self {
        AdmissionToken(token)
    }
}

/// Shown without its value: it is what makes a caller the admitter.
impl fmt::Debug for AdmissionToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AdmissionToken(..)")
    }
}

/// Why a fenced admission admitted nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdmissionError {
    /// The claim named as the fence was not held by its lease token when the
    /// admission was checked (completed, released, another organization's,
    /// or its lease passed and another worker may hold it now): no Run was
    /// admitted by this call, and none is answered. Not retryable with the
    /// same claim; the caller's work is now the new holder's.
    #[error("run {start_key}: claim {claim_id} is no longer held by this worker's lease; no Run admitted")]
    FenceLost {
        /// The start key.
        start_key: String,
        /// The claim that no longer fences the admission.
        claim_id: Uuid,
    },
    /// The plane failed (invalid input, store unreachable, …).
    #[error(transparent)]
    Plane(#[from] Error),
}

impl AdmissionError {
    /// True when the same call may succeed later: a transient store failure.
    pub fn is_retryable(&self) -> bool {
        match self {
            AdmissionError::FenceLost { .. } => false,
            AdmissionError::Plane(error) => error.is_transient(),
        }
    }
}

/// Admits Runs once per `(organization, start key)`.
#[derive(Debug, Clone)]
pub struct RunAdmission<R> {
    repo: R,
}

impl<R: RunRepository> RunAdmission<R> {
    /// Admission through `repo` (the store's `agent.runs`).
    pub fn new(repo: R) -> Self {
        RunAdmission { repo }
    }

    /// Admits the Run `start_key` names, or answers the one already admitted
    /// under it (`admitted = false`, with its original input).
    ///
    /// A direct capability or generic definition start calls this alone: it
    /// writes no claim. Each call mints a fresh [`AdmissionToken`] and
    /// carries it across the client's retries, so a retry after a lost
    /// answer is recognized as the call that inserted the Run and still
    /// answers `admitted = true`; any other call gets `false`, including a
    /// re-run of the same step after the client gave up. A caller that
    /// re-runs (an orchestrator step) passes its own token to
    /// [`admit_as`](Self::admit_as) instead.
    pub async fn admit(
        &self,
        organization_id: Uuid,
        start_key: &str,
        input: &serde_json::Value,
    ) -> Result<AdmittedRun, Error> {
        self.admit_as(organization_id, start_key, input, AdmissionToken::random()).await
    }

    /// [`admit`](Self::admit) as `token`: every admission carrying the token
    /// the Run was inserted with answers `admitted = true`, whichever
    /// attempt inserted it.
    pub async fn admit_as(
        &self,
        organization_id: Uuid,
        start_key: &str,
        input: &serde_json::Value,
        token: AdmissionToken,
    ) -> Result<AdmittedRun, Error> {
        self.admit_inner(organization_id, start_key, input, token, None).await
    }

    /// [`admit_as`](Self::admit_as) for a Run whose definition sets a
    /// `max_run_duration`, kept with the Run. Refused, before any request,
    /// when it is zero or above [`MAX_RUN_DURATION`]
    /// ([`InvalidInput::RunDurationOutOfRange`]); the plane refuses it too.
    /// A Run already admitted under the key keeps the duration it was
    /// admitted with.
    pub async fn admit_with_max_duration(
        &self,
        organization_id: Uuid,
        start_key: &str,
        input: &serde_json::Value,
        token: AdmissionToken,
        max_run_duration: std::time::Duration,
    ) -> Result<AdmittedRun, Error> {
        validate_max_run_duration(max_run_duration)?;
        self.admit_inner(organization_id, start_key, input, token, Some(max_run_duration)).await
    }

    async fn admit_inner(
        &self,
        organization_id: Uuid,
        start_key: &str,
        input: &serde_json::Value,
        token: AdmissionToken,
        max_run_duration: Option<std::time::Duration>,
    ) -> Result<AdmittedRun, Error> {
        check(start_key, input)?;
        let run = self.repo.admit(organization_id, start_key, input, token.as_uuid(), max_run_duration).await?;
        tracing::info!(
            %organization_id, start_key, run_id = %run.id, admitted = run.admitted, fenced = false,
            "run admission"
        );
        Ok(run)
    }

    /// [`admit_as`](Self::admit_as), only while `claim` is still held: its
    /// lease token still holds it, processing, with a live lease by the
    /// store's clock, checked in the same statement as the insert. For a
    /// Run that must be admitted before its claim completes (its input is
    /// the durable copy of what the claim prepared): a worker whose fence
    /// was lost starts no Run ([`AdmissionError::FenceLost`]).
    pub async fn admit_fenced(
        &self,
        organization_id: Uuid,
        start_key: &str,
        input: &serde_json::Value,
        token: AdmissionToken,
        claim: &Claim,
    ) -> Result<AdmittedRun, AdmissionError> {
        check(start_key, input).map_err(Error::from)?;
        let fence = ClaimFence { claim_id: claim.id(), lease_token: claim.lease_token() };
        let admitted = self.repo.admit_fenced(organization_id, start_key, input, token.as_uuid(), fence).await?;
        let Some(run) = admitted else {
            tracing::info!(
                %organization_id, start_key, claim_id = %claim.id(), fenced = true,
                "run admission refused: the claim's fence was lost"
            );
            return Err(AdmissionError::FenceLost { start_key: start_key.to_owned(), claim_id: claim.id() });
        };
        tracing::info!(
            %organization_id, start_key, run_id = %run.id, admitted = run.admitted, fenced = true,
            claim_id = %claim.id(), "run admission"
        );
        Ok(run)
    }

    /// The Run admitted under `start_key`, if any; never writes.
    /// `admitted` is true when `token` is the one it was admitted with.
    pub async fn find(
        &self,
        organization_id: Uuid,
        start_key: &str,
        token: Option<AdmissionToken>,
    ) -> Result<Option<AdmittedRun>, Error> {
        validate_key(start_key)?;
        self.repo.find(organization_id, start_key, token.map(|t| t.as_uuid())).await
    }
}

/// What the store would refuse, before any request.
fn check(start_key: &str, input: &serde_json::Value) -> Result<(), InvalidInput> {
    validate_key(start_key)?;
    if input.is_null() {
        return Err(InvalidInput::MissingRunInput);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_run_duration_is_capped_at_the_tool_retention() {
        let day = std::time::Duration::from_secs(86_400);
        assert_eq!(MAX_RUN_DURATION, day * 30);
        assert!(validate_max_run_duration(day * 30).is_ok());
        assert!(validate_max_run_duration(std::time::Duration::from_millis(1)).is_ok());
        for refused in [
            std::time::Duration::ZERO,
            std::time::Duration::from_micros(999),
            day * 30 + std::time::Duration::from_millis(1),
        ] {
            assert!(
                matches!(validate_max_run_duration(refused), Err(InvalidInput::RunDurationOutOfRange { cap, .. }) if cap == day * 30),
                "{refused:?}"
            );
        }
    }

    #[test]
    fn a_derived_token_is_stable_per_identity_and_organization_and_says_nothing_in_debug() {
        let org = Uuid::new_v4();
        let token = AdmissionToken::derived(org, "run-42:step-7");
        assert_eq!(token, AdmissionToken::derived(org, "run-42:step-7"));
        assert_ne!(token, AdmissionToken::derived(org, "run-42:step-8"));
        assert_ne!(token, AdmissionToken::derived(Uuid::new_v4(), "run-42:step-7"));
        assert_eq!(token.as_uuid().get_version_num(), 8, "an RFC 9562 custom UUID");
        assert_ne!(AdmissionToken::random(), AdmissionToken::random());
        assert_eq!(format!("{token:?}"), "AdmissionToken(..)");
    }
}
