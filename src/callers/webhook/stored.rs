//! A delivery's body as its claim stores it, so that a re-drive hands the
//! next worker the very bytes the vendor sent (and signed), and the body
//! limit that guarantees every body the gate reads can be stored.
//!
//! JSON cannot hold every byte string, and `jsonb` cannot hold U+0000, so
//! the body is wrapped, losslessly: `{"body_text": "…"}` for UTF-8 without
//! U+0000 whose JSON text is no longer than its base64 would be,
//! `{"body_base64": "…"}` for anything else. The same keys and the same
//! choice as the TypeScript gate's, so either can re-drive what the other
//! stored.
//!
//! **One body limit.** The plane counts a claim's work as compact JSON
//! against its scope's `max_request_bytes` (`IDEM5` above it). Choosing the
//! shorter form bounds what a body of `n` bytes takes, whatever its bytes:
//! at most its base64 and the wrapper, `4 × ⌈n / 3⌉ + 18` bytes
//! ([`stored_body_bound`]). So a gate whose body limit is `L` stores every
//! body it reads exactly when its scope keeps at least
//! `stored_body_bound(L)` bytes, and a scope keeping `M` bytes stores every
//! body of up to [`largest_storable_body`]`(M)` bytes. The defaults are
//! [`DEFAULT_WEBHOOK_BODY_LIMIT`] (256 KiB) and
//! [`WEBHOOK_SCOPE_MAX_REQUEST_BYTES`] (384 KiB, the `webhook.*` scope the
//! plane ships), which the TypeScript gate shares through
//! `supabase/functions/_shared/idempotency/webhook_limits.json`.

use base64::Engine;
use serde_json::{json, Value};

/// The largest body a webhook gate reads unless told otherwise: 256 KiB
/// (262,144 bytes). Vendors' event payloads are typically a few KiB (Slack,
/// Stripe, those sent through Svix); this leaves a large one room many times
/// over, and every body up to it fits the `webhook.*` scope's
/// [`WEBHOOK_SCOPE_MAX_REQUEST_BYTES`], so none is refused for good by the
/// store after the gate accepted it. A sender whose events can be larger
/// (GitHub's reach 25 MB, Nylas's 1 MB) needs both raised together: the
/// gate's limit ([`WebhookGate::with_body_limit`](super::WebhookGate::with_body_limit))
/// and the scope's `max_request_bytes` (at least [`stored_body_bound`] of it,
/// in a migration); `idem doctor` checks the two agree.
pub const DEFAULT_WEBHOOK_BODY_LIMIT: usize = 256 * 1024;

/// The environment variable that names a deployment's webhook body limit,
/// in bytes: the example handlers (`examples/webhook_gate.rs`, the
/// `webhooks` Edge Function) take it as their gate's limit, and `idem
/// doctor` checks the webhook scopes' policies against it.
pub const WEBHOOK_BODY_LIMIT_VAR: &str = "IDEM_WEBHOOK_BODY_LIMIT_BYTES";

/// The environment variable that names the scope (or family) a deployment's
/// webhook handler claims under, for `idem doctor` (default `webhook.*`).
pub const WEBHOOK_SCOPE_VAR: &str = "IDEM_WEBHOOK_SCOPE";

/// The `max_request_bytes` of the `webhook.*` scope the plane ships:
/// 384 KiB (393,216 bytes), enough for any body up to
/// [`DEFAULT_WEBHOOK_BODY_LIMIT`] as its claim stores it (at most 349,546
/// bytes).
pub const WEBHOOK_SCOPE_MAX_REQUEST_BYTES: u64 = 384 * 1024;

/// The bytes `{"body_base64":""}` adds to a body's base64.
const BASE64_WRAPPER_BYTES: u64 = 18;

/// The bytes `{"body_text":""}` adds to a body's escaped text.
const TEXT_WRAPPER_BYTES: u64 = 16;

/// The most bytes a body of `body_bytes` bytes takes as its claim stores it,
/// counted as the plane counts work (compact JSON): its base64 and the
/// wrapper, `4 × ⌈n / 3⌉ + 18`. The text form is used only when it is no
/// longer.
pub const fn stored_body_bound(body_bytes: u64) -> u64 {
    4 * body_bytes.div_ceil(3) + BASE64_WRAPPER_BYTES
}

/// The largest body every one of whose byte strings a scope keeping
/// `max_request_bytes` of work stores: the largest `n` whose
/// [`stored_body_bound`] is within it, `3 × ⌊(max_request_bytes − 18) / 4⌋`
/// (49,137 bytes for 64 KiB, 294,897 for 384 KiB).
pub const fn largest_storable_body(max_request_bytes: u64) -> u64 {
    3 * (max_request_bytes.saturating_sub(BASE64_WRAPPER_BYTES) / 4)
}

/// The body as the claim stores it: the text form when the body is UTF-8
/// without U+0000 and that form is no longer than the base64 one.
pub(super) fn stored_body(body: &[u8]) -> Value {
    match std::str::from_utf8(body) {
        Ok(text) if !text.contains('\0') && text_stored_bytes(body) <= stored_body_bound(body.len() as u64) => {
            json!({ "body_text": text })
        }
        _ => json!({ "body_base64": base64::engine::general_purpose::STANDARD.encode(body) }),
    }
}

