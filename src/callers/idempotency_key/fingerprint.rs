//! What makes two requests "the same request": the method, the route, the
//! body and the configured headers, hashed the way every client of the
//! plane hashes (RFC 8785 canonical JSON, SHA-256).

use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderName, Method};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::service::RequestHash;

/// The scope of `method` on `route`: `http.<method>.<route>`, with the
/// route's segments as dot-separated names (`POST /orders/{id}/items` is
/// `http.post.orders.id.items`; `/` is `root`). Characters a scope cannot
/// hold become `_`.
pub(crate) fn scope(method: &Method, route: &str) -> String {
    let segments: Vec<String> = route
        .split('/')
        .filter(|segment| !segment.is_empty())
        .map(|segment| {
            segment
                .chars()
                .filter(|c| !matches!(c, '{' | '}' | ':' | '*'))
                .map(|c| match c.to_ascii_lowercase() {
                    c @ ('a'..='z' | '0'..='9' | '_' | '-') => c,
                    _ => '_',
                })
                .collect()
        })
        .filter(|segment: &String| !segment.is_empty())
        .collect();
    let route = if segments.is_empty() { "root".to_owned() } else { segments.join(".") };
    format!("http.{}.{route}", method.as_str().to_ascii_lowercase())
}

/// The request's fingerprint: its method, its target (path and query), its
/// body and the configured headers. A JSON body (`application/json` or
/// `+json`) counts by its value, so key order and whitespace do not matter,
/// unless it holds an integer beyond 2^53, which RFC 8785's numbers (IEEE
/// doubles) cannot tell from its neighbours; that body, like any other
/// body, an empty one included, counts by its bytes. The configured headers
/// count by name and every value (absent is not empty).
pub(crate) fn fingerprint(
    method: &Method,
    target: &str,
    headers: &HeaderMap,
    body: &Bytes,
    counted: &[HeaderName],
) -> RequestHash {
    let parsed = is_json(headers).then(|| serde_json::from_slice::<Value>(body).ok()).flatten();
    let body = match parsed.filter(exact_as_doubles) {
        Some(value) => json!({ "json": value }),
        None => json!({ "sha256": hex::encode(Sha256::digest(body)) }),
    };
    let counted: serde_json::Map<String, Value> = counted
        .iter()
        .map(|name| {
            let values: Vec<Value> = headers
                .get_all(name)
                .iter()
                .map(|value| Value::String(String::from_utf8_lossy(value.as_bytes()).into_owned()))
                .collect();
            (name.as_str().to_owned(), Value::Array(values))
        })
        .collect();
    RequestHash::of_json(&json!({
        "method": method.as_str(),
        "target": target,
        "body": body,
        "headers": counted,
    }))
}

/// Whether every number of `value` is one RFC 8785 canonicalizes without
/// loss: integers within ±2^53 and floats (which were read as doubles).
fn exact_as_doubles(value: &Value) -> bool {
    const EXACT: u64 = 1 << 53;
    match value {
        Value::Number(n) => {
            n.as_u64().is_none_or(|u| u <= EXACT) && n.as_i64().is_none_or(|i| i.unsigned_abs() <= EXACT)
        }
        Value::Array(items) => items.iter().all(exact_as_doubles),
        Value::Object(members) => members.values().all(exact_as_doubles),
        _ => true,
    }
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
        let other_route =
            fingerprint(&Method::POST, "/p", &json_headers(), &Bytes::from_static(br#"{"a":1,"b":[1,2]}"#), &[]);
        assert_ne!(a, other_route);
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
