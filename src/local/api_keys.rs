//! Supabase's API keys on the local server: an `sb_secret_…` and an
//! `sb_publishable_…` key beside the JWTs, and a gateway beneath
//! [`SUPABASE_REST_PATH`](super::SUPABASE_REST_PATH) that maps each to its
//! role as Supabase's does.
//!
//! Supabase's keys are not JWTs. Its gateway reads the `apikey` header (or
//! an `apikey` query parameter), and for an `sb_` key sends PostgREST a
//! short-lived JWT of the key's role: `service_role` for the secret key,
//! `anon` for the publishable one. This gateway does the same with the
//! stack's own JWTs, and refuses what Supabase's refuses, with 401:
//!
//! - a request beneath `/rest/v1` with no `apikey` (`No API key found in
//!   request`), an `sb_` key in `Authorization` alone included;
//! - an `sb_` key that is not one of the stack's (`Invalid API key`);
//! - an `sb_` key in `Authorization` other than the `apikey` beside it;
//! - the secret key from a browser (a `User-Agent` naming `Mozilla/`),
//!   since a secret key must never be shipped to one.
//!
//! A legacy key in `apikey` must be one of the project's (a JWT the stack
//! signed, of `anon` or `service_role`; else `Invalid API key`).
//! `Authorization` with a JWT (a signed-in user's, or a legacy key) is left
//! for the server to verify, as Supabase forwards it. The `apikey` query
//! parameter is taken off before the server sees it. The server's root
//! stays plain PostgREST, which knows nothing of `sb_` keys.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::jwt::{mint_stable_token, verified_role, SUPABASE_CLI_JWT_SECRET};
use crate::callers::route::same_secret;

/// The Supabase CLI's local secret key, as `supabase start` prints it:
/// public, the same on every machine. `idem up` hands it out beside the
/// CLI's JWT secret.
pub const SUPABASE_CLI_SECRET_KEY: &str = "sb_secret_N7UND0UgjKTVK-Uodkm0Hg_xSvEMPvz";

/// The Supabase CLI's local publishable key, as `supabase start` prints it.
pub const SUPABASE_CLI_PUBLISHABLE_KEY: &str = "sb_publishable_ACJWlzQHlZjBrEguHvfOxg_3BJgxAaH";

/// A stack's API keys and the JWTs its gateway swaps them for.
#[derive(Clone)]
pub(super) struct ApiKeys {
    pub(super) secret: String,
    pub(super) publishable: String,
    service_token: String,
    anon_token: String,
    /// What a legacy JWT key in `apikey` must be signed with.
    jwt_secret: String,
}

impl ApiKeys {
    /// The keys of a server signing with `jwt_secret`: the Supabase CLI's
    /// with its secret, else keys derived from the secret (the same on every
    /// start with the same secret, unguessable with a random one).
    pub(super) fn for_jwt_secret(jwt_secret: &str) -> ApiKeys {
        let (secret, publishable) = if jwt_secret == SUPABASE_CLI_JWT_SECRET {
            (SUPABASE_CLI_SECRET_KEY.to_owned(), SUPABASE_CLI_PUBLISHABLE_KEY.to_owned())
        } else {
            (derived(jwt_secret, "sb_secret_"), derived(jwt_secret, "sb_publishable_"))
        };
        ApiKeys {
            secret,
            publishable,
            service_token: mint_stable_token(jwt_secret, "service_role"),
            anon_token: mint_stable_token(jwt_secret, "anon"),
            jwt_secret: jwt_secret.to_owned(),
        }
    }
}

/// `prefix` and 32 base64url characters of HMAC-SHA256(`jwt_secret`, `prefix`).
fn derived(jwt_secret: &str, prefix: &str) -> String {
    // HMAC accepts a key of any length, so this cannot fail.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(jwt_secret.as_bytes())
        .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
    mac.update(prefix.as_bytes());
    let digest = URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes());
    format!("{prefix}{}", &digest[..32])
}

/// `router` behind the gateway (meant for the `/rest/v1` copy of the API).
pub(super) fn behind_gateway(router: axum::Router, keys: ApiKeys) -> axum::Router {
    router.layer(axum::middleware::from_fn_with_state(Arc::new(keys), gateway))
}

