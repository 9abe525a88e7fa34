//! What the service answers: what a read finds, how a claim ended, and what a completion stores.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::error::InvalidInput;

/// A reference to the resource an effect made, e.g. a CRM company or a Nylas
/// message. Its type is required so a reader can tell the two apart.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceRef {
    /// The kind of resource, e.g. `nylas.message`.
    pub resource_type: String,
    /// Its id in the system that owns it.
    pub resource_id: String,
}

impl ResourceRef {
    /// Refuses what the table would: an empty type or id, one longer than
    /// it accepts, or one holding a NUL character.
    pub(crate) fn validate(&self) -> Result<(), InvalidInput> {
        if self.resource_type.is_empty() || self.resource_id.is_empty() {
            return Err(InvalidInput::EmptyResource);
        }
        for (field, value, max) in
            [("type", &self.resource_type, MAX_RESOURCE_TYPE_CHARS), ("id", &self.resource_id, MAX_RESOURCE_ID_CHARS)]
        {
            let chars = value.chars().count();
            if chars > max {
                return Err(InvalidInput::ResourceTooLong { field, chars, max });
            }
            if value.contains('\0') {
                return Err(InvalidInput::ResourceHasNul { field });
            }
        }
        Ok(())
    }
}

/// Where a response too large to store went: the resource that holds it, and
/// its size and digest so a reader can check what it fetches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResponseRef {
    /// The kind of resource holding the response.
    pub resource_type: String,
    /// Its id.
    pub resource_id: String,
    /// The response's size in bytes, as compact JSON.
    pub size: u64,
    /// Lowercase hex SHA-256 of that compact JSON.
    pub sha256: String,
}

/// The key under which a [`ResponseRef`] is stored in place of a response.
pub(crate) const RESPONSE_REF_KEY: &str = "$response_ref";

impl ResponseRef {
    /// The stored form: `{"$response_ref": {...}}`.
    pub(crate) fn to_stored(&self) -> serde_json::Value {
        serde_json::json!({ RESPONSE_REF_KEY: self })
    }

    /// Reads the stored form back; `None` for any other response.
    pub(crate) fn from_stored(value: &serde_json::Value) -> Option<Self> {
        let object = value.as_object().filter(|o| o.len() == 1)?;
        serde_json::from_value(object.get(RESPONSE_REF_KEY)?.clone()).ok()
    }
}

/// What [`read`](super::IdempotencyService::read) finds in the journal,
/// without writing anything.
#[derive(Debug, Clone, PartialEq)]
#[must_use = "a live lease must not be treated as a value, and a conflict is not an answer"]
pub enum ReadOutcome {
    /// The journal holds no answer: no row, or a processing row whose worker
    /// is gone (lease passed). The caller's `claim` will take (or reclaim) it.
    Absent,
    /// The effect already happened: return the stored answer and mark the
    /// span replayed.
    Completed {
        /// The stored response, if one was stored inline.
        response: Option<serde_json::Value>,
        /// The stored resource, if one was stored.
        resource: Option<ResourceRef>,
        /// Set instead of `response` when the response was above the store
        /// limit: the resource that holds it, with its size and digest.
        response_ref: Option<ResponseRef>,
    },
    /// Another worker holds a live lease: the effect may be in flight. Not a
    /// value: an orchestrated caller raises, an HTTP boundary drops.
    Processing {
        /// When that lease passes, by the database clock.
        lease_expires_at: DateTime<Utc>,
    },
    /// The key was used for a request with different content.
    Conflict,
}

impl ReadOutcome {
    /// A short name for logs and metrics: `absent`, `completed`,
    /// `processing`, `conflict`.
    pub fn kind(&self) -> &'static str {
        match self {
            ReadOutcome::Absent => "absent",
            ReadOutcome::Completed { .. } => "completed",
            ReadOutcome::Processing { .. } => "processing",
            ReadOutcome::Conflict => "conflict",
        }
    }
}

