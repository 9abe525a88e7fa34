//! The answer a first request got, as the journal keeps it: status,
//! selected headers and the body (text when it is UTF-8, base64 otherwise),
//! so a repeat is answered byte for byte.

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use base64::Engine;
use serde::{Deserialize, Serialize};

use super::problem::Problem;

/// Headers that carry one caller's credentials or session, in lowercase:
/// never journaled, never replayed (a replay answers whoever repeats the
/// key), and refused by `keep_header`. The TypeScript middleware reads the
/// same list from its `credential_headers.json`, beside the module; a test
/// keeps the two equal.
pub const CREDENTIAL_HEADERS: &[&str] = &[
    "set-cookie",
    "set-cookie2",
    "cookie",
    "cookie2",
    "authorization",
    "proxy-authorization",
    "www-authenticate",
    "proxy-authenticate",
    "authentication-info",
    "proxy-authentication-info",
    "x-api-key",
    "api-key",
    "apikey",
    "x-auth-token",
    "x-access-token",
    "x-refresh-token",
    "x-csrf-token",
    "x-xsrf-token",
];

/// Headers that describe a response body's bytes, in lowercase: never
/// copied onto a first answer whose body the journal omitted, and the length
/// ones never copied at all (the server sets them for the body it sends).
/// The TypeScript middleware reads the same list from its
/// `body_headers.json`; a test keeps the two equal.
pub const BODY_HEADERS: &[&str] = &[
    "content-length",
    "transfer-encoding",
    "content-encoding",
    "content-range",
    "content-md5",
    "digest",
    "etag",
    "trailer",
];

/// Whether `name` (any case) is one of [`CREDENTIAL_HEADERS`].
pub(super) fn is_credential(name: &str) -> bool {
    CREDENTIAL_HEADERS.iter().any(|credential| credential.eq_ignore_ascii_case(name))
}

/// A stored HTTP answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct StoredResponse {
    pub(super) status: u16,
    /// Kept headers, lowercase names, in the order they are kept: one
    /// entry a header, its values joined by `, ` (see [`of`](Self::of)).
    pub(super) headers: Vec<(String, String)>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) body_text: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) body_base64: Option<String>,
    /// Set instead of a body when the body was above the store's limit:
    /// its size in bytes. A replay answers the status and headers with an
    /// empty body and `Idempotent-Body-Omitted: <size>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) body_omitted: Option<u64>,
    /// The layer answered a problem in place of the handler's answer.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(super) refused: bool,
}

impl StoredResponse {
    /// What to keep of an answer: its status, the `keep` headers it carries
    /// (any credential header left out), and its body.
    ///
    /// A header is kept as one entry, its values joined by `, `, as the
    /// Fetch standard's `Headers.get` reads them, the only reading the
    /// TypeScript middleware has: so both clients store an answer alike,
    /// and replay it alike (RFC 9110 lets a recipient combine a field's
    /// lines so; `Set-Cookie`, the one field that cannot be, is never
    /// kept). One whose joined value is not visible ASCII is left out.
    pub(super) fn of(status: StatusCode, headers: &HeaderMap, keep: &[HeaderName], body: &Bytes) -> Self {
        let headers = keep
            .iter()
            .filter(|name| !is_credential(name.as_str()))
            .filter_map(|name| {
                let values: Vec<&[u8]> = headers.get_all(name).iter().map(HeaderValue::as_bytes).collect();
                if values.is_empty() {
                    return None;
                }
                let joined = HeaderValue::from_bytes(&values.join(&b", "[..])).ok()?;
                Some((name.as_str().to_owned(), joined.to_str().ok()?.to_owned()))
            })
            .collect();
        // Text unless it is not UTF-8 or holds U+0000, which jsonb cannot.
        let (body_text, body_base64) = match std::str::from_utf8(body) {
            Ok(text) if !text.contains('\0') => (Some(text.to_owned()), None),
            _ => (None, Some(base64::engine::general_purpose::STANDARD.encode(body))),
        };
        StoredResponse { status: status.as_u16(), headers, body_text, body_base64, body_omitted: None, refused: false }
    }

    /// A problem the layer answers in place of the handler's answer, kept so
    /// that every repeat gets it too.
    pub(super) fn refusal(problem: &Problem) -> Self {
        StoredResponse {
            status: problem.status.as_u16(),
            headers: vec![("content-type".into(), "application/problem+json".into())],
            body_text: Some(problem.body()),
            body_base64: None,
            body_omitted: None,
            refused: true,
        }
    }

    /// The answer the first caller gets instead of the handler's, when the
    /// journal keeps a refusal.
    pub(super) fn refused(&self) -> Option<Response<Body>> {
        if !self.refused {
            return None;
        }
        let mut response = self.replay()?;
        response.headers_mut().remove("idempotent-replayed");
        Some(response)
    }

    /// The same answer without its body, for a body the store cannot keep.
    pub(super) fn without_body(mut self, size: u64) -> Self {
        self.body_text = None;
        self.body_base64 = None;
        self.body_omitted = Some(size);
        self
    }

