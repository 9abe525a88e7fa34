//! What a caller journals in place of an answer the store cannot hold.
//!
//! A completion the store cannot hold ([`Unstorable`]: a NUL, nesting too
//! deep, a response above the store limit) is refused before any request.
//! But once an effect has happened its claim must be completed, or the next
//! attempt runs the effect again: so the
//! [`EffectDriver`](super::EffectDriver) journals such an answer in a form
//! the store can hold (see [`Answer`](super::Answer)).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::outcome::{ResourceRef, ResponseRef};
// The measures of what the store can hold, also under this module for the
// callers that journal an answer of their own.
pub(crate) use crate::storable::{digest, unstorable, Unstorable};

/// A summary journaled in place of an answer the store cannot hold:
/// `{"$elided": {"reason": "nul", "size": 1234, "sha256": "…"}}`. Size and
/// digest are those of the original as compact JSON, so whoever kept the
/// original elsewhere can match it; both are absent for an answer nested too
/// deep to serialize safely.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Elided {
    /// Why it was elided: [`Unstorable::as_str`].
    pub reason: String,
    /// The original's size in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    /// Lowercase hex SHA-256 of the original.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
}

/// The key under which an [`Elided`] is stored.
const ELIDED_KEY: &str = "$elided";

impl Elided {
    /// The summary of `original`, elided for `reason`.
    pub fn of(original: &Value, reason: Unstorable) -> Self {
        let digest = (reason != Unstorable::TooDeep).then(|| digest(original)).flatten();
        Elided {
            reason: reason.as_str().to_owned(),
            size: digest.as_ref().map(|(size, _)| *size),
            sha256: digest.map(|(_, sha256)| sha256),
        }
    }

    /// The stored form: `{"$elided": {...}}`.
    pub fn to_stored(&self) -> Value {
        serde_json::json!({ ELIDED_KEY: self })
    }

    /// Reads the stored form back; `None` for any other value.
    pub fn from_stored(value: &Value) -> Option<Self> {
        let object = value.as_object().filter(|o| o.len() == 1)?;
        serde_json::from_value(object.get(ELIDED_KEY)?.clone()).ok()
    }
}

/// What journals in place of `original`: a [`ResponseRef`] to `resource`
/// when the only problem is size and there is a resource holding the
/// answer, else an [`Elided`] summary.
pub(crate) fn stand_in(original: &Value, reason: Unstorable, resource: Option<&ResourceRef>) -> Value {
    match (reason, resource, digest(original)) {
        (Unstorable::TooLarge { .. }, Some(resource), Some((size, sha256))) => ResponseRef {
            resource_type: resource.resource_type.clone(),
            resource_id: resource.resource_id.clone(),
            size,
            sha256,
        }
        .to_stored(),
        _ => Elided::of(original, reason).to_stored(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_stand_in_keeps_size_and_digest_and_points_at_the_resource_only_for_size() {
        let original = json!({"text": "a\u{0}b"});
        let (size, sha256) = digest(&original).unwrap();
        let elided = Elided::from_stored(&stand_in(&original, Unstorable::Nul, None)).unwrap();
        assert_eq!(elided, Elided { reason: "nul".into(), size: Some(size), sha256: Some(sha256.clone()) });
        let resource = ResourceRef { resource_type: "blob".into(), resource_id: "b-1".into() };
        let too_large = Unstorable::TooLarge { size, limit: 1 };
        let reference = ResponseRef::from_stored(&stand_in(&original, too_large, Some(&resource))).unwrap();
        assert_eq!((reference.size, reference.sha256), (size, sha256));
        let deep = Elided::of(&json!([[1]]), Unstorable::TooDeep);
        assert_eq!((deep.size, deep.sha256), (None, None));
        assert_eq!(Elided::from_stored(&json!({"$elided": {"reason": "nul"}, "x": 1})), None);
    }
}
