//! What the console lets in, and what every answer carries.
//!
//! - **Host.** A request whose `Host` is not the address the console is
//!   bound to (or `localhost` with its port, when bound to loopback) gets
//!   403: a page that makes its own name resolve to 127.0.0.1 (DNS
//!   rebinding) reaches nothing.
//! - **Token.** Every request under `/api/` carries the session token in
//!   its `x-idem-console-token` header, else 403 before anything is read or
//!   done; a request that names an `Origin` must name the console's own.
//! - **Headers.** Every answer forbids framing (`X-Frame-Options: DENY`,
//!   `frame-ancestors 'none'`), holds a Content-Security-Policy that lets
//!   in the console's own script, style and API only (no inline script),
//!   is never cached, and sends no CORS header at all.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;

use super::session::{SessionToken, TOKEN_HEADER};

/// The page's policy: its own script, style and API, nothing inline,
/// nothing framed, no form posted anywhere.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
                                       connect-src 'self'; img-src 'self'; base-uri 'none'; \
                                       form-action 'none'; frame-ancestors 'none'";

/// Where the API lives; everything under it needs the token.
pub(crate) const API_PREFIX: &str = "/api/";

/// What the guard checks requests against.
#[derive(Debug)]
pub(crate) struct Gate {
    /// The `Host` values answered, lowercase: `ip:port` as bound, and
    /// `localhost:port` when that is loopback.
    hosts: Vec<String>,
    /// The session's token.
    token: SessionToken,
}

impl Gate {
    /// The gate of a console bound to `bound`, with `token`.
    pub(crate) fn new(bound: std::net::SocketAddr, token: SessionToken) -> Self {
        let mut hosts = vec![bound.to_string().to_ascii_lowercase()];
        if bound.ip().is_loopback() {
            hosts.push(format!("localhost:{}", bound.port()));
        }
        Gate { hosts, token }
    }

    fn host_allowed(&self, host: &str) -> bool {
        let host = host.trim().to_ascii_lowercase();
        self.hosts.contains(&host)
    }

    fn origin_allowed(&self, origin: &str) -> bool {
        origin.strip_prefix("http://").is_some_and(|host| self.host_allowed(host))
    }
}

/// `router` behind the gate, every answer with the console's headers.
pub(crate) fn guarded(router: axum::Router, gate: Arc<Gate>) -> axum::Router {
    // The fallback first: the layer then guards an unknown path's 404 too.
    router.fallback(|| async { StatusCode::NOT_FOUND }).layer(axum::middleware::from_fn_with_state(gate, guard))
}

async fn guard(State(gate): State<Arc<Gate>>, request: Request, next: Next) -> Response {
    let mut response = match refusal(&gate, &request) {
        Some(refused) => refused,
        None => next.run(request).await,
    };
    secure(response.headers_mut());
    response
}

/// Why `request` is refused, as the answer; `None` when it may go on.
fn refusal(gate: &Gate, request: &Request) -> Option<Response> {
    let headers = request.headers();
    let host = headers.get(header::HOST).and_then(|value| value.to_str().ok());
    if !host.is_some_and(|host| gate.host_allowed(host)) {
        tracing::warn!(host = host.unwrap_or(""), "console: a request for another host refused");
        return Some(refused("this console answers its own address only: open the URL it printed"));
    }
    if !request.uri().path().starts_with(API_PREFIX) {
        return None;
    }
    let origin = headers.get(header::ORIGIN).map(|value| value.to_str().unwrap_or(""));
    if origin.is_some_and(|origin| !gate.origin_allowed(origin)) {
        tracing::warn!(origin, "console: an API request from another origin refused");
        return Some(refused("the console's API answers its own page only"));
    }
    if !token_presented(gate, headers) {
        tracing::warn!(path = request.uri().path(), "console: an API request without the session token refused");
        return Some(refused("the console's API needs the session token its page carries: reload the page"));
    }
    None
}

fn token_presented(gate: &Gate, headers: &HeaderMap) -> bool {
    let mut presented = headers.get_all(TOKEN_HEADER).iter();
    match (presented.next(), presented.next()) {
        (Some(token), None) => gate.token.matches(token.as_bytes()),
        _ => false,
    }
}

/// A 403 answer saying why, as the API's errors are: `{"error": …}`.
fn refused(why: &str) -> Response {
    let body = serde_json::json!({ "error": why }).to_string();
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = StatusCode::FORBIDDEN;
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// The headers every answer carries; any CORS header a handler set is
/// taken out.
fn secure(headers: &mut HeaderMap) {
    let cors: Vec<header::HeaderName> =
        headers.keys().filter(|name| name.as_str().starts_with("access-control-")).cloned().collect();
    for name in cors {
        headers.remove(name);
    }
    headers.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CONTENT_SECURITY_POLICY));
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert("cross-origin-opener-policy", HeaderValue::from_static("same-origin"));
    headers.insert("cross-origin-resource-policy", HeaderValue::from_static("same-origin"));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate(bound: &str) -> Gate {
        Gate::new(bound.parse().unwrap(), SessionToken::new().unwrap())
    }

    #[test]
    fn only_the_bound_address_and_loopbacks_localhost_are_answered() {
        let gate = gate("127.0.0.1:4321");
        for host in ["127.0.0.1:4321", "localhost:4321", "LOCALHOST:4321", " 127.0.0.1:4321 "] {
            assert!(gate.host_allowed(host), "{host}");
        }
        for host in ["127.0.0.1", "127.0.0.1:4322", "localhost", "evil.example:4321", "127.0.0.1.nip.io:4321", ""] {
            assert!(!gate.host_allowed(host), "{host}");
        }
        let v6 = super::Gate::new("[::1]:80".parse().unwrap(), SessionToken::new().unwrap());
        assert!(v6.host_allowed("[::1]:80") && v6.host_allowed("localhost:80"));
        let lan = super::Gate::new("192.168.1.5:8080".parse().unwrap(), SessionToken::new().unwrap());
        assert!(lan.host_allowed("192.168.1.5:8080"));
        assert!(!lan.host_allowed("localhost:8080"), "not bound to loopback: localhost is another machine's name");
    }

    #[test]
    fn an_origin_must_be_the_consoles_own() {
        let gate = gate("127.0.0.1:4321");
        assert!(gate.origin_allowed("http://127.0.0.1:4321"));
        assert!(gate.origin_allowed("http://localhost:4321"));
        assert!(!gate.origin_allowed("https://127.0.0.1:4321"));
        assert!(!gate.origin_allowed("http://evil.example"));
        assert!(!gate.origin_allowed("null"));
    }
}
