//! What makes two requests "the same request": the method, the target,
//! the content type, the body and the configured headers, hashed the way
//! every client of the plane hashes (RFC 8785 canonical JSON, SHA-256);
//! and the scope a route's keys live in.

use std::collections::HashSet;

use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderName, Method};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::service::{RequestHash, MAX_SCOPE_CHARS};

/// Hex digits of the route's hash a long scope ends with (128 bits).
const SCOPE_HASH_HEX: usize = 32;

/// The scope of `method` on `route`: `http.<method>.<route>`, with the
/// route's segments as dot-separated names (`POST /orders/{id}/items` is
/// `http.post.orders.id.items`; `/` is `root`). Characters a scope cannot
/// hold become `_`. A scope longer than the plane's 128 characters keeps
/// its first 95 and ends in `.` and 32 hex digits of the SHA-256 of the
/// method and route as written, so every route has a scope of its own.
pub(crate) fn scope(method: &Method, route: &str) -> String {
    let segments: Vec<String> = route
        .split('/')
        .filter(|segment| !segment.is_empty())
        .map(|segment| segment.chars().filter(|c| !matches!(c, '{' | '}' | ':' | '*')).map(scope_char).collect())
        .filter(|segment: &String| !segment.is_empty())
        .collect();
    let path = if segments.is_empty() { "root".to_owned() } else { segments.join(".") };
    let method_name: String = method.as_str().chars().map(scope_char).collect();
    let scope = format!("http.{method_name}.{path}");
    if scope.len() <= MAX_SCOPE_CHARS {
        return scope;
    }
    let digest = hex::encode(Sha256::digest(format!("{} {route}", method.as_str()).as_bytes()));
    // Every character is ASCII: bytes are characters.
    let kept = &scope[..MAX_SCOPE_CHARS - 1 - SCOPE_HASH_HEX];
    format!("{kept}.{}", &digest[..SCOPE_HASH_HEX])
}

fn scope_char(c: char) -> char {
    match c.to_ascii_lowercase() {
        c @ ('a'..='z' | '0'..='9' | '_' | '-') => c,
        _ => '_',
    }
}

/// The request's fingerprint: its method, its target (path and query), its
/// `Content-Type` as sent, its body and the configured headers.
///
/// The body counts by its bytes (their SHA-256), an empty body included,
/// unless it is JSON (`application/json` or `+json`) whose value RFC
/// 8785's canonical form holds without loss: then by that value, so that
/// key order, whitespace and number spellings of one value do not matter.
/// The form is lossless when no object repeats a member name (a reader
/// keeps one of them, so `{"a":1,"a":2}` is not `{"a":2}`) and every
/// number is exactly the decimal the canonical form writes for it: a number
/// one double cannot tell from its neighbours (`9007199254740993`,
/// `9007199254740993.0`, `0.1000000000000000000001`, `1e-400`) or `-0`
/// counts the whole body by bytes. The configured headers count by name
/// and every value (absent is not empty). The same bytes under two content
/// types are two requests.
pub(crate) fn fingerprint(
    method: &Method,
    target: &str,
    headers: &HeaderMap,
    body: &Bytes,
    counted: &[HeaderName],
) -> RequestHash {
    let value = is_json(headers).then(|| lossless_json(body)).flatten();
    let body = match value {
        Some(value) => json!({ "json": value }),
        None => json!({ "sha256": hex::encode(Sha256::digest(body)) }),
    };
    let values = |name: &HeaderName| -> Vec<Value> {
        headers
            .get_all(name)
            .iter()
            .map(|value| Value::String(String::from_utf8_lossy(value.as_bytes()).into_owned()))
            .collect()
    };
    let counted: serde_json::Map<String, Value> =
        counted.iter().map(|name| (name.as_str().to_owned(), Value::Array(values(name)))).collect();
    RequestHash::of_json(&json!({
        "method": method.as_str(),
        "target": target,
        "content_type": values(&axum::http::header::CONTENT_TYPE),
        "body": body,
        "headers": counted,
    }))
}

/// The value of `body` when it is JSON whose canonical form loses nothing
/// of it; `None` otherwise. Decided on the bytes, not on what serde_json
/// kept of them, so it is the same with and without serde_json's
/// `arbitrary_precision`.
fn lossless_json(body: &[u8]) -> Option<Value> {
    let value = serde_json::from_slice::<Value>(body).ok()?;
    lossless(body).then_some(value)
}

