//! What the local server lets in, in front of the PostgREST-compatible
//! router.
//!
//! The stack may sign with a public JWT secret, so anyone who reaches the
//! port can mint a token. Three doors stay shut all the same:
//!
//! - **Host.** Only requests whose `Host` names loopback (`127.0.0.1`,
//!   `localhost`, `[::1]`, any port) or a host the caller allowed are
//!   answered; anything else gets 403. A web page that learns the port
//!   cannot reach the server through a name of its own that resolves to
//!   127.0.0.1 (DNS rebinding).
//! - **Roles.** A token may name `anon`, `authenticated` or `service_role`
//!   only, as Supabase issues; any other role (`postgres`, say) is refused
//!   with 401 before the server switches to it.
//! - **CORS.** No `Access-Control-*` header is sent unless origins were
//!   configured, and then only the server's own answer for those origins:
//!   a browser page elsewhere can neither preflight nor read an answer.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;

use super::config::LocalStackConfig;

/// The roles a token may name: the ones Supabase's keys and sessions carry.
pub(super) const API_ROLES: [&str; 3] = ["anon", "authenticated", "service_role"];

/// The loopback host names every stack answers.
const LOOPBACK_HOSTS: [&str; 3] = ["127.0.0.1", "localhost", "[::1]"];

#[derive(Debug)]
struct Policy {
    /// Extra hosts, lowercase, each with or without a port.
    allowed_hosts: Vec<String>,
    /// Whether CORS origins were configured (the server then answers them).
    cors: bool,
}

/// `router` behind the guard.
pub(super) fn guarded(router: axum::Router, config: &LocalStackConfig) -> axum::Router {
    let policy = Arc::new(Policy {
        allowed_hosts: config.allowed_hosts.iter().map(|host| host.trim().to_ascii_lowercase()).collect(),
        cors: !config.cors_origins.is_empty(),
    });
    router.layer(axum::middleware::from_fn_with_state(policy, guard))
}

async fn guard(State(policy): State<Arc<Policy>>, request: Request, next: Next) -> Response {
    let host = request.headers().get(header::HOST).and_then(|value| value.to_str().ok()).map(str::to_owned);
    let host = host.or_else(|| request.uri().authority().map(|authority| authority.to_string()));
    if !host.as_deref().is_some_and(|host| host_allowed(host, &policy.allowed_hosts)) {
        tracing::warn!(host = host.as_deref().unwrap_or(""), "local server: a request for another host refused");
        return refusal(
            StatusCode::FORBIDDEN,
            "IDEMHOST",
            "this local server answers loopback hosts only (127.0.0.1, localhost, [::1])",
            "reach it at the URL idem up printed, or allow the host (idem up --allow-host)",
        );
    }
    if let Some(role) = token_role(request.headers()).filter(|role| !API_ROLES.contains(&role.as_str())) {
        tracing::warn!(%role, "local server: a token naming a role other than the API roles refused");
        return refusal(
            StatusCode::UNAUTHORIZED,
            "PGRST301",
            "the token's role is not one this server serves: only anon, authenticated and service_role",
            "use the service key or the anon key idem up printed",
        );
    }
    let mut response = next.run(request).await;
    if !policy.cors {
        let cors: Vec<header::HeaderName> =
            response.headers().keys().filter(|name| name.as_str().starts_with("access-control-")).cloned().collect();
        for name in cors {
            response.headers_mut().remove(name);
        }
    }
    response
}

/// Whether `host` (a `Host` header: a name or address, with or without a
/// port) is loopback's or one of `allowed`.
fn host_allowed(host: &str, allowed: &[String]) -> bool {
    let host = host.trim().to_ascii_lowercase();
    let name = match host.rsplit_once(':') {
        // `[::1]:8080`, `[::1]`, `name:8080`; a bare IPv6 address is not a Host.
        Some((name, port)) if !name.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) && !port.is_empty() => name,
        _ => host.as_str(),
    };
    LOOPBACK_HOSTS.contains(&name) || allowed.iter().any(|allowed| *allowed == host || *allowed == name)
}

/// The `role` claim of the bearer token, when the token carries one that
/// is a string. Only read, never trusted: the server still verifies the
/// signature; a token that does not decode is left for it to refuse.
fn token_role(headers: &HeaderMap) -> Option<String> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    let (scheme, token) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let payload = token.trim().split('.').nth(1)?;
    let claims: serde_json::Value = serde_json::from_slice(&URL_SAFE_NO_PAD.decode(payload).ok()?).ok()?;
    match claims.get("role")? {
        serde_json::Value::String(role) => Some(role.clone()),
        // A role that is not a string is not an API role either.
        other => Some(other.to_string()),
    }
}

/// A PostgREST-shaped error answer.
fn refusal(status: StatusCode, code: &str, message: &str, hint: &str) -> Response {
    let body = serde_json::json!({"code": code, "message": message, "details": null, "hint": hint});
    let mut response = Response::new(Body::from(body.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json; charset=utf-8"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_hosts_with_any_port_and_allowed_hosts_pass_and_nothing_else() {
        let none: Vec<String> = Vec::new();
        for host in ["127.0.0.1:4321", "127.0.0.1", "LOCALHOST:80", "localhost", "[::1]:4321", "[::1]"] {
            assert!(host_allowed(host, &none), "{host}");
        }
        for host in ["evil.example:4321", "127.0.0.1.nip.io:4321", "localhost.evil.example", "::1", "", "127.0.0.2"] {
            assert!(!host_allowed(host, &none), "{host}");
        }
        let allowed = vec!["devbox.internal".to_owned(), "other:8080".to_owned()];
        assert!(host_allowed("devbox.internal:4321", &allowed));
        assert!(host_allowed("other:8080", &allowed));
        assert!(!host_allowed("other:9090", &allowed));
    }

    #[test]
    fn the_role_is_read_from_a_bearer_tokens_claims_only() {
        let token = |claims: &str| format!("Bearer h.{}.s", URL_SAFE_NO_PAD.encode(claims));
        let role_of = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::AUTHORIZATION, HeaderValue::from_str(value).unwrap());
            token_role(&headers)
        };
        assert_eq!(role_of(&token(r#"{"role":"postgres"}"#)).as_deref(), Some("postgres"));
        assert_eq!(role_of(&token(r#"{"role":["service_role"]}"#)).as_deref(), Some(r#"["service_role"]"#));
        assert_eq!(role_of(&token(r#"{"sub":"x"}"#)), None, "no role: the anonymous role");
        assert_eq!(role_of("Basic abc"), None);
        assert_eq!(role_of("Bearer not-a-jwt"), None);
    }
}
