//! One start's identity and what is derived from it (the Run key, the
//! admission token), and what its claim stores (the snapshot inline, or a
//! reference to the Run that holds it).

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use uuid::Uuid;

use super::error::SavedSearchError;
use super::start::Started;
use crate::callers::runs::{AdmissionToken, AdmittedRun};
use crate::service::{journal, ResponseRef};

/// The scope of saved-search input preparation.
pub const SAVED_SEARCH_START_SCOPE: &str = "surface.saved_search.start";

/// The resource a snapshot too large for its claim is kept in: the admitted
/// Run, whose input it is. The claim's `resource_type`, and the type of its
/// [`ResponseRef`].
pub const SNAPSHOT_RESOURCE_TYPE: &str = "agent.run";

/// What the claim stores: the Run key derived from the claim, and either the
/// snapshot itself or, when it is too large for the claim, a reference to
/// the Run that holds it as its input.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Prepared {
    pub(super) run_key: String,
    pub(super) snapshot: Value,
}

impl Prepared {
    pub(super) fn inline(run_key: &str, snapshot: &Value) -> Value {
        json!({ "run_key": run_key, "snapshot": snapshot })
    }
}

/// One start's identity, and what is derived from it.
pub(super) struct Start<'a> {
    pub(super) organization_id: Uuid,
    pub(super) key: &'a str,
    pub(super) run_key: String,
    pub(super) token: AdmissionToken,
}

impl Start<'_> {
    pub(super) fn stored_answer(&self, reason: impl Into<String>) -> SavedSearchError {
        SavedSearchError::StoredAnswer { key: self.key.to_owned(), reason: reason.into() }
    }

    /// Our preparation's fence moved on: another start holds the trigger
    /// now, and its ending is the one that counts. Nothing to do.
    pub(super) fn fence_lost(&self) -> Started {
        tracing::Span::current().record("outcome", "fence_lost");
        tracing::info!("the preparation's lease moved on to another start; this one does nothing more");
        Started::Superseded
    }
}

/// Whether `run` is the Run `reference` names, and the answer it digests
/// (the Run key and the Run's input) is the one the Run holds.
pub(super) fn check_reference(reference: &ResponseRef, run_key: &str, run: &AdmittedRun) -> Result<(), String> {
    if reference.resource_type != SNAPSHOT_RESOURCE_TYPE || reference.resource_id != run.id.to_string() {
        return Err(format!(
            "it references {}/{}, the Run under its key is {SNAPSHOT_RESOURCE_TYPE}/{}",
            reference.resource_type, reference.resource_id, run.id
        ));
    }
    match journal::digest(&Prepared::inline(run_key, &run.input)) {
        Some((size, sha256)) if size == reference.size && sha256 == reference.sha256 => Ok(()),
        _ => Err(format!("the Run {}'s input is not the snapshot it references", run.id)),
    }
}

/// A lease as the database counts it: whole milliseconds, rounded up.
pub(super) fn lease_delta(lease: Duration) -> chrono::TimeDelta {
    let ms = i64::try_from(lease.as_nanos().div_ceil(1_000_000)).unwrap_or(i64::MAX);
    chrono::TimeDelta::milliseconds(ms)
}

/// The Run key of a saved-search start: derived from the claim's identity
/// (organization, scope, key), so every start of the same trigger, before or
/// after the snapshot claim is swept, names the same Run.
pub(super) fn run_key(organization_id: Uuid, key: &str) -> String {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    hasher.update(organization_id.as_bytes());
    hasher.update(SAVED_SEARCH_START_SCOPE.as_bytes());
    hasher.update(b":");
    hasher.update(key.as_bytes());
    format!("saved_search:{}", hex::encode(hasher.finalize()))
}

/// The admission token of a saved-search start: derived from the same
/// identity, so every start of one trigger is the Run's admitter, and
/// anyone else admitting under its key is not.
pub(super) fn admission_token(organization_id: Uuid, key: &str) -> AdmissionToken {
    AdmissionToken::derived(organization_id, &format!("{SAVED_SEARCH_START_SCOPE}:{key}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const THIRTY_S: Duration = Duration::from_secs(30);

    #[test]
    fn the_lease_is_counted_as_the_database_stamps_it() {
        assert_eq!(lease_delta(Duration::from_micros(30_000_001)), chrono::TimeDelta::milliseconds(30_001));
        assert_eq!(lease_delta(THIRTY_S), chrono::TimeDelta::seconds(30));
    }

    #[test]
    fn a_reference_must_name_the_run_and_digest_its_input() {
        let run = AdmittedRun {
            id: Uuid::new_v4(),
            organization_id: Uuid::new_v4(),
            start_key: "saved_search:x".into(),
            input: json!({"brief": "b"}),
            status: "admitted".into(),
            admitted_at: chrono::Utc::now(),
            retain_until: chrono::Utc::now(),
            admitted: true,
        };
        let (size, sha256) = journal::digest(&Prepared::inline("saved_search:x", &run.input)).unwrap();
        let reference = ResponseRef {
            resource_type: SNAPSHOT_RESOURCE_TYPE.into(),
            resource_id: run.id.to_string(),
            size,
            sha256: sha256.clone(),
        };
        assert_eq!(check_reference(&reference, "saved_search:x", &run), Ok(()));
        let other_run = ResponseRef { resource_id: Uuid::new_v4().to_string(), ..reference.clone() };
        assert!(check_reference(&other_run, "saved_search:x", &run).is_err());
        let other_input = ResponseRef { sha256: "0".repeat(64), ..reference.clone() };
        assert!(check_reference(&other_input, "saved_search:x", &run).is_err());
        let other_type = ResponseRef { resource_type: "blob".into(), ..reference.clone() };
        assert!(check_reference(&other_type, "saved_search:x", &run).is_err());
        assert!(check_reference(&reference, "saved_search:y", &run).is_err(), "another Run key");
    }

    #[test]
    fn the_admission_token_is_the_starts_own() {
        let org = Uuid::new_v4();
        assert_eq!(admission_token(org, "8:search-1:tick-1"), admission_token(org, "8:search-1:tick-1"));
        assert_ne!(admission_token(org, "8:search-1:tick-1"), admission_token(org, "8:search-1:tick-2"));
        assert_ne!(admission_token(org, "8:search-1:tick-1"), admission_token(Uuid::new_v4(), "8:search-1:tick-1"));
    }
}
