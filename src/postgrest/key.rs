//! Service keys and what stands in front of PostgREST: which kind a key is
//! by its shape, which gateway a URL shows, and why a key is refused.

use url::Url;

/// What a key is, judged by its shape alone (nothing is decoded or verified).
///
/// Supabase's keys: a secret key `sb_secret_…` (elevated: the
/// `service_role`), a publishable key `sb_publishable_…` (the `anon` role,
/// safe to ship to browsers, never a service key), and the legacy JWT keys
/// `anon` and `service_role`. Plain PostgREST takes a JWT signed with its
/// own secret.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyKind {
    /// A Supabase secret key, `sb_secret_…`. Not a JWT: only Supabase's
    /// gateway understands it, and exchanges it for a `service_role` token.
    Secret,
    /// A Supabase publishable key, `sb_publishable_…`: the `anon` role.
    /// Refused wherever a service key is needed.
    Publishable,
    /// A JWT (three base64url parts): Supabase's legacy `service_role` key,
    /// or a token signed with plain PostgREST's secret.
    Jwt,
    /// Anything else; sent as it is.
    Other,
}

impl KeyKind {
    /// The kind of `key`, by its prefix or its three-part JWT shape.
    pub fn of(key: &str) -> KeyKind {
        if key.starts_with("sb_secret_") {
            KeyKind::Secret
        } else if key.starts_with("sb_publishable_") {
            KeyKind::Publishable
        } else if is_jwt_shaped(key) {
            KeyKind::Jwt
        } else {
            KeyKind::Other
        }
    }

    /// A short name for messages: `secret key (sb_secret_…)`, `publishable
    /// key (sb_publishable_…)`, `JWT`, `key of no known shape`.
    pub fn describe(self) -> &'static str {
        match self {
            KeyKind::Secret => "secret key (sb_secret_…)",
            KeyKind::Publishable => "publishable key (sb_publishable_…)",
            KeyKind::Jwt => "JWT",
            KeyKind::Other => "key of no known shape",
        }
    }

    /// Whether this is one of Supabase's opaque `sb_` keys, which are not
    /// JWTs: they travel in `apikey` alone.
    pub(super) fn is_supabase_api_key(self) -> bool {
        matches!(self, KeyKind::Secret | KeyKind::Publishable)
    }
}

