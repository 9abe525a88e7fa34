//! What the store can hold, measured the same way at every layer.
//!
//! PostgreSQL `jsonb` and `text` cannot hold U+0000; a response nested
//! deeper than a JSON reader's recursion limit cannot be read back; a
//! response above its scope's limit is refused. The in-memory repository
//! refuses by these measures what the database refuses, the crate error
//! names them, and the service refuses or stands in for an answer that
//! fails them. Nothing here knows of any other part of the crate.

use serde_json::Value;
use sha2::{Digest, Sha256};

/// The deepest nesting of arrays and objects a stored response may have.
/// Every replay reads the row back through a JSON reader, and serde_json's
/// stops at 128 levels, two of which the row and its array take: 64 leaves
/// room for callers that wrap the response again.
pub const MAX_RESPONSE_DEPTH: usize = 64;

/// The largest `max_response_bytes` a scope's policy may set: 4 MiB of
/// compact JSON. PostgreSQL writes a stored response back with a space
/// after every `,` and `:`, up to half as large again, so the largest legal
/// answer reaches a client as at most 6 MiB inside its row: within the
/// 8 MiB every client must read (the crate's default
/// `ClientConfig::with_max_response_bytes`).
pub const MAX_POLICY_RESPONSE_BYTES: u64 = 4 * 1024 * 1024;

/// Why the store cannot hold an answer as given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Unstorable {
    /// A string or an object key holds U+0000.
    Nul,
    /// Arrays and objects nest deeper than [`MAX_RESPONSE_DEPTH`].
    TooDeep,
    /// Above the store limit, as compact JSON.
    TooLarge {
        /// Its size in bytes.
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// The database refused the data (a data exception or a check).
    Refused,
}

impl Unstorable {
    /// The reason as journaled and logged: `nul`, `too_deep`, `too_large`, `refused`.
    pub fn as_str(self) -> &'static str {
        match self {
            Unstorable::Nul => "nul",
            Unstorable::TooDeep => "too_deep",
            Unstorable::TooLarge { .. } => "too_large",
            Unstorable::Refused => "refused",
        }
    }
}

/// The first reason `value`, nested `enclosing` levels deep in the stored
/// answer, cannot be stored within `limit` bytes; `None` when it can.
/// Walks the value without recursion, so any depth is safe to check.
pub(crate) fn unstorable(value: &Value, enclosing: usize, limit: u64) -> Option<Unstorable> {
    let mut pending = vec![(value, enclosing)];
    while let Some((value, depth)) = pending.pop() {
        match value {
            Value::String(text) if text.contains('\0') => return Some(Unstorable::Nul),
            Value::Array(items) => {
                if depth + 1 > MAX_RESPONSE_DEPTH {
                    return Some(Unstorable::TooDeep);
                }
                pending.extend(items.iter().map(|item| (item, depth + 1)));
            }
            Value::Object(fields) => {
                if depth + 1 > MAX_RESPONSE_DEPTH {
                    return Some(Unstorable::TooDeep);
                }
                for (name, field) in fields {
                    if name.contains('\0') {
                        return Some(Unstorable::Nul);
                    }
                    pending.push((field, depth + 1));
                }
            }
            _ => {}
        }
    }
    let size = json_size(value);
    (size > limit).then_some(Unstorable::TooLarge { size, limit })
}

/// Size and lowercase hex SHA-256 of `value` as compact JSON; `None` if it
/// does not serialize.
pub(crate) fn digest(value: &Value) -> Option<(u64, String)> {
    let bytes = serde_json::to_vec(value).ok()?;
    Some((bytes.len() as u64, hex::encode(Sha256::digest(&bytes))))
}

/// The size of `value` as compact JSON, counted without building it.
pub(crate) fn json_size(value: &Value) -> u64 {
    struct Count(u64);
    impl std::io::Write for Count {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0 += bytes.len() as u64;
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    // Writing a Value to an infallible writer cannot fail.
    let _ = serde_json::to_writer(&mut count, value);
    count.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn nested(levels: usize) -> Value {
        (0..levels).fold(json!(1), |inner, _| json!([inner]))
    }

    #[test]
    fn json_size_counts_compact_bytes() {
        let value = json!({"a": [1, 2, "é"]});
        assert_eq!(json_size(&value), serde_json::to_vec(&value).unwrap().len() as u64);
    }

    #[test]
    fn nul_anywhere_depth_and_size_are_found() {
        assert_eq!(unstorable(&json!({"a": ["x\u{0}y"]}), 0, 1000), Some(Unstorable::Nul));
        assert_eq!(unstorable(&json!({"a\u{0}": 1}), 0, 1000), Some(Unstorable::Nul));
        assert_eq!(unstorable(&json!({"a": "fine"}), 0, 1000), None);
        assert_eq!(unstorable(&nested(MAX_RESPONSE_DEPTH), 0, u64::MAX), None);
        assert_eq!(unstorable(&nested(MAX_RESPONSE_DEPTH), 1, u64::MAX), Some(Unstorable::TooDeep));
        assert_eq!(unstorable(&nested(1_000), 0, u64::MAX), Some(Unstorable::TooDeep));
        assert_eq!(unstorable(&json!("abcd"), 0, 5), Some(Unstorable::TooLarge { size: 6, limit: 5 }));
    }
}
