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
    /// SHA-256 of `value`'s RFC 8785 canonical form ([`canonical_json`]): the
    /// same hash a JavaScript caller gets from the `canonicalize` npm package
    /// and SHA-256, or a Python caller from a JCS library. Two requests that
    /// differ only in key order or number spelling hash equal.
    pub fn of_json(value: &Value) -> Self {
        RequestHash(hex::encode(Sha256::digest(canonical_json(value).as_bytes())))
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

/// The RFC 8785 (JSON Canonicalization Scheme) form of `value`: no
/// whitespace; object members sorted by their names' UTF-16 code units;
/// strings escaped as ECMAScript's `JSON.stringify` does; every number as
/// the IEEE 754 double it denotes, written as ECMAScript's
/// `Number.prototype.toString` writes it (`1.0` → `1`, `1e21` → `1e+21`,
/// `-0` → `0`). Integers beyond 2^53 therefore lose precision, as they do in
/// every JSON reader that follows I-JSON; a number no double can hold (only
/// possible with serde_json's `arbitrary_precision`) is written as given.
pub fn canonical_json(value: &Value) -> String {
    let mut out = String::new();
    write_canonical(value, &mut out);
    out
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

fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let mut members: Vec<(&String, &Value)> = map.iter().collect();
            members.sort_unstable_by(|a, b| a.0.encode_utf16().cmp(b.0.encode_utf16()));
            out.push('{');
            for (i, (name, member)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_string(name, out);
                out.push(':');
                write_canonical(member, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        Value::String(text) => write_string(text, out),
        Value::Number(number) => out.push_str(&canonical_number(number)),
        Value::Bool(true) => out.push_str("true"),
        Value::Bool(false) => out.push_str("false"),
        Value::Null => out.push_str("null"),
    }
}

/// A string as `JSON.stringify` writes it: `"` and `\` escaped, the
/// controls as `\b \t \n \f \r` or `\u00xx`, everything else as is.
fn write_string(text: &str, out: &mut String) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\u{c}' => out.push_str("\\f"),
            '\r' => out.push_str("\\r"),
            c if c < ' ' => {
                use std::fmt::Write;
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A number as ECMAScript writes the double it denotes.
fn canonical_number(number: &serde_json::Number) -> String {
    match number.as_f64() {
        Some(double) if double.is_finite() => ryu_js::Buffer::new().format_finite(double).to_owned(),
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
