//! A worker's own scheduled routes (a re-drive, a queue drain): who may call
//! them, from the environment, checked in constant time. The TypeScript
//! client's `routeCredentials` and `callerAuthorized` do the same for an
//! Edge Function.
//!
//! A pg_cron job sends the route secret ([`ROUTE_SECRET_VAR`], kept in
//! Vault), never the service key, which would sit in pg_net's request queue
//! where any database role can read it; an operator's `idem redrive --to`
//! sends a service key. So a route lets in the secret and every service key
//! its environment holds.
//!
//! ```
//! use idempotency_plane::callers::route::{caller_authorized, route_credentials};
//! use reqwest::header::{HeaderMap, HeaderValue};
//!
//! let secret = "a-random-route-secret-of-32-chars!";
//! let env = [("IDEM_ROUTE_SECRET", secret), ("SUPABASE_SECRET_KEYS", r#"{"default":"sb_secret_k"}"#)];
//! let credentials = route_credentials(|name| env.iter().find(|(n, _)| *n == name).map(|(_, v)| v.to_string()))?;
//! let mut headers = HeaderMap::new();
//! headers.insert("authorization", HeaderValue::from_str(&format!("Bearer {secret}"))?);
//! assert!(caller_authorized(&headers, &credentials));
//! headers.clear();
//! headers.insert("apikey", HeaderValue::from_static("sb_secret_k"));
//! assert!(caller_authorized(&headers, &credentials));
//! headers.insert("apikey", HeaderValue::from_static("sb_secret_guess"));
//! assert!(!caller_authorized(&headers, &credentials));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use reqwest::header::HeaderMap;
use subtle::ConstantTimeEq;

use crate::postgrest::service_keys_in;

/// The variable holding a route's own secret: what a scheduled job sends.
pub const ROUTE_SECRET_VAR: &str = "IDEM_ROUTE_SECRET";

/// The shortest route secret accepted, in characters.
pub const MIN_ROUTE_SECRET_CHARS: usize = 32;

/// The route secret is set but too short to be a random secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{ROUTE_SECRET_VAR} must be at least {MIN_ROUTE_SECRET_CHARS} characters (a random secret), got {0}")]
pub struct RouteSecretTooShort(pub usize);

/// Who may call a worker's scheduled routes, from `var` (a variable's value
/// by name; empty counts as unset): the route secret when set, then every
/// service key the environment holds ([`service_keys_in`]). Never an empty
/// string; an empty list lets nobody in.
pub fn route_credentials(var: impl Fn(&str) -> Option<String>) -> Result<Vec<String>, RouteSecretTooShort> {
    let var = |name: &str| var(name).filter(|value| !value.is_empty());
    let mut credentials = Vec::new();
    if let Some(secret) = var(ROUTE_SECRET_VAR) {
        let chars = secret.chars().count();
        if chars < MIN_ROUTE_SECRET_CHARS {
            return Err(RouteSecretTooShort(chars));
        }
        credentials.push(secret);
    }
    credentials.extend(service_keys_in(var));
    Ok(credentials)
}

/// [`route_credentials`] over the process environment.
pub fn route_credentials_from_env() -> Result<Vec<String>, RouteSecretTooShort> {
    route_credentials(|name| std::env::var(name).ok())
}

/// Whether the request carries one of `credentials`, as `Authorization:
/// Bearer <credential>` or as `apikey: <credential>` (where an `sb_` key
/// travels). Every credential is compared with every value offered, each in
/// time that does not depend on where a guess differs.
pub fn caller_authorized(headers: &HeaderMap, credentials: &[String]) -> bool {
    let text = |name: &str| headers.get(name).and_then(|value| value.to_str().ok());
    let bearer = text("authorization").and_then(|value| {
        let (scheme, token) = value.split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
    });
    let offered = [bearer, text("apikey")];
    let mut matched = false;
    for credential in credentials.iter().filter(|credential| !credential.is_empty()) {
        for value in offered.iter().flatten() {
            matched |= same_secret(value.as_bytes(), credential.as_bytes());
        }
    }
    matched
}

/// `a == b`, in time that depends on their lengths alone (`subtle`'s
/// constant-time comparison): for secrets a caller presents.
pub fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.ct_eq(b).into()
}

#[cfg(test)]
mod tests {
    use reqwest::header::HeaderValue;

    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        |name| vars.iter().find(|(n, _)| *n == name).map(|(_, v)| (*v).to_owned())
    }

    #[test]
    fn a_route_takes_its_secret_and_every_service_key_but_no_publishable_one() {
        let vars = [
            ("IDEM_ROUTE_SECRET", "0123456789abcdef0123456789abcdef"),
            ("SUPABASE_SECRET_KEYS", r#"{"default":"sb_secret_a","ops":"sb_secret_b"}"#),
            ("SUPABASE_SERVICE_ROLE_KEY", "eyJ.legacy.jwt"),
            ("IDEM_SERVICE_KEY", "sb_publishable_oops"),
        ];
        let mut credentials = route_credentials(env(&vars)).expect("credentials");
        credentials.sort();
        assert_eq!(credentials, ["0123456789abcdef0123456789abcdef", "eyJ.legacy.jwt", "sb_secret_a", "sb_secret_b"]);
    }

    #[test]
    fn a_short_route_secret_is_refused_and_none_lets_only_the_keys_in() {
        assert_eq!(route_credentials(env(&[("IDEM_ROUTE_SECRET", "short")])), Err(RouteSecretTooShort(5)));
        assert_eq!(route_credentials(env(&[("IDEM_ROUTE_SECRET", "")])), Ok(Vec::new()));
    }

    #[test]
    fn a_caller_is_let_in_by_bearer_or_apikey_and_by_nothing_else() {
        let credentials = vec!["sb_secret_k".to_owned(), String::new()];
        let mut headers = HeaderMap::new();
        assert!(!caller_authorized(&headers, &credentials), "nothing offered");
        headers.insert("authorization", HeaderValue::from_static("bearer sb_secret_k"));
        assert!(caller_authorized(&headers, &credentials));
        headers.insert("authorization", HeaderValue::from_static("Basic sb_secret_k"));
        assert!(!caller_authorized(&headers, &credentials), "another scheme");
        headers.insert("apikey", HeaderValue::from_static("sb_secret_k"));
        assert!(caller_authorized(&headers, &credentials));
        headers.insert("apikey", HeaderValue::from_static(""));
        assert!(!caller_authorized(&headers, &credentials), "an empty credential lets nobody in");
        assert!(!caller_authorized(&headers, &[]), "no credentials, nobody");
    }

    #[test]
    fn secrets_compare_equal_only_when_equal() {
        assert!(same_secret(b"sb_x", b"sb_x"));
        assert!(!same_secret(b"sb_x", b"sb_y"));
        assert!(!same_secret(b"a", b"ab"));
    }
}
