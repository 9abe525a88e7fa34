//! A delivery's body as its claim stores it, so that a re-drive hands the
//! next worker the very bytes the vendor sent (and signed).
//!
//! JSON cannot hold every byte string, and `jsonb` cannot hold U+0000, so
//! the body is wrapped, losslessly: `{"body_text": "…"}` for UTF-8 without
//! U+0000, `{"body_base64": "…"}` for anything else. The same keys as the
//! TypeScript gate's, so either can re-drive what the other stored.

use base64::Engine;
use serde_json::{json, Value};

/// The body as the claim stores it.
pub(super) fn stored_body(body: &[u8]) -> Value {
    match std::str::from_utf8(body) {
        Ok(text) if !text.contains('\0') => json!({ "body_text": text }),
        _ => json!({ "body_base64": base64::engine::general_purpose::STANDARD.encode(body) }),
    }
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
}
