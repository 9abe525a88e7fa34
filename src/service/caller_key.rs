//! The key an `Idempotency-Key` front door (the axum layer, the TypeScript
//! middleware) stores for one caller's key, so that tools that look a claim
//! up by hand (`idem get --principal`) find the same row.

use sha2::{Digest, Sha256};

/// Separates a caller's hash from the key. No `Idempotency-Key` can hold it
/// (they are visible ASCII), so a key scoped by a caller never equals a key
/// shared across callers.
const CALLER_SEPARATOR: char = '\u{a7}';

/// The plane's key for `key` sent by `principal` (the caller within its
/// tenant: a user or API client id, a token's `sub`): the hex SHA-256 of the
/// principal, `§`, and the key. The principal itself is never stored. The
/// TypeScript client's `planeKey` derives the same key.
pub fn caller_scoped_key(principal: &str, key: &str) -> String {
    format!("{}{CALLER_SEPARATOR}{key}", hex::encode(Sha256::digest(principal.as_bytes())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_caller_scoped_key_is_the_hash_of_the_principal_a_section_sign_and_the_key() {
        assert_eq!(
            caller_scoped_key("alice", "k-1"),
            "2bd806c97f0e00af1a1fc3328fa763a9269723c8db8fac4f93af71db186d6e90\u{a7}k-1"
        );
    }
}
