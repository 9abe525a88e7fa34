//! The answer an effect gives, and the one stored form every caller
//! journals it in, so that a replay is indistinguishable from the first
//! answer whatever its size or bytes.
//!
//! The stored form is an envelope, `{"ok": bool, "error": …, "output": …}`,
//! with the effect's resource in the row's own resource columns. PostgreSQL
//! cannot hold U+0000 in `jsonb`, and a reader cannot read back JSON nested
//! deeper than its recursion limit, so a field holding either is stored as
//! its compact JSON text, `{"$json": "<text>"}`: losslessly, and read back
//! as the original (an output nested deeper than serde_json reads, 128
//! levels, replays as that text). Above the store limit the output goes by reference: a
//! [`ResponseRef`] to the effect's resource (with the original's size and
//! SHA-256), or, for an effect that names no resource, an [`Elided`]
//! summary. `ok` is always kept, and so is the error up to
//! [`MAX_STORED_ERROR_BYTES`]: a business failure replays as one.

use serde_json::{json, Map, Value};

use super::journal::{self, Elided};
use super::outcome::{ResourceRef, ResponseRef, RESPONSE_REF_KEY};
use crate::storable::{self, Unstorable};

/// The key of a field stored as its JSON text.
const JSON_TEXT_KEY: &str = "$json";

/// The keys whose single-member objects are read back as stand-ins. An
/// output that happens to have that shape is stored as its text, so it
/// reads back as itself.
const MARKERS: [&str; 3] = [JSON_TEXT_KEY, RESPONSE_REF_KEY, "$elided"];

/// The longest error kept whole when the answer is above the store limit,
/// in bytes; a longer one keeps its first bytes (at a character boundary)
/// and an `error_elided` summary of the whole. An error is meant to be a
/// code (`not_found`), not a body.
pub const MAX_STORED_ERROR_BYTES: usize = 1024;

/// What an effect answered: success or business failure, with its output
/// and the resource it made. Journaled so that a replay equals it.
///
/// Stored as an envelope, `{"ok": bool, "error": …, "output": …}`, with the
/// resource in the row's own columns. A field holding U+0000 (which `jsonb`
/// cannot hold) or nested too deep is stored as its JSON text,
/// `{"$json": "…"}`, and read back as itself. Above the store limit the
/// output goes by reference to the resource (a [`ResponseRef`]), or as an
/// [`Elided`] summary without one, and an error longer than
/// [`MAX_STORED_ERROR_BYTES`] keeps its start: `ok` always survives, so a
/// business failure replays as one.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Answer {
    /// True on success.
    pub ok: bool,
    /// A machine-readable failure (`not_found`, `invalid_input`, …).
    pub error: Option<String>,
    /// What the effect returned.
    pub output: Value,
    /// The resource the effect made, stored beside the answer.
    pub resource: Option<ResourceRef>,
}

impl Answer {
    /// A success with `output`.
    pub fn success(output: Value) -> Self {
        Answer { ok: true, error: None, output, resource: None }
    }

    /// A business failure: an answer repeating the effect would give again.
    pub fn failure(error: impl Into<String>, output: Value) -> Self {
        Answer { ok: false, error: Some(error.into()), output, resource: None }
    }

    /// Names the resource the effect made.
    pub fn with_resource(mut self, resource: Option<ResourceRef>) -> Self {
        self.resource = resource;
        self
    }

    /// Reads a stored answer back. A response another client stored in
    /// another shape replays as a success whose output is that response; a
    /// response stored by reference before the envelope existed replays as
    /// its reference.
    pub fn from_stored(
        response: Option<Value>,
        resource: Option<ResourceRef>,
        response_ref: Option<ResponseRef>,
    ) -> Self {
        let response = response.or_else(|| response_ref.map(|r| r.to_stored()));
        let answer = match response {
            None => Answer::success(Value::Null),
            Some(Value::Object(mut members)) if is_envelope(&members) => {
                let ok = members.get("ok").and_then(Value::as_bool).unwrap_or(true);
                let output = members.remove("output").map_or(Value::Null, decode);
                let error = members.remove("error").map(decode).map(|error| match error {
                    Value::String(text) => text,
                    other => other.to_string(),
                });
                Answer { ok, error, output, resource: None }
            }
            Some(other) => Answer::success(other),
        };
        answer.with_resource(resource)
    }
}