/// Three non-empty base64url segments separated by dots.
fn is_jwt_shaped(key: &str) -> bool {
    let segments: Vec<&str> = key.split('.').collect();
    segments.len() == 3
        && segments.iter().all(|segment| {
            !segment.is_empty() && segment.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

/// What stands in front of PostgREST, which decides the headers a key
/// travels in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Gateway {
    /// PostgREST itself: a JWT goes in `Authorization: Bearer` only
    /// (unless an `apikey` was set). An `sb_secret_…` key goes in `apikey`
    /// whatever the gateway: only Supabase's understands it.
    Plain,
    /// Supabase's API gateway, which reads the key from `apikey`: an `sb_`
    /// key travels there alone, a JWT there and in `Authorization: Bearer`,
    /// as supabase-js sends it.
    Supabase,
}

impl Gateway {
    /// [`Gateway::Supabase`] for a hosted Supabase project's URL (a host
    /// under `supabase.co`), else [`Gateway::Plain`]. A Supabase behind a
    /// custom domain or the local Supabase CLI is not recognisable by its
    /// URL: use `SUPABASE_URL`, `IDEM_APIKEY` or
    /// [`ClientConfig::with_gateway`](super::ClientConfig::with_gateway).
    pub fn of_url(url: &Url) -> Gateway {
        match url.host_str() {
            Some(host) if host.to_ascii_lowercase().trim_end_matches('.').ends_with(".supabase.co") => {
                Gateway::Supabase
            }
            _ => Gateway::Plain,
        }
    }
}

/// Why a service key was refused before any request. Never carries the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// A URL is set but none of the service key variables is.
    #[error("a PostgREST URL is set but no service key: set one of {variables}")]
    Missing {
        /// The variables looked at, in order of precedence.
        variables: String,
    },
    /// A publishable key where a service key is needed: it reaches only
    /// the `anon` role, which may not execute the plane's functions.
    #[error(
        "{variable} holds a publishable key (sb_publishable_…), which reaches only the anon role; \
         the plane needs a secret key (sb_secret_…, as in SUPABASE_SECRET_KEYS) or the legacy service_role key"
    )]
    Publishable {
        /// Where the key came from: a variable's name, or `the service key`.
        variable: &'static str,
    },
    /// A variable holding a key of another kind than its name promises.
    #[error("{variable} should hold a {}, but holds a {}", expected.describe(), found.describe())]
    WrongKind {
        /// The variable.
        variable: &'static str,
        /// The kind it should hold.
        expected: KeyKind,
        /// The kind it holds.
        found: KeyKind,
    },
    /// An `sb_` service key with a different `apikey`: an `sb_` key travels
    /// in `apikey` itself, so the two cannot both be sent.
    #[error(
        "the apikey (IDEM_APIKEY) differs from the sb_ service key, which travels in the apikey header itself; \
         leave IDEM_APIKEY unset, or set it to the same key"
    )]
    ApikeyDiffers,
    /// `SUPABASE_SECRET_KEYS` is not a JSON object of strings, as Supabase
    /// sets it (`{"default": "sb_secret_…"}`). Never carries its value.
    #[error(
        "{variable} is not a JSON object of key names to keys (as Supabase sets it: {{\"default\": \"sb_secret_…\"}})"
    )]
    SecretKeysMalformed {
        /// The variable.
        variable: &'static str,
    },
    /// `SUPABASE_SECRET_KEYS` holds no key by the name looked for: `default`,
    /// or the one `IDEM_SECRET_KEY_NAME` names.
    #[error("{variable} has no key named {name:?} (it names {}); set IDEM_SECRET_KEY_NAME to one of them", if available.is_empty() { "none".to_owned() } else { available.join(", ") })]
    SecretKeyNotFound {
        /// The variable.
        variable: &'static str,
        /// The name looked for.
        name: String,
        /// The names it holds (names only, never keys).
        available: Vec<String>,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    const JWT: &str = "eyJhbGciOiJIUzI1NiJ9.eyJyb2xlIjoic2VydmljZV9yb2xlIn0.c2lnbmF0dXJl";
    const SECRET: &str = "sb_secret_0123456789abcdef";
    const PUBLISHABLE: &str = "sb_publishable_0123456789abcdef";

    #[test]
    fn keys_are_told_apart_by_their_shape() {
        assert_eq!(KeyKind::of(SECRET), KeyKind::Secret);
        assert_eq!(KeyKind::of(PUBLISHABLE), KeyKind::Publishable);
        assert_eq!(KeyKind::of(JWT), KeyKind::Jwt);
        for other in ["service-key", "a.b", "a..c", "a.b.c.d", "a.b.c=", "sb_secre_x"] {
            assert_eq!(KeyKind::of(other), KeyKind::Other, "{other}");
        }
    }

    #[test]
    fn a_hosted_supabase_url_is_recognised_by_its_host_alone() {
        let gateway = |url: &str| Gateway::of_url(&Url::parse(url).unwrap());
        assert_eq!(gateway("https://abcdefgh.supabase.co/rest/v1"), Gateway::Supabase);
        assert_eq!(gateway("https://ABCDEFGH.Supabase.CO/rest/v1/"), Gateway::Supabase);
        assert_eq!(gateway("https://abcdefgh.supabase.co./rest/v1"), Gateway::Supabase);
        assert_eq!(gateway("http://localhost:3000"), Gateway::Plain);
        assert_eq!(gateway("http://127.0.0.1:54321/rest/v1"), Gateway::Plain);
        assert_eq!(gateway("https://supabase.co.example.com/rest/v1"), Gateway::Plain);
        assert_eq!(gateway("https://notsupabase.co/rest/v1"), Gateway::Plain);
    }
}