/// How [`claim`](super::IdempotencyService::claim) ended: the key is ours,
/// or why not.
#[derive(Debug, Clone, PartialEq)]
#[must_use = "a claim must end in complete() or release(), and a live lease must not be treated as a value"]
pub enum ClaimOutcome {
    /// We own the key (a free one, or one whose worker is gone): run the
    /// effect, then `complete` or `release`.
    Claimed(Claim),
    /// The effect already happened: return the stored answer and mark the
    /// span replayed.
    Completed {
        /// The stored response, if one was stored inline.
        response: Option<serde_json::Value>,
        /// The stored resource, if one was stored.
        resource: Option<ResourceRef>,
        /// Set instead of `response` when the response was above the store
        /// limit: the resource that holds it, with its size and digest.
        response_ref: Option<ResponseRef>,
    },
    /// Another worker holds a live lease: the effect may be in flight. Not a
    /// value: an orchestrated caller raises, an HTTP boundary drops.
    Processing {
        /// When that lease passes, by the database clock.
        lease_expires_at: DateTime<Utc>,
    },
    /// The key was used for a request with different content.
    Conflict,
}

impl ClaimOutcome {
    /// A short name for logs and metrics: `claimed`, `completed`,
    /// `processing`, `conflict`.
    pub fn kind(&self) -> &'static str {
        match self {
            ClaimOutcome::Claimed(_) => "claimed",
            ClaimOutcome::Completed { .. } => "completed",
            ClaimOutcome::Processing { .. } => "processing",
            ClaimOutcome::Conflict => "conflict",
        }
    }
}

/// A key we hold. Carries the fence token `complete` and `release` need; only
/// the service makes one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub(crate) id: Uuid,
    pub(crate) organization_id: Uuid,
    pub(crate) scope: String,
    pub(crate) key: String,
    pub(crate) lease_token: Uuid,
    pub(crate) lease_expires_at: DateTime<Utc>,
    pub(crate) retain_until: DateTime<Utc>,
    pub(crate) reclaimed: bool,
    /// Which attempt at the claim's work this is, when the plane said.
    pub(crate) attempt: Option<u32>,
    /// The W3C traceparent of the worker that first claimed the key, when
    /// the plane stored one.
    pub(crate) origin: Option<String>,
}

impl Claim {
    /// The claim id.
    pub fn id(&self) -> Uuid {
        self.id
    }
    /// The tenant.
    pub fn organization_id(&self) -> Uuid {
        self.organization_id
    }
    /// The scope.
    pub fn scope(&self) -> &str {
        &self.scope
    }
    /// The key. Pass it to the vendor as its idempotency key where supported.
    pub fn key(&self) -> &str {
        &self.key
    }
    /// The fence token this claim carries.
    pub fn lease_token(&self) -> Uuid {
        self.lease_token
    }
    /// When the lease passes, by the database clock. After it, another worker
    /// may reclaim the key and this claim's `complete` becomes a no-op.
    pub fn lease_expires_at(&self) -> DateTime<Utc> {
        self.lease_expires_at
    }
    /// How long the answer will be remembered.
    pub fn retain_until(&self) -> DateTime<Utc> {
        self.retain_until
    }
    /// True when this claim took over a passed lease of a worker that is gone.
    pub fn reclaimed(&self) -> bool {
        self.reclaimed
    }
    /// Which attempt at the claim's work this is: 1 for a fresh claim, 2
    /// for the first re-drive, and so on; `None` when the plane did not say
    /// (a reclaim by a repeated call).
    pub fn attempt(&self) -> Option<u32> {
        self.attempt
    }
    /// The W3C traceparent of the worker that first claimed the key, when
    /// it sent one (feature `otel`): the trace the effect's span links to
    /// when this worker runs the work again.
    pub fn origin_traceparent(&self) -> Option<&str> {
        self.origin.as_deref()
    }
}

/// Longest resource type the table accepts, in characters.
pub const MAX_RESOURCE_TYPE_CHARS: usize = 128;

/// Longest resource id the table accepts, in characters.
pub const MAX_RESOURCE_ID_CHARS: usize = 512;

/// What a completion stores: a response, a resource, or both. Never neither.
///
/// Checked before any request (see [`InvalidInput`]), so a completion the
/// store would refuse fails while the claim is still ours to retry or release.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub(crate) response: Option<serde_json::Value>,
    pub(crate) resource: Option<ResourceRef>,
}

impl Completion {
    /// A completion that stores `response` as the answer to replay.
    pub fn response(response: serde_json::Value) -> Self {
        Completion { response: Some(response), resource: None }
    }