/// Whether `members` are an envelope this module stored: a boolean `ok`,
/// and nothing but the envelope's fields.
fn is_envelope(members: &Map<String, Value>) -> bool {
    let known = ["ok", "error", "output", "error_elided"];
    members.get("ok").is_some_and(Value::is_boolean) && members.keys().all(|key| known.contains(&key.as_str()))
}

/// A stored field read back: its text parsed when stored as text.
fn decode(stored: Value) -> Value {
    if let Some(text) = single(&stored, JSON_TEXT_KEY).and_then(Value::as_str) {
        if let Ok(original) = serde_json::from_str(text) {
            return original;
        }
    }
    stored
}

/// The value of `object`'s only member, when that member is `key`.
fn single<'v>(object: &'v Value, key: &str) -> Option<&'v Value> {
    object.as_object().filter(|members| members.len() == 1)?.get(key)
}

/// `value` as the store can hold it and read it back as itself, `enclosing`
/// levels deep: as is, or as its JSON text when it holds U+0000, nests too
/// deep, or has the shape of a stand-in.
fn storable(value: &Value, enclosing: usize) -> Value {
    let looks_like_marker = MARKERS.iter().any(|key| single(value, key).is_some());
    match storable::unstorable(value, enclosing, u64::MAX) {
        None if !looks_like_marker => value.clone(),
        _ => json!({ JSON_TEXT_KEY: as_text(value) }),
    }
}

/// Compact JSON text of `value`, escaping U+0000. Serializing a `Value`
/// cannot fail; one nested too deep for the stack is not built by this
/// crate's readers, which stop at 128 levels.
fn as_text(value: &Value) -> String {
    serde_json::to_string(value).unwrap_or_default()
}

/// How an answer is stored: the response column, and the resource kept.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StoredAnswer {
    pub(crate) response: Value,
    pub(crate) resource: Option<ResourceRef>,
    /// Why a stand-in was stored, if one was.
    pub(crate) stand_in: Option<Unstorable>,
}

/// The stored form of `answer` within `limit` bytes of compact JSON. With
/// `refused`, the database refused the full form once already: the output
/// goes by reference (or summary) whatever its size.
pub(crate) fn store(answer: &Answer, limit: u64, refused: bool) -> StoredAnswer {
    let resource = answer.resource.clone().filter(|resource| match resource.validate() {
        Ok(()) => true,
        Err(refused) => {
            tracing::warn!(%refused, "the effect's resource cannot be stored; journaling the answer without it");
            false
        }
    });
    let mut stand_in = None;
    let error = answer.error.as_deref().map(|error| storable(&Value::String(error.to_owned()), 1));
    let mut envelope = Map::new();
    envelope.insert("ok".into(), Value::Bool(answer.ok));
    if let Some(error) = error {
        envelope.insert("error".into(), error);
    }
    envelope.insert("output".into(), storable(&answer.output, 1));
    let mut stored = Value::Object(envelope);
    // A long error is what makes the answer too large: keep its start first,
    // so the output (the body) stays whole when that is enough.
    if let Some(error) = answer.error.as_deref() {
        let size = storable::json_size(&stored);
        if (refused || size > limit) && shorten_error(&mut stored, error) {
            stand_in = Some(Unstorable::TooLarge { size, limit });
        }
    }
    let reason = if refused {
        Some(Unstorable::Refused)
    } else {
        let size = storable::json_size(&stored);
        (size > limit).then_some(Unstorable::TooLarge { size, limit })
    };
    if let Some(reason) = reason {
        stand_in = Some(reason);
        // A refused answer with a resource goes by reference, like a large one.
        let form = match (reason, &resource) {
            (Unstorable::Refused, Some(_)) => Unstorable::TooLarge { size: storable::json_size(&answer.output), limit },
            (reason, _) => reason,
        };
        stored["output"] = journal::stand_in(&answer.output, form, resource.as_ref());
    }
    // Still above a small limit (a scope that keeps 1 KiB): the error keeps
    // only its first bytes, so `ok` and the reference always fit.
    if let Some(error) = answer.error.as_deref() {
        if storable::json_size(&stored) > limit {
            stored["error"] = Value::String(prefix(error, LAST_RESORT_ERROR_BYTES).replace('\0', "\u{FFFD}"));
            if let Some(members) = stored.as_object_mut() {
                members.remove("error_elided");
            }
            stand_in = stand_in.or(Some(Unstorable::TooLarge { size: storable::json_size(&stored), limit }));
        }
    }
    StoredAnswer { response: stored, resource, stand_in }
}