async fn gateway(State(keys): State<Arc<ApiKeys>>, mut request: Request, next: Next) -> Response {
    let headers = request.headers();
    let text = |name: header::HeaderName| headers.get(name).and_then(|value| value.to_str().ok()).map(str::to_owned);
    let apikey = text(header::HeaderName::from_static("apikey")).or_else(|| query_apikey(request.uri().query()));
    let bearer = text(header::AUTHORIZATION).and_then(|value| {
        let (scheme, token) = value.split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then(|| token.trim().to_owned())
    });
    let browser = text(header::USER_AGENT).is_some_and(|agent| agent.contains("Mozilla/"));
    let Some(apikey) = apikey.filter(|key| !key.is_empty()) else {
        return refusal(
            "UNAUTHORIZED_MISSING_API_KEY",
            "No API key found in request",
            "No `apikey` request header or url param was found.",
        );
    };
    if !apikey.starts_with("sb_") {
        // A legacy key must be one of the project's: a JWT it signed, of the
        // anon or service_role role. The server then verifies what
        // Authorization carries.
        let role = verified_role(&keys.jwt_secret, &apikey);
        if !role.is_some_and(|role| role == "anon" || role == "service_role") {
            return refusal("UNAUTHORIZED_INVALID_API_KEY", "Invalid API key", "Double check your API key.");
        }
        strip_apikey_parameter(&mut request);
        return next.run(request).await;
    }
    let token = if same_secret(apikey.as_bytes(), keys.secret.as_bytes()) {
        if browser {
            return refusal(
                "UNAUTHORIZED_FORBIDDEN_SECRET_KEY_IN_BROWSER",
                "Forbidden use of secret API key in browser",
                "Secret API keys can only be used in a protected environment and should never be used in a browser.",
            );
        }
        &keys.service_token
    } else if same_secret(apikey.as_bytes(), keys.publishable.as_bytes()) {
        &keys.anon_token
    } else {
        return refusal("UNAUTHORIZED_INVALID_API_KEY", "Invalid API key", "Double check your API key.");
    };
    // Taken off before the server sees it, as Supabase's gateway does: to
    // PostgREST a query parameter is a filter.
    strip_apikey_parameter(&mut request);
    match bearer {
        // A signed-in user's JWT rides beside the key: the server verifies it.
        Some(bearer) if !bearer.starts_with("sb_") => {}
        // The key itself again (supabase-js sends it so), or nothing: the key's role.
        Some(bearer) if bearer == apikey => set_bearer(&mut request, token),
        None => set_bearer(&mut request, token),
        Some(_) => {
            return refusal(
                "UNAUTHORIZED_INVALID_API_KEY",
                "Invalid API key",
                "An sb_ key in Authorization must be the apikey itself.",
            )
        }
    }
    next.run(request).await
}

/// The `apikey` query parameter, decoded.
fn query_apikey(query: Option<&str>) -> Option<String> {
    url::form_urlencoded::parse(query?.as_bytes()).find(|(name, _)| name == "apikey").map(|(_, value)| value.into())
}

/// `request` without its `apikey` query parameter, however its name is
/// percent-encoded (the rest kept in order, as sent).
fn strip_apikey_parameter(request: &mut Request) {
    let Some(query) = request.uri().query() else { return };
    let is_apikey = |pair: &&str| url::form_urlencoded::parse(pair.as_bytes()).any(|(name, _)| name == "apikey");
    if !query.split('&').any(|pair| is_apikey(&pair)) {
        return;
    }
    let kept: Vec<&str> = query.split('&').filter(|pair| !is_apikey(pair)).collect();
    let path = request.uri().path();
    let path_and_query = if kept.is_empty() { path.to_owned() } else { format!("{path}?{}", kept.join("&")) };
    let mut parts = request.uri().clone().into_parts();
    if let Ok(path_and_query) = path_and_query.parse() {
        parts.path_and_query = Some(path_and_query);
        if let Ok(uri) = axum::http::Uri::from_parts(parts) {
            *request.uri_mut() = uri;
        }
    }
}

fn set_bearer(request: &mut Request, token: &str) {
    if let Ok(value) = HeaderValue::from_str(&format!("Bearer {token}")) {
        request.headers_mut().insert(header::AUTHORIZATION, value);
    }
}

/// Supabase's gateway's refusal: 401, `{"message", "hint"}` and the
/// `sb-error-code` header.
fn refusal(code: &'static str, message: &str, hint: &str) -> Response {
    tracing::warn!(code, "local gateway: a request refused");
    let body = serde_json::json!({"message": message, "hint": hint});
    let mut response = Response::new(Body::from(body.to_string()));
    *response.status_mut() = StatusCode::UNAUTHORIZED;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert("sb-error-code", HeaderValue::from_static(code));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cli_secret_gives_the_clis_keys_and_any_other_secret_its_own() {
        let cli = ApiKeys::for_jwt_secret(SUPABASE_CLI_JWT_SECRET);
        assert_eq!(
            (cli.secret.as_str(), cli.publishable.as_str()),
            (SUPABASE_CLI_SECRET_KEY, SUPABASE_CLI_PUBLISHABLE_KEY)
        );
        let one = ApiKeys::for_jwt_secret("a-secret-of-at-least-thirty-two-bytes!!");
        let again = ApiKeys::for_jwt_secret("a-secret-of-at-least-thirty-two-bytes!!");
        let other = ApiKeys::for_jwt_secret("another-secret-of-at-least-thirty-two-bytes");
        assert_eq!(
            (one.secret.as_str(), one.publishable.as_str()),
            (again.secret.as_str(), again.publishable.as_str())
        );
        assert_ne!(one.secret, other.secret);
        assert!(one.secret.starts_with("sb_secret_") && one.secret.len() == "sb_secret_".len() + 32);
        assert!(one.publishable.starts_with("sb_publishable_"));
    }

    #[test]
    fn the_apikey_query_parameter_is_read_decoded() {
        assert_eq!(query_apikey(Some("select=id&apikey=sb_secret_a%2Db")).as_deref(), Some("sb_secret_a-b"));
        assert_eq!(query_apikey(Some("select=id")), None);
        assert_eq!(query_apikey(None), None);
    }
}
