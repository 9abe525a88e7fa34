//! Request hashes: lowercase hex SHA-256, over canonical JSON or raw bytes.

use std::fmt;
use std::str::FromStr;

use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::error::InvalidInput;

/// A request's fingerprint. The same key with a different hash is a conflict.
///
/// Always 64 lowercase hex digits; the only ways to get one are hashing or
/// parsing a well-formed string.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct RequestHash(String);

impl RequestHash {
    /// SHA-256 of `value`'s canonical JSON: object keys sorted at every depth,
    /// no whitespace. Two requests that differ only in key order hash equal.
    pub fn of_json(value: &Value) -> Self {
        let mut hasher = Sha256::new();
        write_canonical(value, &mut hasher);
        RequestHash(hex::encode(hasher.finalize()))
    }

    /// SHA-256 of raw bytes, e.g. a webhook body exactly as delivered.
    pub fn of_bytes(bytes: &[u8]) -> Self {
        RequestHash(hex::encode(Sha256::digest(bytes)))
    }

    /// The hash as 64 lowercase hex digits.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for RequestHash {
    type Err = InvalidInput;

    /// Accepts exactly 64 lowercase hex digits, as the table's check does.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let well_formed = s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        if well_formed {
            Ok(RequestHash(s.to_owned()))
        } else {
            Err(InvalidInput::MalformedHash { value: s.chars().take(80).collect() })
        }
    }
}

impl fmt::Debug for RequestHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RequestHash({})", self.0)
    }
}

impl fmt::Display for RequestHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Feeds the canonical encoding into `out` without building it as one string.
fn write_canonical(value: &Value, out: &mut Sha256) {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            out.update(b"{");
            for (i, (key, value)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.update(b",");
                }
                write_scalar(&Value::String(key.clone()), out);
                out.update(b":");
                write_canonical(value, out);
            }
            out.update(b"}");
        }
        Value::Array(items) => {
            out.update(b"[");
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.update(b",");
                }
                write_canonical(item, out);
            }
            out.update(b"]");
        }
        scalar => write_scalar(scalar, out),
    }
}

fn write_scalar(value: &Value, out: &mut Sha256) {
    // serde_json writes scalars one canonical way (strings escaped, numbers
    // as parsed); only objects and arrays need our ordering.
    out.update(value.to_string().as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn key_order_does_not_change_the_hash() {
        let a: Value = serde_json::from_str(r#"{"to":"a@b.c","body":{"x":1,"y":[1,{"q":2,"p":3}]}}"#).unwrap();
        let b: Value = serde_json::from_str(r#"{"body":{"y":[1,{"p":3,"q":2}],"x":1},"to":"a@b.c"}"#).unwrap();
        assert_eq!(RequestHash::of_json(&a), RequestHash::of_json(&b));
    }

    #[test]
    fn different_content_changes_the_hash() {
        let a = RequestHash::of_json(&json!({"to": "a@b.c"}));
        assert_ne!(a, RequestHash::of_json(&json!({"to": "a@b.d"})));
        assert_ne!(a, RequestHash::of_json(&json!([{"to": "a@b.c"}])));
        // Array order is content.
        assert_ne!(RequestHash::of_json(&json!([1, 2])), RequestHash::of_json(&json!([2, 1])));
    }

    #[test]
    fn canonical_encoding_is_pinned() {
        // sha256('{"a":1,"b":[true,null,"x"]}')
        let expected = hex::encode(Sha256::digest(br#"{"a":1,"b":[true,null,"x"]}"#));
        assert_eq!(RequestHash::of_json(&json!({"b": [true, null, "x"], "a": 1})).as_str(), expected);
    }

    #[test]
    fn parse_accepts_only_lowercase_sha256_hex() {
        let good = "a".repeat(64);
        assert_eq!(good.parse::<RequestHash>().unwrap().as_str(), good);
        for bad in ["", "abc", &"A".repeat(64), &"g".repeat(64), &"a".repeat(63), &"a".repeat(65)] {
            assert!(matches!(bad.parse::<RequestHash>(), Err(InvalidInput::MalformedHash { .. })), "{bad}");
        }
    }
}