    /// The replay: the stored status, headers and body, and
    /// `Idempotent-Replayed: true`. `None` when what was stored is not a
    /// well-formed answer (a status out of range, a header or base64 that
    /// does not decode). A credential header is left out, even when a
    /// journal (written by an older layer, or by hand) holds one.
    pub(super) fn replay(&self) -> Option<Response<Body>> {
        let body = match (&self.body_text, &self.body_base64) {
            (Some(text), None) => Bytes::from(text.clone()),
            (None, Some(encoded)) => Bytes::from(base64::engine::general_purpose::STANDARD.decode(encoded).ok()?),
            (None, None) => Bytes::new(),
            (Some(_), Some(_)) => return None,
        };
        let mut response = Response::new(Body::from(body));
        *response.status_mut() = StatusCode::from_u16(self.status).ok()?;
        let headers = response.headers_mut();
        for (name, value) in self.headers.iter().filter(|(name, _)| !is_credential(name)) {
            headers.append(HeaderName::try_from(name.as_str()).ok()?, HeaderValue::try_from(value.as_str()).ok()?);
        }
        if let Some(size) = self.body_omitted {
            headers.insert("idempotent-body-omitted", HeaderValue::from(size));
        }
        headers.insert("idempotent-replayed", HeaderValue::from_static("true"));
        Some(response)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_and_binary_bodies_replay_byte_for_byte_with_the_kept_headers_only() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.insert("location", HeaderValue::from_static("/orders/1"));
        headers.insert("set-cookie", HeaderValue::from_static("session=secret"));
        let keep = [HeaderName::from_static("content-type"), HeaderName::from_static("location")];
        for body in [Bytes::from_static(b"{\"id\":1}"), Bytes::from_static(&[0xff, 0x00, 0xfe]), Bytes::new()] {
            let stored = StoredResponse::of(StatusCode::CREATED, &headers, &keep, &body);
            let json = serde_json::to_value(&stored).unwrap();
            let back: StoredResponse = serde_json::from_value(json).unwrap();
            let replay = back.replay().expect("a well-formed answer");
            assert_eq!(replay.status(), StatusCode::CREATED);
            assert_eq!(replay.headers()["location"], "/orders/1");
            assert_eq!(replay.headers()["idempotent-replayed"], "true");
            assert!(replay.headers().get("set-cookie").is_none(), "only the kept headers");
            let replayed = futures_util::FutureExt::now_or_never(axum::body::to_bytes(replay.into_body(), 1024))
                .expect("ready")
                .unwrap();
            assert_eq!(replayed, body);
        }
    }

    #[test]
    fn credential_headers_are_neither_kept_nor_replayed() {
        let mut headers = HeaderMap::new();
        headers.insert("set-cookie", HeaderValue::from_static("session=alice"));
        headers.insert("authorization", HeaderValue::from_static("Bearer alice"));
        headers.insert("x-trace", HeaderValue::from_static("1"));
        let keep: Vec<HeaderName> = ["Set-Cookie", "Authorization", "x-trace"]
            .iter()
            .map(|name| HeaderName::try_from(*name).unwrap())
            .collect();
        let stored = StoredResponse::of(StatusCode::OK, &headers, &keep, &Bytes::new());
        assert_eq!(stored.headers, vec![("x-trace".to_owned(), "1".to_owned())]);
        // A journal that holds them anyway, in any case.
        let mut held = stored.clone();
        for name in CREDENTIAL_HEADERS.iter().map(|n| n.to_owned()).chain(["Set-Cookie", "WWW-Authenticate"]) {
            held.headers.push((name.to_owned(), "secret".to_owned()));
        }
        let replay = held.replay().expect("a well-formed answer");
        for name in CREDENTIAL_HEADERS {
            assert!(replay.headers().get(*name).is_none(), "{name} replayed");
        }
        assert_eq!(replay.headers()["x-trace"], "1");
        assert!(is_credential("Proxy-Authenticate") && !is_credential("location"));
    }

    #[test]
    fn a_header_sent_twice_is_kept_as_the_fetch_standard_reads_it_one_value_joined() {
        let mut headers = HeaderMap::new();
        headers.append("x-trace", HeaderValue::from_static("a"));
        headers.append("x-trace", HeaderValue::from_static("b, c"));
        headers.append("link", HeaderValue::from_static("</1>"));
        headers.append("link", HeaderValue::from_bytes("</ключ>".as_bytes()).unwrap());
        headers.insert("location", HeaderValue::from_static("/orders/1"));
        let keep = ["location", "x-trace", "link", "x-absent"].map(HeaderName::from_static);
        let stored = StoredResponse::of(StatusCode::OK, &headers, &keep, &Bytes::new());
        let kept = [("location", "/orders/1"), ("x-trace", "a, b, c")].map(|(n, v)| (n.to_owned(), v.to_owned()));
        assert_eq!(stored.headers, kept, "one entry a header; a value that is not visible ASCII leaves it out");
        let replay = stored.replay().expect("a well-formed answer");
        assert_eq!(replay.headers().get_all("x-trace").iter().collect::<Vec<_>>(), ["a, b, c"]);
    }

    #[test]
    fn an_answer_stored_malformed_is_not_replayed() {
        let mut stored = StoredResponse::of(StatusCode::OK, &HeaderMap::new(), &[], &Bytes::from_static(b"x"));
        stored.status = 1000;
        assert!(stored.replay().is_none());
    }
}