    /// A completion that records the resource the effect made.
    pub fn resource(resource_type: impl Into<String>, resource_id: impl Into<String>) -> Self {
        Completion {
            response: None,
            resource: Some(ResourceRef { resource_type: resource_type.into(), resource_id: resource_id.into() }),
        }
    }

    /// Adds the response to replay.
    pub fn with_response(mut self, response: serde_json::Value) -> Self {
        self.response = Some(response);
        self
    }

    /// Adds the resource the effect made.
    pub fn with_resource(mut self, resource_type: impl Into<String>, resource_id: impl Into<String>) -> Self {
        self.resource = Some(ResourceRef { resource_type: resource_type.into(), resource_id: resource_id.into() });
        self
    }

    /// Refuses what the store would refuse, before any request: a JSON
    /// `null` response counts as none.
    pub(crate) fn validate(&self) -> Result<(), InvalidInput> {
        if let Some(resource) = &self.resource {
            resource.validate()?;
        }
        if let Some(response) = &self.response {
            // A response shaped like a stored reference would replay as one.
            if ResponseRef::from_stored(response).is_some() {
                return Err(InvalidInput::ReservedResponseShape);
            }
            // Size is the service's to judge: it knows the limit, and may
            // store a reference instead.
            if let Some(reason) = crate::storable::unstorable(response, 0, u64::MAX) {
                return Err(InvalidInput::UnstorableResponse(reason));
            }
        }
        let has_response = matches!(&self.response, Some(v) if !v.is_null());
        if !has_response && self.resource.is_none() {
            return Err(InvalidInput::EmptyCompletion);
        }
        Ok(())
    }
}

/// How a `complete` or `release` ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum Ending {
    /// Our token still held the claim, and the ending is recorded.
    Recorded,
    /// The lease moved on: another worker reclaimed the key (or it was
    /// released). Do nothing more: no retry, no error; the key is theirs.
    LeaseMovedOn,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_completion_must_carry_something() {
        assert_eq!(Completion::response(json!(null)).validate(), Err(InvalidInput::EmptyCompletion));
        assert_eq!(Completion::resource("", "x").validate(), Err(InvalidInput::EmptyResource));
        assert_eq!(Completion::resource("t", "").validate(), Err(InvalidInput::EmptyResource));
        assert!(Completion::response(json!({})).validate().is_ok());
        assert!(Completion::resource("t", "1").validate().is_ok());
        assert!(Completion::response(json!(null)).with_resource("t", "1").validate().is_ok());
        assert!(matches!(
            Completion::resource("t".repeat(129), "1").validate(),
            Err(InvalidInput::ResourceTooLong { field: "type", .. })
        ));
        assert!(matches!(
            Completion::resource("t", "1".repeat(513)).validate(),
            Err(InvalidInput::ResourceTooLong { field: "id", .. })
        ));
        assert!(Completion::resource("t".repeat(128), "1".repeat(512)).validate().is_ok());
        assert_eq!(Completion::resource("t", "a\u{0}").validate(), Err(InvalidInput::ResourceHasNul { field: "id" }));
        assert_eq!(
            Completion::response(json!({"text": "a\u{0}b"})).validate(),
            Err(InvalidInput::UnstorableResponse(crate::storable::Unstorable::Nul))
        );
        let deep = (0..=crate::storable::MAX_RESPONSE_DEPTH).fold(json!(1), |inner, _| json!([inner]));
        assert_eq!(
            Completion::response(deep).validate(),
            Err(InvalidInput::UnstorableResponse(crate::storable::Unstorable::TooDeep))
        );
        let spoof = json!({"$response_ref": {"resource_type": "t", "resource_id": "1", "size": 1, "sha256": "a"}});
        assert_eq!(Completion::response(spoof).validate(), Err(InvalidInput::ReservedResponseShape));
        assert!(Completion::response(json!({"$response_ref": 1, "other": 2})).validate().is_ok());
    }

    #[test]
    fn a_response_ref_round_trips_and_nothing_else_reads_as_one() {
        let reference =
            ResponseRef { resource_type: "blob".into(), resource_id: "b-1".into(), size: 9, sha256: "ab".into() };
        assert_eq!(ResponseRef::from_stored(&reference.to_stored()), Some(reference));
        assert_eq!(ResponseRef::from_stored(&json!({"$response_ref": 1})), None);
        assert_eq!(ResponseRef::from_stored(&json!({"other": 1})), None);
    }
}