/// Whether well-formed JSON `text` repeats no member name in any object
/// and holds only numbers the canonical form writes exactly.
fn lossless(text: &[u8]) -> bool {
    enum Frame {
        Object { names: HashSet<String>, name_next: bool },
        Array,
    }
    let mut frames: Vec<Frame> = Vec::new();
    let mut at = 0;
    while let Some(&byte) = text.get(at) {
        match byte {
            b'{' => frames.push(Frame::Object { names: HashSet::new(), name_next: true }),
            b'[' => frames.push(Frame::Array),
            b'}' | b']' => {
                frames.pop();
            }
            b',' => {
                if let Some(Frame::Object { name_next, .. }) = frames.last_mut() {
                    *name_next = true;
                }
            }
            b'"' => {
                let Some(end) = string_end(text, at) else { return false };
                if let Some(Frame::Object { names, name_next: name_next @ true }) = frames.last_mut() {
                    let Ok(name) = serde_json::from_slice::<String>(&text[at..end]) else { return false };
                    if !names.insert(name) {
                        return false;
                    }
                    *name_next = false;
                }
                at = end;
                continue;
            }
            b'-' | b'0'..=b'9' => {
                let end = text[at..]
                    .iter()
                    .position(|b| !matches!(b, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E'))
                    .map_or(text.len(), |length| at + length);
                let exact = std::str::from_utf8(&text[at..end]).is_ok_and(exact_number);
                if !exact {
                    return false;
                }
                at = end;
                continue;
            }
            // Whitespace, `:`, and the letters of true, false and null.
            _ => {}
        }
        at += 1;
    }
    true
}

/// The index just past the string starting at `start` (its opening quote).
fn string_end(text: &[u8], start: usize) -> Option<usize> {
    let mut at = start + 1;
    loop {
        match text.get(at)? {
            b'\\' => at += 2,
            b'"' => return Some(at + 1),
            _ => at += 1,
        }
    }
}

/// Whether the JSON number `source` is exactly the decimal RFC 8785 writes
/// for the double it denotes (ECMAScript's shortest round trip): then the
/// canonical form keeps the source's value, and two sources with one
/// canonical form are one number. `-0` is not (it is written `0`).
fn exact_number(source: &str) -> bool {
    let Ok(double) = source.parse::<f64>() else { return false };
    if !double.is_finite() || (double == 0.0 && double.is_sign_negative()) {
        return false;
    }
    let written = ryu_js::Buffer::new().format_finite(double).to_owned();
    match (decimal(source), decimal(&written)) {
        (Some(source), Some(written)) => source == written,
        _ => false,
    }
}

/// A decimal number's value as (negative, significant digits without
/// leading or trailing zeros, power of ten of the last digit); zero has
/// no digits and power 0.
fn decimal(text: &str) -> Option<(bool, String, i64)> {
    let (negative, unsigned) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (mantissa, exponent) = match unsigned.find(['e', 'E']) {
        Some(at) => (&unsigned[..at], unsigned[at + 1..].parse::<i64>().ok()?),
        None => (unsigned, 0),
    };
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    if whole.is_empty() || !whole.bytes().chain(fraction.bytes()).all(|b| b.is_ascii_digit()) {
        return None;
    }
    let digits = format!("{whole}{fraction}");
    let significant = digits.trim_start_matches('0');
    let trimmed = significant.trim_end_matches('0');
    if trimmed.is_empty() {
        return Some((negative, String::new(), 0));
    }
    let trailing = (significant.len() - trimmed.len()) as i64;
    let power = exponent.checked_sub(fraction.len() as i64)?.checked_add(trailing)?;
    Some((negative, trimmed.to_owned(), power))
}

fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(';').next())
        .map(|mime| {
            let mime = mime.trim().to_ascii_lowercase();
            mime == "application/json" || (mime.starts_with("application/") && mime.ends_with("+json"))
        })
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn json_headers() -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json; charset=utf-8"));
        headers
    }

    #[test]
    fn routes_become_scopes_the_plane_accepts() {
        assert_eq!(scope(&Method::POST, "/orders"), "http.post.orders");
        assert_eq!(scope(&Method::PATCH, "/orders/{id}/Items"), "http.patch.orders.id.items");
        assert_eq!(scope(&Method::POST, "/"), "http.post.root");
        assert_eq!(scope(&Method::POST, "/v1/café"), "http.post.v1.caf_");
        for route in ["/orders", "/a/{b}/c", "/", "/x y/%20"] {
            assert!(crate::service::scope::validate_scope(&scope(&Method::POST, route)).is_ok(), "{route}");
        }
        let custom = Method::from_bytes(b"FROB!").unwrap();
        assert_eq!(scope(&custom, "/orders"), "http.frob_.orders");
    }

    #[test]
    fn a_route_too_long_for_a_scope_gets_one_of_its_own_within_the_limit() {
        let base = format!("/v1/{}", "segment/".repeat(20));
        let routes = [format!("{base}{{id}}/a"), format!("{base}{{id}}/b"), format!("{base}{{id}}:b"), base.clone()];
        let scopes: Vec<String> = routes.iter().map(|route| scope(&Method::POST, route)).collect();
        for (route, scope) in routes.iter().zip(&scopes) {
            assert_eq!(scope.len(), MAX_SCOPE_CHARS, "{route}");
            assert!(crate::service::scope::validate_scope(scope).is_ok(), "{scope}");
            assert!(scope.starts_with("http.post.v1.segment.segment."), "{scope}");
        }
        let distinct: HashSet<&String> = scopes.iter().collect();
        assert_eq!(distinct.len(), routes.len(), "{scopes:?}");
        assert_ne!(scope(&Method::POST, &routes[0]), scope(&Method::PATCH, &routes[0]));
        // At the limit, a scope is kept as it is.
        let at_limit = format!("/{}", "x".repeat(MAX_SCOPE_CHARS - "http.post.".len()));
        assert_eq!(scope(&Method::POST, &at_limit), format!("http.post.{}", &at_limit[1..]));
        assert_eq!(scope(&Method::POST, &format!("{at_limit}y")).len(), MAX_SCOPE_CHARS);
        assert!(!scope(&Method::POST, &format!("{at_limit}y")).contains("xy"));
    }

    #[test]
    fn json_key_order_does_not_matter_but_everything_else_does() {
        let a = fingerprint(&Method::POST, "/o", &json_headers(), &Bytes::from_static(br#"{"a":1,"b":[1,2]}"#), &[]);
        let b = fingerprint(
            &Method::POST,
            "/o",
            &json_headers(),
            &Bytes::from_static(b"{ \"b\": [1,2], \"a\": 1.0 }"),
            &[],
        );
        assert_eq!(a, b);
        let other_body =
            fingerprint(&Method::POST, "/o", &json_headers(), &Bytes::from_static(br#"{"a":2,"b":[1,2]}"#), &[]);
        assert_ne!(a, other_body);
        let other_path =
            fingerprint(&Method::POST, "/p", &json_headers(), &Bytes::from_static(br#"{"a":1,"b":[1,2]}"#), &[]);
        assert_ne!(a, other_path);
        let other_method =
            fingerprint(&Method::PATCH, "/o", &json_headers(), &Bytes::from_static(br#"{"a":1,"b":[1,2]}"#), &[]);
        assert_ne!(a, other_method);
    }

    #[test]
    fn raw_bodies_count_by_bytes_and_an_empty_body_is_a_request_of_its_own() {
        let plain = HeaderMap::new();
        let empty = fingerprint(&Method::POST, "/o", &plain, &Bytes::new(), &[]);
        assert_eq!(empty, fingerprint(&Method::POST, "/o", &plain, &Bytes::new(), &[]));
        assert_ne!(empty, fingerprint(&Method::POST, "/o", &plain, &Bytes::from_static(b" "), &[]));
        // Not declared JSON: `{"a":1}` and `{ "a": 1 }` are different bytes.
        assert_ne!(
            fingerprint(&Method::POST, "/o", &plain, &Bytes::from_static(br#"{"a":1}"#), &[]),
            fingerprint(&Method::POST, "/o", &plain, &Bytes::from_static(br#"{ "a": 1 }"#), &[])
        );
    }

    #[test]
    fn integers_a_double_cannot_tell_apart_count_by_their_bytes() {
        let h = json_headers();
        let a = fingerprint(&Method::POST, "/o", &h, &Bytes::from_static(br#"{"amount":9007199254740993}"#), &[]);
        let b = fingerprint(&Method::POST, "/o", &h, &Bytes::from_static(br#"{"amount":9007199254740992}"#), &[]);
        assert_ne!(a, b, "2^53 + 1 and 2^53 are one double, two amounts");
        let small = fingerprint(&Method::POST, "/o", &h, &Bytes::from_static(br#"{"amount":12}"#), &[]);
        assert_eq!(small, fingerprint(&Method::POST, "/o", &h, &Bytes::from_static(br#"{ "amount": 12 }"#), &[]));
    }

    fn post(headers: &HeaderMap, body: &'static str) -> RequestHash {
        fingerprint(&Method::POST, "/o", headers, &Bytes::from_static(body.as_bytes()), &[])
    }

    #[test]
    fn numbers_count_by_value_only_when_the_canonical_form_writes_them_exactly() {
        let h = json_headers();
        // One value, many spellings: one request.
        for (a, b) in [
            ("[100]", "[1e2]"),
            ("[100]", "[1E+2]"),
            ("[0.1]", "[0.10]"),
            ("[0.1]", "[1e-1]"),
            ("[0]", "[0.0]"),
            ("[1.5e-7]", "[0.00000015]"),
            ("[1e21]", "[1000000000000000000000]"),
            ("[123456789012]", "[1.23456789012e11]"),
        ] {
            assert_eq!(post(&h, a), post(&h, b), "{a} and {b}");
        }
        // Two decimals one double cannot tell apart, however written: two requests.
        for (a, b) in [
            ("[9007199254740993]", "[9007199254740992]"),
            ("[9007199254740993.0]", "[9007199254740992.0]"),
            ("[9007199254740993e0]", "[9007199254740992e0]"),
            ("[90071992547409930e-1]", "[9007199254740992]"),
            ("[0.1000000000000000000001]", "[0.1]"),
            ("[0.30000000000000004441]", "[0.30000000000000004]"),
            ("[1e-400]", "[0]"),
            ("[-0]", "[0]"),
            ("[-0.0]", "[0]"),
            ("[1e400]", "[1e401]"),
            // 2^64 is a double, but ECMAScript writes it 18446744073709552000.
            ("[18446744073709551616]", "[18446744073709552000]"),
        ] {
            assert_ne!(post(&h, a), post(&h, b), "{a} and {b}");
        }
    }

    #[test]
    fn a_repeated_member_is_not_its_last_one() {
        let h = json_headers();
        assert_ne!(post(&h, r#"{"a":1,"a":2}"#), post(&h, r#"{"a":2}"#));
        assert_ne!(post(&h, r#"{"a":1,"a":2}"#), post(&h, r#"{"a":1}"#));
        assert_ne!(post(&h, r#"{"a":1,"\u0061":2}"#), post(&h, r#"{"a":2}"#), "one name, escaped");
        assert_ne!(post(&h, r#"[{"x":{"a":1,"a":1}}]"#), post(&h, r#"[{"x":{"a":1}}]"#), "nested");
        // One name in two objects is no repeat; a value equal to a name is no name.
        assert_eq!(
            post(&h, r#"{"a":{"a":"a"},"b":[{"a":1},{"a":1}]}"#),
            post(&h, r#"{"b":[{"a":1},{"a":1}],"a":{"a":"a"}}"#)
        );
        assert_eq!(post(&h, r#"{"a":"b","b":"a"}"#), post(&h, r#"{"b":"a","a":"b"}"#));
        assert_eq!(
            post(&h, r#"{"a\"b":1,"c":"\\"}"#),
            post(&h, r#"{"c":"\\","a\"b":1}"#),
            "escapes in names and strings"
        );
    }

    #[test]
    fn the_content_type_is_part_of_the_request() {
        let typed = |content_type: &'static str| {
            let mut headers = HeaderMap::new();
            headers.insert("content-type", HeaderValue::from_static(content_type));
            post(&headers, r#"{"a":1}"#)
        };
        let json = typed("application/json");
        assert_ne!(json, typed("application/vnd.api+json"));
        assert_ne!(json, typed("text/plain"));
        assert_ne!(json, post(&HeaderMap::new(), r#"{"a":1}"#), "no content type");
        assert_ne!(typed("text/plain"), typed("application/octet-stream"));
        assert_ne!(typed("text/plain"), post(&HeaderMap::new(), r#"{"a":1}"#));
        assert_eq!(json, typed("application/json"));
    }

    /// Pinned: the same with serde_json's `arbitrary_precision` (feature
    /// `local`) as without it (`--features axum`), since both runs check these.
    #[test]
    fn the_fingerprint_is_pinned_whatever_serde_json_keeps_of_numbers() {
        let h = json_headers();
        let pinned = [
            (r#"{"b":[1,2.50,1e2],"a":"x"}"#, "cae471138847311575707981c346025d5662427a7caac27c62552415b2e7fded"),
            (r#"{"amount":9007199254740993.0}"#, "99e660e025e502b00271861de965b4dc8c7a9ca370a382cfa0c0c4268e11abcd"),
            (
                r#"{"amount":123456789012345678901234567890}"#,
                "89af46f63d0a03bc9a1d361314074dc034aace01c63de820313bf760827c48ad",
            ),
            (r#"{"rate":1e400}"#, "a4cbb70b4d44ca926e6dfd9f549d010aebddc6d44455323a8eef4aa55af5ea83"),
            (r#"{"a":1,"a":2}"#, "8c69134763ff553f4acf0d4f5c2443668dc5e69336f92c35a4c69690fa8fff05"),
        ];
        for (body, hash) in pinned {
            assert_eq!(post(&h, body).as_str(), hash, "{body}");
        }
        // The first by its value, the others by their bytes.
        assert_eq!(post(&h, r#"{"a":"x","b":[1,2.5,100]}"#).as_str(), pinned[0].1);
    }

    #[test]
    fn decimals_are_compared_by_value() {
        assert_eq!(decimal("100"), Some((false, "1".into(), 2)));
        assert_eq!(decimal("1e2"), decimal("100.000"));
        assert_eq!(decimal("-0.0125"), Some((true, "125".into(), -4)));
        assert_eq!(decimal("0"), Some((false, String::new(), 0)));
        assert_eq!(decimal("-0e5"), Some((true, String::new(), 0)));
        assert_eq!(decimal("1.5e-7"), decimal("0.00000015"));
        assert_eq!(decimal("1e99999999999999999999"), None, "an exponent beyond i64");
        assert!(exact_number("0.1") && exact_number("9007199254740992") && exact_number("5e-324"));
        assert!(!exact_number("9007199254740993") && !exact_number("4e-324") && !exact_number("-0"));
    }

    #[test]
    fn the_path_and_query_are_part_of_the_request() {
        let (h, body) = (json_headers(), Bytes::from_static(b"{}"));
        let one = fingerprint(&Method::POST, "/accounts/1/transfers", &h, &body, &[]);
        assert_ne!(one, fingerprint(&Method::POST, "/accounts/2/transfers", &h, &body, &[]));
        assert_ne!(one, fingerprint(&Method::POST, "/accounts/1/transfers?currency=EUR", &h, &body, &[]));
    }

    #[test]
    fn configured_headers_count_and_others_do_not() {
        let counted = [HeaderName::from_static("x-currency")];
        let mut eur = json_headers();
        eur.insert("x-currency", HeaderValue::from_static("EUR"));
        eur.insert("x-request-id", HeaderValue::from_static("1"));
        let mut usd = json_headers();
        usd.insert("x-currency", HeaderValue::from_static("USD"));
        usd.insert("x-request-id", HeaderValue::from_static("2"));
        let body = Bytes::from_static(b"{}");
        assert_ne!(
            fingerprint(&Method::POST, "/o", &eur, &body, &counted),
            fingerprint(&Method::POST, "/o", &usd, &body, &counted)
        );
        let mut eur_again = eur.clone();
        eur_again.insert("x-request-id", HeaderValue::from_static("3"));
        assert_eq!(
            fingerprint(&Method::POST, "/o", &eur, &body, &counted),
            fingerprint(&Method::POST, "/o", &eur_again, &body, &counted)
        );
    }
}
