//! The console's per-session token: 32 random bytes from the operating
//! system, made when the console starts, put in the page it serves, and
//! required on every API request. A page of another origin cannot read it
//! (the console sends no CORS header and answers its own host only), so it
//! cannot forge an action.

use rand::rngs::OsRng;
use rand::TryRngCore;

/// How many random bytes the token holds.
const TOKEN_BYTES: usize = 32;

/// The request header that carries the token.
pub(crate) const TOKEN_HEADER: &str = "x-idem-console-token";

/// Why no token could be made.
#[derive(Debug, thiserror::Error)]
#[error("the operating system's random source failed: {0}")]
pub(crate) struct NoRandomness(#[from] rand::rand_core::OsError);

/// The session's token, as lowercase hex.
#[derive(Clone)]
pub(crate) struct SessionToken(String);

impl std::fmt::Debug for SessionToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionToken(…)")
    }
}

impl SessionToken {
    /// A fresh token from the operating system's random source.
    pub(crate) fn new() -> Result<Self, NoRandomness> {
        let mut bytes = [0u8; TOKEN_BYTES];
        OsRng.try_fill_bytes(&mut bytes)?;
        Ok(SessionToken(hex::encode(bytes)))
    }

    /// The token as the page carries it.
    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `presented` is this token, compared in constant time (a
    /// wrong guess takes as long whatever its first bytes).
    pub(crate) fn matches(&self, presented: &[u8]) -> bool {
        idempotency_plane::callers::route::same_secret(self.0.as_bytes(), presented)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_64_hex_digits_and_fresh_each_time() {
        let (one, two) = (SessionToken::new().unwrap(), SessionToken::new().unwrap());
        assert_eq!(one.as_str().len(), 64);
        assert!(one.as_str().bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_ne!(one.as_str(), two.as_str());
    }

    #[test]
    fn only_the_token_itself_matches() {
        let token = SessionToken::new().unwrap();
        assert!(token.matches(token.as_str().as_bytes()));
        let mut other = token.as_str().as_bytes().to_vec();
        other[63] = if other[63] == b'0' { b'1' } else { b'0' };
        assert!(!token.matches(&other));
        assert!(!token.matches(&token.as_str().as_bytes()[..63]));
        assert!(!token.matches(b""));
        assert!(!token.matches(format!("{}0", token.as_str()).as_bytes()));
    }

    #[test]
    fn its_debug_form_hides_it() {
        let token = SessionToken::new().unwrap();
        assert!(!format!("{token:?}").contains(token.as_str()));
    }
}
