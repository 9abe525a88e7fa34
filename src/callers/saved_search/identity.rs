//! One start's identity and what is derived from it (the Run key, the
//! admission token), and what its claim stores (the snapshot inline, or a
//! reference to the Run that holds it).

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use uuid::Uuid;

use super::error::SavedSearchError;
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

/// The claim key of a start of saved search `saved_search_id` for
/// `trigger_id`: `<bytes of the saved search id>:<saved search id>:<trigger
/// id>`. Length-prefixed, so the saved search id ends where the key says it
/// does, whatever either id holds: ("a:b", "c") and ("a", "b:c") are
/// different keys, and distinct pairs never share one.
pub(super) fn start_key(saved_search_id: &str, trigger_id: &str) -> String {
    format!("{}:{saved_search_id}:{trigger_id}", saved_search_id.len())
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

    /// A start's inputs: `(organization, saved search id, trigger id)`.
    type Inputs = (u8, String, String);

    /// Everything derived from a start's inputs: its claim key, Run key and
    /// admission token.
    fn derived((org, saved_search_id, trigger_id): &Inputs) -> (String, String, Uuid) {
        let org = Uuid::from_u128(u128::from(*org));
        let key = start_key(saved_search_id, trigger_id);
        (key.clone(), run_key(org, &key), admission_token(org, &key).as_uuid())
    }

    /// Asserts that the inputs are equal exactly when each thing derived
    /// from them is: distinct starts never share a claim, a Run or a token.
    fn assert_injective(a: &Inputs, b: &Inputs) {
        let (da, db) = (derived(a), derived(b));
        assert_eq!(a == b, da.0 == db.0, "claim keys of {a:?} and {b:?}: {} and {}", da.0, db.0);
        assert_eq!(a == b, da.1 == db.1, "Run keys of {a:?} and {b:?}");
        assert_eq!(a == b, da.2 == db.2, "admission tokens of {a:?} and {b:?}");
    }

    #[test]
    fn start_keys_keep_where_the_saved_search_id_ends() {
        assert_eq!(start_key("search-1", "tick-1"), "8:search-1:tick-1", "the stored form");
        let cases: [(&str, &str); 12] = [
            ("a:b", "c"),
            ("a", "b:c"),
            ("", "1:a:"),
            ("1:a:", ""),
            ("", ""),
            ("", ":"),
            (":", ""),
            ("1", ":1"),
            ("1:1", ""),
            ("é", "x"),
            ("\u{e9}x", ""),
            ("2:é", "😀"),
        ];
        for (i, a) in cases.iter().enumerate() {
            for b in &cases[i + 1..] {
                let (a, b) = ((0, a.0.to_owned(), a.1.to_owned()), (0, b.0.to_owned(), b.1.to_owned()));
                assert_injective(&a, &b);
            }
        }
    }

    /// Every pair of ids of up to three characters of `a`, `:`, `1` and `é`
    /// (a separator, a digit like the length prefix's, a character of two
    /// bytes, and the empty id), in two organizations: 85 ids, 14,450
    /// starts, as many claim keys (one organization's keys are the other's),
    /// Run keys and tokens.
    #[test]
    fn every_short_start_has_its_own_key_run_key_and_token() {
        const ALPHABET: [char; 4] = ['a', ':', '1', 'é'];
        let mut ids = vec![String::new()];
        let mut longer = vec![String::new()];
        for _ in 0..3 {
            longer = longer.iter().flat_map(|id| ALPHABET.map(|c| format!("{id}{c}"))).collect();
            ids.extend(longer.iter().cloned());
        }
        assert_eq!(ids.len(), 85);
        let ids = &ids;
        let starts: Vec<Inputs> = (0..2)
            .flat_map(|org| ids.iter().flat_map(move |s| ids.iter().map(move |t| (org, s.clone(), t.clone()))))
            .collect();
        let keys: std::collections::HashSet<_> =
            starts.iter().filter(|start| start.0 == 0).map(derived).map(|d| d.0).collect();
        let runs: std::collections::HashSet<_> = starts.iter().map(derived).map(|d| d.1).collect();
        let tokens: std::collections::HashSet<_> = starts.iter().map(derived).map(|d| d.2).collect();
        assert_eq!((keys.len(), runs.len(), tokens.len()), (starts.len() / 2, starts.len(), starts.len()));
    }

    /// An id: of separators, digits, multi-byte characters and `%` (which
    /// collide most readily), or any text at all.
    fn id() -> impl proptest::strategy::Strategy<Value = String> {
        proptest::prop_oneof!["[a:1é😀%]{0,6}", "(?s).{0,10}"]
    }

    proptest::proptest! {
        #[test]
        fn distinct_starts_never_share_a_claim_key_run_key_or_token(
            a in (0u8..2, id(), id()),
            b in (0u8..2, id(), id()),
        ) {
            assert_injective(&a, &b);
        }

        /// The collision a plain separator would make: the `:` moved from
        /// the trigger id into the saved search id, or the other way.
        #[test]
        fn moving_a_separator_between_the_ids_makes_another_key(
            org in 0u8..2,
            (x, y, z) in ("[a:1é]{0,4}", "[a:1é]{0,4}", "[a:1é]{0,4}"),
        ) {
            assert_injective(&(org, format!("{x}:{y}"), z.clone()), &(org, x.clone(), format!("{y}:{z}")));
            assert_injective(&(org, format!("{}:{x}", x.len()), y.clone()), &(org, x, y));
        }
    }

    #[test]
    fn the_admission_token_is_the_starts_own() {
        let org = Uuid::new_v4();
        assert_eq!(admission_token(org, "8:search-1:tick-1"), admission_token(org, "8:search-1:tick-1"));
        assert_ne!(admission_token(org, "8:search-1:tick-1"), admission_token(org, "8:search-1:tick-2"));
        assert_ne!(admission_token(org, "8:search-1:tick-1"), admission_token(Uuid::new_v4(), "8:search-1:tick-1"));
    }
}
