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
    match value {
        Value::Number(number) => out.update(canonical_number(number).as_bytes()),
        // serde_json writes strings, booleans and null one way.
        other => out.update(other.to_string().as_bytes()),
    }
}

/// A number by its value, whatever its spelling (`1`, `1.0`, `1e0`) and
/// whatever serde_json features the build enables (`arbitrary_precision`
/// keeps the spelling): an integer that fits 64 bits as its digits; any
/// other number as its f64, integral values below 2^53 as integers and the
/// rest as the shortest text that reads back as the same f64.
pub(crate) fn canonical_number(number: &serde_json::Number) -> String {
    if let Some(i) = number.as_i64() {
        return i.to_string();
    }
    if let Some(u) = number.as_u64() {
        return u.to_string();
    }
    match number.as_f64() {
        Some(f) if f.is_finite() && f.fract() == 0.0 && f.abs() < 9_007_199_254_740_992.0 => (f as i64).to_string(),
        Some(f) if f.is_finite() => f.to_string(),
        _ => number.to_string(),
    }
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
    fn numbers_hash_by_value_not_by_spelling() {
        let one: Value = serde_json::from_str(r#"{"n":1}"#).unwrap();
        for spelling in [r#"{"n":1.0}"#, r#"{"n":1e0}"#, r#"{"n":10e-1}"#, r#"{"n":1.00}"#] {
            let same: Value = serde_json::from_str(spelling).unwrap();
            assert_eq!(RequestHash::of_json(&same), RequestHash::of_json(&one), "{spelling}");
        }
        let half: Value = serde_json::from_str(r#"{"n":0.5}"#).unwrap();
        assert_ne!(RequestHash::of_json(&half), RequestHash::of_json(&one));
        // Through text and back, a float keeps its hash.
        let float = json!({"f": 0.1 + 0.2});
        let reparsed: Value = serde_json::from_str(&float.to_string()).unwrap();
        assert_eq!(RequestHash::of_json(&reparsed), RequestHash::of_json(&float));
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
