//! The client's configuration read from environment variables: where the
//! server is, which variable holds the service key, and its `apikey`.

use super::config::{ClientConfig, PLAIN_HTTP_HOSTS_VAR};
use super::error::ClientError;
use super::key::{Gateway, KeyError, KeyKind};

/// The variables [`ClientConfig::from_env`] reads a service key from, in
/// order of precedence: the first one set wins.
///
/// `IDEM_SERVICE_KEY` is this crate's own and overrides the platform's;
/// `SUPABASE_SECRET_KEY` (`sb_secret_…`) is today's Supabase key;
/// `SUPABASE_SERVICE_ROLE_KEY` is the legacy `service_role` JWT, which
/// Supabase is retiring (and which its Edge Functions export by default,
/// so it must not win over a key chosen on purpose).
pub const SERVICE_KEY_VARIABLES: [&str; 3] = ["IDEM_SERVICE_KEY", "SUPABASE_SECRET_KEY", "SUPABASE_SERVICE_ROLE_KEY"];

impl ClientConfig {
    /// [`from_vars`](Self::from_vars) over the process environment.
    pub fn from_env() -> Result<Option<Self>, ClientError> {
        ClientConfig::from_vars(|name| std::env::var(name).ok())
    }

    /// Reads the configuration from `var` (a variable's value by name; an
    /// empty value counts as unset). `Ok(None)` when no URL is set.
    ///
    /// - the URL: `IDEM_POSTGREST_URL`, else `SUPABASE_URL` with `/rest/v1`
    ///   added. `SUPABASE_URL`, or a `*.supabase.co` host, means Supabase's
    ///   gateway: the key is sent as `apikey` too.
    /// - the service key: the first set of [`SERVICE_KEY_VARIABLES`]
    ///   (`IDEM_SERVICE_KEY`, `SUPABASE_SECRET_KEY`,
    ///   `SUPABASE_SERVICE_ROLE_KEY`). A publishable key is refused in any
    ///   of them; `SUPABASE_SECRET_KEY` must hold an `sb_secret_…` key and
    ///   `SUPABASE_SERVICE_ROLE_KEY` a JWT or an `sb_secret_…` key
    ///   ([`KeyError`]).
    /// - `IDEM_APIKEY`: the `apikey` header, replacing the default one.
    /// - `IDEM_MAX_ROWS`: the server's row cap.
    /// - `IDEM_ALLOW_PLAIN_HTTP`: hosts, comma-separated, that may be reached
    ///   over plain `http://` besides loopback ([`PLAIN_HTTP_HOSTS_VAR`]).
    ///
    /// Testable without touching the process environment:
    ///
    /// ```
    /// # use idempotency_plane::postgrest::{ClientConfig, KeyKind};
    /// let vars = [("SUPABASE_URL", "https://abcd.supabase.co"), ("SUPABASE_SECRET_KEY", "sb_secret_x")];
    /// let lookup = |name: &str| vars.iter().find(|(n, _)| *n == name).map(|(_, v)| v.to_string());
    /// let config = ClientConfig::from_vars(lookup)?.expect("a URL is set");
    /// assert_eq!(config.key_kind(), KeyKind::Secret);
    /// assert_eq!(config.key_variable(), Some("SUPABASE_SECRET_KEY"));
    /// assert!(config.sends_apikey());
    /// # Ok::<(), idempotency_plane::ClientError>(())
    /// ```
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Self>, ClientError> {
        let var = |name: &str| var(name).filter(|v| !v.is_empty());
        let supabase = var("SUPABASE_URL");
        let url = match (var("IDEM_POSTGREST_URL"), &supabase) {
            (Some(url), _) => url,
            (None, Some(project)) => format!("{}/rest/v1", project.trim_end_matches('/')),
            (None, None) => return Ok(None),
        };
        let (variable, key) = SERVICE_KEY_VARIABLES
            .iter()
            .find_map(|&name| var(name).map(|key| (name, key)))
            .ok_or(KeyError::Missing { variables: SERVICE_KEY_VARIABLES.join(" / ") })?;
        let kind = KeyKind::of(&key);
        let expected: &[KeyKind] = match variable {
            "SUPABASE_SECRET_KEY" => &[KeyKind::Secret],
            "SUPABASE_SERVICE_ROLE_KEY" => &[KeyKind::Jwt, KeyKind::Secret],
            _ => &[KeyKind::Secret, KeyKind::Jwt, KeyKind::Other],
        };
        if kind == KeyKind::Publishable {
            return Err(KeyError::Publishable { variable }.into());
        }
        if !expected.contains(&kind) {
            return Err(KeyError::WrongKind { variable, expected: expected[0], found: kind }.into());
        }
        let plain_http = var(PLAIN_HTTP_HOSTS_VAR).unwrap_or_default();
        let plain_http: Vec<&str> = plain_http.split(',').map(str::trim).filter(|host| !host.is_empty()).collect();
        let mut config = ClientConfig::new_allowing_plain_http(&url, key, &plain_http)?;
        config.key_variable = Some(variable);
        if supabase.is_some() {
            config.gateway = Gateway::Supabase;
        }
        config.apikey = var("IDEM_APIKEY");
        if let Some(rows) = var("IDEM_MAX_ROWS") {
            let rows =
                rows.parse().map_err(|_| ClientError::Config(format!("IDEM_MAX_ROWS {rows:?} is not a number")))?;
            config = config.with_max_rows(rows)?;
        }
        // Refuse a combination Supabase's gateway would refuse, before any request.
        config.auth_headers()?;
        tracing::debug!(variable, kind = kind.describe(), apikey = config.sends_apikey(), "service key chosen");
        Ok(Some(config))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const JWT: &str = "eyJhbGciOiJIUzI1NiJ9.eyJyb2xlIjoic2VydmljZV9yb2xlIn0.c2lnbmF0dXJl";
    const SECRET: &str = "sb_secret_0123456789abcdef";
    const PUBLISHABLE: &str = "sb_publishable_0123456789abcdef";

    /// `from_vars` over a fixed set of variables: no process environment.
    fn from(vars: &[(&str, &str)]) -> Result<Option<ClientConfig>, ClientError> {
        ClientConfig::from_vars(|name| vars.iter().find(|(n, _)| *n == name).map(|(_, v)| (*v).to_owned()))
    }

    fn configured(vars: &[(&str, &str)]) -> ClientConfig {
        from(vars).expect("a valid configuration").expect("a URL is set")
    }

    /// `(Authorization, apikey)` as they would be sent.
    fn headers(config: &ClientConfig) -> (String, Option<String>) {
        let auth = config.auth_headers().expect("headers");
        (auth.authorization, auth.apikey)
    }

    #[test]
    fn no_url_is_no_configuration_and_a_url_without_a_key_is_refused() {
        assert!(from(&[("IDEM_SERVICE_KEY", JWT)]).unwrap().is_none());
        assert!(from(&[("SUPABASE_URL", ""), ("IDEM_POSTGREST_URL", "")]).unwrap().is_none(), "empty is unset");
        let missing = from(&[("SUPABASE_URL", "https://abcdefgh.supabase.co")]).unwrap_err();
        assert!(matches!(&missing, ClientError::Key(KeyError::Missing { .. })), "{missing:?}");
        let message = missing.to_string();
        for variable in SERVICE_KEY_VARIABLES {
            assert!(message.contains(variable), "{message}");
        }
    }

    #[test]
    fn the_service_key_variables_take_precedence_in_their_documented_order() {
        let url = ("SUPABASE_URL", "https://abcdefgh.supabase.co");
        let all = [url, ("IDEM_SERVICE_KEY", JWT), ("SUPABASE_SECRET_KEY", SECRET), ("SUPABASE_SERVICE_ROLE_KEY", JWT)];
        assert_eq!(configured(&all).key_variable(), Some("IDEM_SERVICE_KEY"));
        let platform = [url, ("SUPABASE_SECRET_KEY", SECRET), ("SUPABASE_SERVICE_ROLE_KEY", JWT)];
        let config = configured(&platform);
        assert_eq!((config.key_variable(), config.key_kind()), (Some("SUPABASE_SECRET_KEY"), KeyKind::Secret));
        let legacy = configured(&[url, ("SUPABASE_SERVICE_ROLE_KEY", JWT)]);
        assert_eq!((legacy.key_variable(), legacy.key_kind()), (Some("SUPABASE_SERVICE_ROLE_KEY"), KeyKind::Jwt));
        // An empty variable is unset: the next one is read.
        let empty = configured(&[url, ("IDEM_SERVICE_KEY", ""), ("SUPABASE_SECRET_KEY", SECRET)]);
        assert_eq!(empty.key_variable(), Some("SUPABASE_SECRET_KEY"));
    }

    #[test]
    fn a_publishable_key_or_a_key_of_the_wrong_kind_is_refused_naming_the_variable() {
        let url = ("SUPABASE_URL", "https://abcdefgh.supabase.co");
        for variable in SERVICE_KEY_VARIABLES {
            let refused = from(&[url, (variable, PUBLISHABLE)]).unwrap_err();
            assert!(
                matches!(&refused, ClientError::Key(KeyError::Publishable { variable: v }) if *v == variable),
                "{refused:?}"
            );
            assert!(!refused.to_string().contains(PUBLISHABLE), "the key itself is never printed: {refused}");
        }
        let jwt_as_secret = from(&[url, ("SUPABASE_SECRET_KEY", JWT)]).unwrap_err();
        assert!(
            matches!(
                jwt_as_secret,
                ClientError::Key(KeyError::WrongKind {
                    variable: "SUPABASE_SECRET_KEY",
                    expected: KeyKind::Secret,
                    found: KeyKind::Jwt
                })
            ),
            "{jwt_as_secret:?}"
        );
        let opaque_as_legacy = from(&[url, ("SUPABASE_SERVICE_ROLE_KEY", "not-a-jwt")]).unwrap_err();
        assert!(
            matches!(opaque_as_legacy, ClientError::Key(KeyError::WrongKind { found: KeyKind::Other, .. })),
            "{opaque_as_legacy:?}"
        );
        // A secret key in the legacy variable works: the gateway takes it.
        assert!(from(&[url, ("SUPABASE_SERVICE_ROLE_KEY", SECRET)]).is_ok());
        // And the library's own constructor refuses a publishable key too.
        assert!(matches!(
            ClientConfig::new("http://localhost", PUBLISHABLE),
            Err(ClientError::Key(KeyError::Publishable { .. }))
        ));
    }

    #[test]
    fn a_legacy_jwt_with_supabase_url_goes_in_both_headers() {
        let config =
            configured(&[("SUPABASE_URL", "https://abcdefgh.supabase.co/"), ("SUPABASE_SERVICE_ROLE_KEY", JWT)]);
        assert_eq!(config.base_url().as_str(), "https://abcdefgh.supabase.co/rest/v1/");
        assert_eq!(config.gateway(), Gateway::Supabase);
        assert_eq!(headers(&config), (format!("Bearer {JWT}"), Some(JWT.to_owned())));
    }

    #[test]
    fn a_secret_key_goes_in_both_headers_unchanged() {
        let with_supabase_url =
            configured(&[("SUPABASE_URL", "http://127.0.0.1:54321"), ("SUPABASE_SECRET_KEY", SECRET)]);
        assert_eq!(headers(&with_supabase_url), (format!("Bearer {SECRET}"), Some(SECRET.to_owned())));
        // IDEM_POSTGREST_URL at a hosted project: the host says it is Supabase's gateway.
        let hosted = configured(&[
            ("IDEM_POSTGREST_URL", "https://abcdefgh.supabase.co/rest/v1"),
            ("SUPABASE_SECRET_KEY", SECRET),
        ]);
        assert_eq!(hosted.gateway(), Gateway::Supabase);
        assert_eq!(headers(&hosted), (format!("Bearer {SECRET}"), Some(SECRET.to_owned())));
        // A custom domain: only Supabase's gateway understands a secret key, so it goes as apikey too.
        let custom =
            configured(&[("IDEM_POSTGREST_URL", "https://api.example.com/rest/v1"), ("IDEM_SERVICE_KEY", SECRET)]);
        assert_eq!(custom.gateway(), Gateway::Plain);
        assert_eq!(headers(&custom), (format!("Bearer {SECRET}"), Some(SECRET.to_owned())));
    }

    #[test]
    fn a_jwt_at_a_hosted_project_named_by_idem_postgrest_url_sends_apikey_too() {
        let config =
            configured(&[("IDEM_POSTGREST_URL", "https://abcdefgh.supabase.co/rest/v1"), ("IDEM_SERVICE_KEY", JWT)]);
        assert!(config.sends_apikey());
        assert_eq!(headers(&config), (format!("Bearer {JWT}"), Some(JWT.to_owned())));
    }

    #[test]
    fn plain_postgrest_gets_authorization_alone_unless_an_apikey_is_set() {
        let plain = configured(&[("IDEM_POSTGREST_URL", "http://localhost:3000"), ("IDEM_SERVICE_KEY", JWT)]);
        assert!(!plain.sends_apikey());
        assert_eq!(headers(&plain), (format!("Bearer {JWT}"), None));
        let behind_a_gateway = configured(&[
            ("IDEM_POSTGREST_URL", "http://localhost:3000"),
            ("IDEM_SERVICE_KEY", JWT),
            ("IDEM_APIKEY", PUBLISHABLE),
        ]);
        assert_eq!(headers(&behind_a_gateway), (format!("Bearer {JWT}"), Some(PUBLISHABLE.to_owned())));
        let told = ClientConfig::new("http://localhost:3000", JWT).unwrap().with_gateway(Gateway::Supabase);
        assert_eq!(headers(&told), (format!("Bearer {JWT}"), Some(JWT.to_owned())));
    }

    #[test]
    fn an_apikey_other_than_the_sb_key_in_authorization_is_refused() {
        let vars = [("SUPABASE_URL", "https://abcdefgh.supabase.co"), ("SUPABASE_SECRET_KEY", SECRET)];
        let differs = from(&[vars[0], vars[1], ("IDEM_APIKEY", PUBLISHABLE)]).unwrap_err();
        assert!(matches!(differs, ClientError::Key(KeyError::ApikeyDiffers)), "{differs:?}");
        let same = configured(&[vars[0], vars[1], ("IDEM_APIKEY", SECRET)]);
        assert_eq!(headers(&same), (format!("Bearer {SECRET}"), Some(SECRET.to_owned())));
        let built = ClientConfig::new("http://localhost", SECRET).unwrap().with_apikey("other");
        assert!(matches!(built.auth_headers(), Err(ClientError::Key(KeyError::ApikeyDiffers))));
    }

    #[test]
    fn debug_never_prints_a_secret_key() {
        let config = configured(&[("SUPABASE_URL", "https://abcdefgh.supabase.co"), ("SUPABASE_SECRET_KEY", SECRET)]);
        let printed = format!("{config:?}");
        assert!(!printed.contains("0123456789abcdef"), "{printed}");
        assert!(!printed.contains("sb_secret"), "{printed}");
        assert!(printed.contains("<redacted>") && printed.contains("Secret"), "{printed}");
    }
}
