//! The `Idempotency-Key` header: how a key is read from a request (a bare
//! value or an RFC 8941 string, visible ASCII, at most 255 characters, one
//! per request), and the plane's key it becomes for a caller.

use axum::http::HeaderMap;

use crate::service::caller_scoped_key;

use super::problem::{Problem, ProblemType};

/// The request header the key is read from.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// Longest key accepted, in characters (Stripe's limit).
pub const MAX_IDEMPOTENCY_KEY_CHARS: usize = 255;

/// The plane's key: the request's own, or, scoped by a caller, the
/// SHA-256 of the caller's principal, `§`, and the request's key
/// ([`caller_scoped_key`]).
pub(super) fn plane_key(key: &str, principal: Option<&str>) -> String {
    match principal {
        None => key.to_owned(),
        Some(principal) => caller_scoped_key(principal, key),
    }
}

/// The key, if the request has one: a bare value (as Stripe takes it) or an
/// RFC 8941 string (`"…"`, as the IETF draft writes it).
pub(super) fn read(headers: &HeaderMap) -> Result<Option<String>, Problem> {
    let malformed = |detail: &str| Problem::new(ProblemType::MalformedKey, detail);
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else { return Ok(None) };
    if values.next().is_some() {
        return Err(malformed("the request carries more than one Idempotency-Key"));
    }
    let text = value.to_str().map_err(|_| malformed("the key holds characters other than visible ASCII"))?.trim();
    let key = match text.strip_prefix('"').and_then(|t| t.strip_suffix('"')) {
        Some(inner) if inner.contains(['"', '\\']) => {
            return Err(malformed("a quoted key holds a quote or a backslash"))
        }
        Some(inner) => inner,
        None => text,
    };
    if key.is_empty() {
        return Err(malformed("the key is empty"));
    }
    if !key.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return Err(malformed("the key holds characters other than visible ASCII"));
    }
    let chars = key.len();
    if chars > MAX_IDEMPOTENCY_KEY_CHARS {
        return Err(malformed(&format!("the key is {chars} characters; at most {MAX_IDEMPOTENCY_KEY_CHARS}")));
    }
    Ok(Some(key.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::{HeaderValue, StatusCode};

    fn with_key(value: &'static [u8]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(IDEMPOTENCY_KEY, HeaderValue::from_bytes(value).unwrap());
        headers
    }

    #[test]
    fn a_callers_key_is_its_own_and_never_a_shared_one() {
        assert_eq!(plane_key("k-1", None), "k-1");
        let alice = plane_key("k-1", Some("alice"));
        assert_ne!(alice, plane_key("k-1", Some("bob")));
        assert_ne!(alice, plane_key("k-2", Some("alice")));
        assert!(alice.ends_with("\u{a7}k-1") && !alice.contains("alice"), "{alice}");
        // No Idempotency-Key (visible ASCII) can spell a caller's key.
        assert!(!alice.is_ascii());
        let longest = plane_key(&"k".repeat(MAX_IDEMPOTENCY_KEY_CHARS), Some(&"p".repeat(10_000)));
        assert!(crate::service::validate_key(&longest).is_ok(), "within the plane's key limit");
    }

    #[test]
    fn keys_bare_or_quoted_are_read_and_bad_ones_refused() {
        assert_eq!(read(&HeaderMap::new()), Ok(None));
        assert_eq!(read(&with_key(b"abc-1")), Ok(Some("abc-1".into())));
        assert_eq!(read(&with_key(b"\"8e03978e-40d5\"")), Ok(Some("8e03978e-40d5".into())));
        for bad in [&b""[..], b"\"\"", b"   ", b"\"a\"b\"", b"caf\xc3\xa9"] {
            let refused = read(&with_key(bad)).unwrap_err();
            assert_eq!((refused.status, refused.slug), (StatusCode::BAD_REQUEST, "malformed-key"), "{bad:?}");
        }
        let long = "k".repeat(MAX_IDEMPOTENCY_KEY_CHARS + 1);
        let mut headers = HeaderMap::new();
        headers.insert(IDEMPOTENCY_KEY, HeaderValue::from_str(&long).unwrap());
        assert!(read(&headers).is_err());
        headers.insert(IDEMPOTENCY_KEY, HeaderValue::from_str(&long[1..]).unwrap());
        assert!(read(&headers).is_ok());
        headers.append(IDEMPOTENCY_KEY, HeaderValue::from_static("two"));
        assert!(read(&headers).is_err(), "two keys");
    }
}