/// The bytes `{"body_text": …}` of a UTF-8 `body` takes as compact JSON, as
/// PostgreSQL writes `jsonb` (and serde_json, and `JSON.stringify`): `"`
/// and `\` and the control characters with a short escape take two bytes,
/// the other control characters six (`\u001f`), every other byte one.
fn text_stored_bytes(body: &[u8]) -> u64 {
    let escaped: u64 = body
        .iter()
        .map(|byte| match byte {
            b'"' | b'\\' | 0x08 | 0x0c | b'\n' | b'\r' | b'\t' => 2,
            0x00..=0x1f => 6,
            _ => 1,
        })
        .sum();
    escaped + TEXT_WRAPPER_BYTES
}

/// The bytes a stored body holds; `None` for anything this gate (or the
/// TypeScript one) did not store.
pub(super) fn body_of(stored: &Value) -> Option<Vec<u8>> {
    let members = stored.as_object().filter(|members| members.len() == 1)?;
    match (members.get("body_text"), members.get("body_base64")) {
        (Some(Value::String(text)), None) => Some(text.clone().into_bytes()),
        (None, Some(Value::String(encoded))) => base64::engine::general_purpose::STANDARD.decode(encoded).ok(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_body_comes_back_byte_for_byte() {
        let bodies: [&[u8]; 5] = [b"{\"id\": \"evt_1\"}", b"", "ünï\u{1F600}".as_bytes(), b"a\0b", &[0xff, 0xfe, 0x00]];
        for body in bodies {
            assert_eq!(body_of(&stored_body(body)).as_deref(), Some(body), "{body:?}");
        }
        assert_eq!(stored_body(b"{\"a\":1}"), json!({"body_text": "{\"a\":1}"}), "text stays readable");
        assert_eq!(body_of(&json!({"id": 1})), None);
        assert_eq!(body_of(&json!({"body_text": "a", "body_base64": ""})), None);
        assert_eq!(body_of(&json!({"body_base64": "***"})), None);
    }

    #[test]
    fn a_body_is_never_stored_larger_than_its_bound_whatever_its_bytes() {
        // Text that escapes to six bytes a byte, or to two; text that does
        // not; bytes that are not text; at every length around a multiple of 3.
        let fills: [&[u8]; 5] = [b"\x01", b"\"", b"\n", b"x", &[0xff]];
        for fill in fills {
            for n in 0..40usize {
                let body = fill.repeat(n);
                let stored = serde_json::to_string(&stored_body(&body)).unwrap();
                assert!(stored.len() as u64 <= stored_body_bound(n as u64), "{n} × {fill:?}: {stored}");
                assert_eq!(body_of(&stored_body(&body)), Some(body));
            }
        }
        // The text form's count is the compact JSON's, byte for byte.
        for body in ["{\"a\": [1, \"\\\\\"]}\n", "tab\there\u{1}\u{1f}", "ünï\u{1F600}\r\n"] {
            let text = serde_json::to_string(&json!({ "body_text": body })).unwrap();
            assert_eq!(text_stored_bytes(body.as_bytes()), text.len() as u64, "{body:?}");
        }
        assert_eq!(stored_body(b"\"\"\"\"\"\""), json!({"body_base64": "IiIiIiIi"}), "escaped text above base64");
        assert_eq!(stored_body(b"\"\"\""), json!({"body_text": "\"\"\""}), "no longer than base64: text");
    }

    #[test]
    fn the_shared_vectors_are_stored_as_both_gates_store_them() {
        let vectors: Value =
            serde_json::from_str(include_str!("../../../tests/vectors/stored_bodies.json")).expect("vectors parse");
        let bodies = vectors["bodies"].as_array().expect("bodies");
        assert!(bodies.len() >= 10);
        for vector in bodies {
            let encoded = vector["body_base64"].as_str().expect("body_base64");
            let body = base64::engine::general_purpose::STANDARD.decode(encoded).expect("base64");
            let stored = stored_body(&body);
            assert_eq!(stored, vector["stored"], "{}", vector["about"]);
            let size = serde_json::to_string(&stored).expect("JSON").len() as u64;
            assert_eq!(Some(size), vector["stored_bytes"].as_u64(), "{}", vector["about"]);
            assert!(size <= stored_body_bound(body.len() as u64), "{}", vector["about"]);
            assert_eq!(body_of(&stored), Some(body));
        }
    }

    #[test]
    fn the_default_limits_agree_and_the_bound_and_its_inverse_meet() {
        assert!(stored_body_bound(DEFAULT_WEBHOOK_BODY_LIMIT as u64) <= WEBHOOK_SCOPE_MAX_REQUEST_BYTES);
        assert_eq!(stored_body_bound(DEFAULT_WEBHOOK_BODY_LIMIT as u64), 349_546);
        assert_eq!(largest_storable_body(65_536), 49_137);
        assert_eq!(largest_storable_body(WEBHOOK_SCOPE_MAX_REQUEST_BYTES), 294_897);
        for limit in [1024u64, 65_536, 65_537, 65_538, 65_539, 393_216, 4_194_304] {
            let largest = largest_storable_body(limit);
            assert!(stored_body_bound(largest) <= limit, "{limit}");
            assert!(stored_body_bound(largest + 1) > limit, "{limit}");
        }
        assert_eq!(largest_storable_body(0), 0);
    }
}