/// The error kept when even a shortened one does not fit, in bytes.
const LAST_RESORT_ERROR_BYTES: usize = 64;

/// The first `max` bytes of `text`, at a character boundary.
fn prefix(text: &str, max: usize) -> &str {
    let mut end = max.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// The size of `answer`'s stored form before any stand-in, as compact JSON.
pub(crate) fn stored_size(answer: &Answer) -> u64 {
    storable::json_size(&store(answer, u64::MAX, false).response)
}

/// Keeps the first [`MAX_STORED_ERROR_BYTES`] of `error` (at a character
/// boundary), and an `error_elided` summary of the whole; false when the
/// error is short enough to keep whole.
fn shorten_error(stored: &mut Value, error: &str) -> bool {
    if error.len() <= MAX_STORED_ERROR_BYTES && !error.contains('\0') {
        return false;
    }
    let prefix = prefix(error, MAX_STORED_ERROR_BYTES).replace('\0', "\u{FFFD}");
    let whole = Value::String(error.to_owned());
    stored["error"] = Value::String(prefix);
    stored["error_elided"] = Elided::of(&whole, Unstorable::TooLarge { size: 0, limit: 0 }).to_stored();
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(answer: &Answer, limit: u64) -> Answer {
        let stored = store(answer, limit, false);
        assert!(storable::unstorable(&stored.response, 0, limit).is_none(), "{:?}", stored.response);
        Answer::from_stored(Some(stored.response), stored.resource, None)
    }

    fn nested(levels: usize) -> Value {
        (0..levels).fold(json!(1), |inner, _| json!([inner]))
    }

    #[test]
    fn nul_deep_and_marker_shaped_answers_replay_equal() {
        let resource = Some(ResourceRef { resource_type: "t".into(), resource_id: "1".into() });
        for answer in [
            Answer::success(json!({"text": "a\u{0}b", "k\u{0}": 1})),
            Answer::failure("bad\u{0}input", json!(null)),
            Answer::success(nested(100)),
            Answer::success(json!({"$json": "{}"})),
            Answer::success(
                json!({"$response_ref": {"resource_type": "t", "resource_id": "1", "size": 1, "sha256": "a"}}),
            ),
            Answer::success(json!({"$elided": {"reason": "nul"}})),
            Answer::failure("not_found", json!({"id": 7})).with_resource(resource.clone()),
            Answer::success(json!("plain")),
        ] {
            assert_eq!(round_trip(&answer, 64 * 1024), answer);
        }
    }

    /// The TypeScript client journals a string cut inside an emoji (a lone
    /// UTF-16 surrogate, which `jsonb` refuses) as its JSON text. A Rust
    /// `String` cannot hold a lone surrogate, so a Rust replay gets that
    /// text, losslessly, as it gets an output nested too deep to rebuild.
    #[test]
    fn a_lone_surrogate_another_client_journaled_replays_as_its_text() {
        let text = r#""Hello \ud83d""#;
        assert!(serde_json::from_str::<Value>(text).is_err(), "no Rust value holds it");
        let stored = json!({"ok": false, "error": {"$json": text}, "output": {"$json": text}});
        let back = Answer::from_stored(Some(stored), None, None);
        assert_eq!(back.output, json!({"$json": text}));
        assert_eq!(back.error.as_deref(), Some(json!({"$json": text}).to_string().as_str()));
        assert!(!back.ok);
    }

    #[test]
    fn an_output_deeper_than_a_reader_can_rebuild_replays_as_its_text() {
        let deep = nested(200);
        let back = round_trip(&Answer::success(deep.clone()), 64 * 1024);
        assert_eq!(back.output, json!({"$json": serde_json::to_string(&deep).unwrap()}));
    }

    #[test]
    fn above_the_limit_the_output_goes_by_reference_and_ok_and_error_stay() {
        let big = json!("x".repeat(100_000));
        let resource = ResourceRef { resource_type: "blob".into(), resource_id: "b-1".into() };
        let answer = Answer::failure("partial", big.clone()).with_resource(Some(resource.clone()));
        let back = round_trip(&answer, 64 * 1024);
        assert_eq!((back.ok, back.error.as_deref(), &back.resource), (false, Some("partial"), &Some(resource)));
        let reference = ResponseRef::from_stored(&back.output).expect("a reference to the resource");
        assert_eq!(reference.size, storable::json_size(&big));
        // Without a resource: a summary, and still a failure.
        let back = round_trip(&Answer::failure("partial", big), 64 * 1024);
        assert!(!back.ok && back.error.as_deref() == Some("partial"));
        assert!(Elided::from_stored(&back.output).is_some());
    }

    #[test]
    fn an_error_too_large_to_keep_keeps_its_start_and_stays_a_failure() {
        let error = "é".repeat(40_000);
        let back = round_trip(&Answer::failure(error.clone(), json!(null)), 64 * 1024);
        assert!(!back.ok);
        let kept = back.error.expect("an error");
        assert!(error.starts_with(&kept) && kept.len() <= MAX_STORED_ERROR_BYTES && !kept.is_empty());
    }

    #[test]
    fn under_the_smallest_policy_a_failure_with_a_long_error_and_a_long_resource_still_fits_and_stays_a_failure() {
        let resource = ResourceRef { resource_type: "t".repeat(128), resource_id: "i".repeat(512) };
        let answer = Answer::failure("é".repeat(20_000), json!("x".repeat(5_000))).with_resource(Some(resource));
        for refused in [false, true] {
            let stored = store(&answer, 1024, refused);
            assert!(storable::json_size(&stored.response) <= 1024, "{}", stored.response);
            let back = Answer::from_stored(Some(stored.response), stored.resource, None);
            assert!(!back.ok && back.error.is_some_and(|e| !e.is_empty()));
        }
    }

    #[test]
    fn a_refused_answer_keeps_its_resource_and_points_at_it() {
        let resource = ResourceRef { resource_type: "blob".into(), resource_id: "b-1".into() };
        let answer = Answer::success(json!({"small": true})).with_resource(Some(resource.clone()));
        let stored = store(&answer, 64 * 1024, true);
        assert_eq!(stored.resource, Some(resource));
        let back = Answer::from_stored(Some(stored.response), stored.resource, None);
        assert!(back.ok);
        assert!(ResponseRef::from_stored(&back.output).is_some(), "{:?}", back.output);
    }

    #[test]
    fn answers_of_another_shape_replay_as_successes_holding_them() {
        let foreign = Answer::from_stored(Some(json!({"message_id": "m"})), None, None);
        assert_eq!(foreign, Answer::success(json!({"message_id": "m"})));
        let old_ref = ResponseRef { resource_type: "t".into(), resource_id: "1".into(), size: 3, sha256: "ab".into() };
        let replayed = Answer::from_stored(None, None, Some(old_ref.clone()));
        assert_eq!(replayed.output, old_ref.to_stored());
    }
}
