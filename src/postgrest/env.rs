//! The client's configuration read from environment variables: where the
//! server is, which variable holds the service key, and its `apikey`.

use super::config::{ClientConfig, PLAIN_HTTP_HOSTS_VAR};
use super::error::ClientError;
use super::key::{Gateway, KeyError, KeyKind};

/// The variables [`ClientConfig::from_env`] reads a service key from, in
/// order of precedence: the first one set wins.
///
/// `IDEM_SERVICE_KEY` is this crate's own and overrides the platform's;
/// `SUPABASE_SECRET_KEYS` is what hosted Edge Functions receive today, a
/// JSON map of secret keys by name (`{"default": "sb_secret_…"}`; the entry
/// read is [`SECRET_KEY_NAME_VAR`]'s, else `default`);
/// `SUPABASE_SECRET_KEY` (`sb_secret_…`) is one such key set by hand;
/// `SUPABASE_SERVICE_ROLE_KEY` is the legacy `service_role` JWT, which
/// Supabase is retiring (and which its Edge Functions still export, so it
/// must not win over a key chosen on purpose).
pub const SERVICE_KEY_VARIABLES: [&str; 4] =
    ["IDEM_SERVICE_KEY", SECRET_KEYS_VAR, "SUPABASE_SECRET_KEY", "SUPABASE_SERVICE_ROLE_KEY"];

/// The variable hosted Supabase sets to its project's secret keys: a JSON
/// object of key names to `sb_secret_…` keys.
pub const SECRET_KEYS_VAR: &str = "SUPABASE_SECRET_KEYS";

/// The variable naming which entry of [`SECRET_KEYS_VAR`] to use, when not
/// [`DEFAULT_SECRET_KEY_NAME`].
pub const SECRET_KEY_NAME_VAR: &str = "IDEM_SECRET_KEY_NAME";

/// The entry of [`SECRET_KEYS_VAR`] used unless [`SECRET_KEY_NAME_VAR`]
/// names another: the name Supabase gives a project's first secret key.
pub const DEFAULT_SECRET_KEY_NAME: &str = "default";

/// The service key from the first set of [`SERVICE_KEY_VARIABLES`], with
/// the variable it came from; `var` already treats empty as unset. A
/// `SUPABASE_SECRET_KEYS` holding no key at all (`{}`, a project without
/// secret keys) counts as unset, unless `IDEM_SECRET_KEY_NAME` asks for one.
fn service_key(var: &impl Fn(&str) -> Option<String>) -> Result<(&'static str, String), KeyError> {
    for variable in SERVICE_KEY_VARIABLES {
        let Some(value) = var(variable) else { continue };
        if variable != SECRET_KEYS_VAR {
            return Ok((variable, value));
        }
        let keys: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(&value).map_err(|_| KeyError::SecretKeysMalformed { variable })?;
        if !keys.values().all(serde_json::Value::is_string) {
            return Err(KeyError::SecretKeysMalformed { variable });
        }
        let named = var(SECRET_KEY_NAME_VAR);
        if keys.is_empty() && named.is_none() {
            continue;
        }
        let name = named.unwrap_or_else(|| DEFAULT_SECRET_KEY_NAME.to_owned());
        return match keys.get(&name).and_then(serde_json::Value::as_str).filter(|key| !key.is_empty()) {
            Some(key) => Ok((variable, key.to_owned())),
            None => {
                let mut available: Vec<String> = keys.keys().cloned().collect();
                available.sort();
                Err(KeyError::SecretKeyNotFound { variable, name, available })
            }
        };
    }
    Err(KeyError::Missing { variables: SERVICE_KEY_VARIABLES.join(" / ") })
}

/// Every service key `var` holds (a variable's value by name; empty counts
/// as unset), for a route that lets an operator in with whichever key it
/// sends: each of [`SERVICE_KEY_VARIABLES`] that is set, every entry of
/// `SUPABASE_SECRET_KEYS`, without repeats and without publishable keys. A
/// `SUPABASE_SECRET_KEYS` that is not a JSON object of strings gives none
/// (where the plane is configured, [`ClientConfig::from_vars`] refuses it).
/// The TypeScript client's `serviceKeysInEnv`.
pub fn service_keys_in(var: impl Fn(&str) -> Option<String>) -> Vec<String> {
    let mut keys: Vec<String> = Vec::new();
    for variable in SERVICE_KEY_VARIABLES {
        let Some(value) = var(variable).filter(|value| !value.is_empty()) else { continue };
        if variable == SECRET_KEYS_VAR {
            if let Ok(map) = serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(&value) {
                if map.values().all(serde_json::Value::is_string) {
                    keys.extend(map.values().filter_map(serde_json::Value::as_str).map(str::to_owned));
                }
            }
        } else {
            keys.push(value);
        }
    }
    let mut seen = std::collections::HashSet::new();
    keys.retain(|key| !key.is_empty() && KeyKind::of(key) != KeyKind::Publishable && seen.insert(key.clone()));
    keys
}

/// [`service_keys_in`] over the process environment.
pub fn service_keys_in_env() -> Vec<String> {
    service_keys_in(|name| std::env::var(name).ok())
}

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
    ///   (`IDEM_SERVICE_KEY`, `SUPABASE_SECRET_KEYS`' `default` entry or
    ///   the one `IDEM_SECRET_KEY_NAME` names, `SUPABASE_SECRET_KEY`,
    ///   `SUPABASE_SERVICE_ROLE_KEY`). A publishable key is refused in any
    ///   of them; `SUPABASE_SECRET_KEYS` and `SUPABASE_SECRET_KEY` must hold
    ///   `sb_secret_…` keys and `SUPABASE_SERVICE_ROLE_KEY` a JWT or an
    ///   `sb_secret_…` key ([`KeyError`]).
    /// - `IDEM_APIKEY`: the `apikey` header, replacing the default one.
    /// - `IDEM_MAX_ROWS`: the server's row cap.
    /// - `IDEM_ALLOW_PLAIN_HTTP`: hosts, comma-separated, that may be reached
    ///   over plain `http://` besides loopback ([`PLAIN_HTTP_HOSTS_VAR`]).
    ///
    /// Testable without touching the process environment:
    ///
    /// ```
    /// # use idempotency_plane::postgrest::{ClientConfig, KeyKind};
    /// let vars = [("SUPABASE_URL", "https://abcd.supabase.co"), ("SUPABASE_SECRET_KEYS", r#"{"default":"sb_secret_x"}"#)];
    /// let lookup = |name: &str| vars.iter().find(|(n, _)| *n == name).map(|(_, v)| v.to_string());
    /// let config = ClientConfig::from_vars(lookup)?.expect("a URL is set");
    /// assert_eq!(config.key_kind(), KeyKind::Secret);
    /// assert_eq!(config.key_variable(), Some("SUPABASE_SECRET_KEYS"));
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
        let (variable, key) = service_key(&var)?;
        let kind = KeyKind::of(&key);
        let expected: &[KeyKind] = match variable {
            SECRET_KEYS_VAR | "SUPABASE_SECRET_KEY" => &[KeyKind::Secret],
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
    fn headers(config: &ClientConfig) -> (Option<String>, Option<String>) {
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
        let keys = r#"{"default":"sb_secret_from_the_map"}"#;
        let all = [
            url,
            ("IDEM_SERVICE_KEY", JWT),
            ("SUPABASE_SECRET_KEYS", keys),
            ("SUPABASE_SECRET_KEY", SECRET),
            ("SUPABASE_SERVICE_ROLE_KEY", JWT),
        ];
        assert_eq!(configured(&all).key_variable(), Some("IDEM_SERVICE_KEY"));
        let hosted = configured(&[url, all[2], all[3], all[4]]);
        assert_eq!(hosted.key_variable(), Some("SUPABASE_SECRET_KEYS"));
        assert_eq!(headers(&hosted), (None, Some("sb_secret_from_the_map".to_owned())));
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
        let in_a_map = format!(r#"{{"default":"{PUBLISHABLE}"}}"#);
        for variable in SERVICE_KEY_VARIABLES {
            let value = if variable == SECRET_KEYS_VAR { in_a_map.as_str() } else { PUBLISHABLE };
            let refused = from(&[url, (variable, value)]).unwrap_err();
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
        assert_eq!(headers(&config), (Some(format!("Bearer {JWT}")), Some(JWT.to_owned())));
    }

    #[test]
    fn a_secret_key_goes_in_apikey_alone_unchanged() {
        let with_supabase_url =
            configured(&[("SUPABASE_URL", "http://127.0.0.1:54321"), ("SUPABASE_SECRET_KEY", SECRET)]);
        assert_eq!(headers(&with_supabase_url), (None, Some(SECRET.to_owned())));
        // IDEM_POSTGREST_URL at a hosted project: the host says it is Supabase's gateway.
        let hosted = configured(&[
            ("IDEM_POSTGREST_URL", "https://abcdefgh.supabase.co/rest/v1"),
            ("SUPABASE_SECRET_KEY", SECRET),
        ]);
        assert_eq!(hosted.gateway(), Gateway::Supabase);
        assert_eq!(headers(&hosted), (None, Some(SECRET.to_owned())));
        // A custom domain: only Supabase's gateway understands a secret key, and it reads apikey.
        let custom =
            configured(&[("IDEM_POSTGREST_URL", "https://api.example.com/rest/v1"), ("IDEM_SERVICE_KEY", SECRET)]);
        assert_eq!(custom.gateway(), Gateway::Plain);
        assert_eq!(headers(&custom), (None, Some(SECRET.to_owned())));
    }

    #[test]
    fn a_jwt_at_a_hosted_project_named_by_idem_postgrest_url_sends_apikey_too() {
        let config =
            configured(&[("IDEM_POSTGREST_URL", "https://abcdefgh.supabase.co/rest/v1"), ("IDEM_SERVICE_KEY", JWT)]);
        assert!(config.sends_apikey());
        assert_eq!(headers(&config), (Some(format!("Bearer {JWT}")), Some(JWT.to_owned())));
    }

    #[test]
    fn plain_postgrest_gets_authorization_alone_unless_an_apikey_is_set() {
        let plain = configured(&[("IDEM_POSTGREST_URL", "http://localhost:3000"), ("IDEM_SERVICE_KEY", JWT)]);
        assert!(!plain.sends_apikey());
        assert_eq!(headers(&plain), (Some(format!("Bearer {JWT}")), None));
        let behind_a_gateway = configured(&[
            ("IDEM_POSTGREST_URL", "http://localhost:3000"),
            ("IDEM_SERVICE_KEY", JWT),
            ("IDEM_APIKEY", PUBLISHABLE),
        ]);
        assert_eq!(headers(&behind_a_gateway), (Some(format!("Bearer {JWT}")), Some(PUBLISHABLE.to_owned())));
        let told = ClientConfig::new("http://localhost:3000", JWT).unwrap().with_gateway(Gateway::Supabase);
        assert_eq!(headers(&told), (Some(format!("Bearer {JWT}")), Some(JWT.to_owned())));
    }

    #[test]
    fn an_apikey_other_than_the_sb_key_in_authorization_is_refused() {
        let vars = [("SUPABASE_URL", "https://abcdefgh.supabase.co"), ("SUPABASE_SECRET_KEY", SECRET)];
        let differs = from(&[vars[0], vars[1], ("IDEM_APIKEY", PUBLISHABLE)]).unwrap_err();
        assert!(matches!(differs, ClientError::Key(KeyError::ApikeyDiffers)), "{differs:?}");
        let same = configured(&[vars[0], vars[1], ("IDEM_APIKEY", SECRET)]);
        assert_eq!(headers(&same), (None, Some(SECRET.to_owned())));
        let built = ClientConfig::new("http://localhost", SECRET).unwrap().with_apikey("other");
        assert!(matches!(built.auth_headers(), Err(ClientError::Key(KeyError::ApikeyDiffers))));
    }

    #[test]
    fn the_secret_keys_map_is_read_by_name_and_refused_whole_when_malformed() {
        let url = ("SUPABASE_URL", "https://abcdefgh.supabase.co");
        let keys = r#"{"default":"sb_secret_first","ci":"sb_secret_second"}"#;
        let named = configured(&[url, ("SUPABASE_SECRET_KEYS", keys), ("IDEM_SECRET_KEY_NAME", "ci")]);
        assert_eq!(headers(&named), (None, Some("sb_secret_second".to_owned())));
        let missing = from(&[url, ("SUPABASE_SECRET_KEYS", keys), ("IDEM_SECRET_KEY_NAME", "prod")]).unwrap_err();
        assert!(
            matches!(&missing, ClientError::Key(KeyError::SecretKeyNotFound { name, available, .. })
                if name == "prod" && available == &["ci".to_owned(), "default".to_owned()]),
            "{missing:?}"
        );
        assert!(!missing.to_string().contains("sb_secret_"), "names only, never keys: {missing}");
        // A malformed map is refused, not passed over for the legacy key beside it.
        for malformed in ["sb_secret_x", "[]", r#"{"default":1}"#, "{", r#""sb_secret_x""#] {
            let refused =
                from(&[url, ("SUPABASE_SECRET_KEYS", malformed), ("SUPABASE_SERVICE_ROLE_KEY", JWT)]).unwrap_err();
            assert!(
                matches!(refused, ClientError::Key(KeyError::SecretKeysMalformed { .. })),
                "{malformed}: {refused:?}"
            );
        }
        let legacy_jwt_in_the_map = from(&[url, ("SUPABASE_SECRET_KEYS", &format!(r#"{{"default":"{JWT}"}}"#))]);
        assert!(matches!(legacy_jwt_in_the_map, Err(ClientError::Key(KeyError::WrongKind { .. }))));
    }

    /// Every environment of `tests/vectors/service_key_env.json`, which the
    /// TypeScript client's tests read too: the same variable, URL and
    /// headers, or the same refusal.
    #[test]
    fn every_environment_of_the_shared_vectors_is_read_alike() {
        let vectors: serde_json::Value =
            serde_json::from_str(include_str!("../../tests/vectors/service_key_env.json")).expect("the vectors parse");
        let cases = vectors["cases"].as_array().expect("cases");
        assert!(cases.len() >= 20, "{}", cases.len());
        for case in cases {
            let name = case["name"].as_str().unwrap_or_default();
            let vars: Vec<(String, String)> = case["env"]
                .as_object()
                .expect("env")
                .iter()
                .map(|(k, v)| (k.clone(), v.as_str().expect("a string").to_owned()))
                .collect();
            let read = ClientConfig::from_vars(|n| vars.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone()));
            if let Some(error) = case["error"].as_str() {
                let refused = match read {
                    Err(ClientError::Key(refused)) => refused,
                    other => panic!("{name}: refused as {error}, got {other:?}"),
                };
                let kind = match refused {
                    KeyError::Missing { .. } => "missing",
                    KeyError::Publishable { .. } => "publishable",
                    KeyError::WrongKind { .. } => "wrong_kind",
                    KeyError::SecretKeysMalformed { .. } => "secret_keys_malformed",
                    KeyError::SecretKeyNotFound { .. } => "secret_key_not_found",
                    KeyError::ApikeyDiffers => "apikey_differs",
                };
                assert_eq!(kind, error, "{name}");
                continue;
            }
            let expect = &case["expect"];
            let config = read.expect(name).expect(name);
            assert_eq!(config.key_variable(), expect["variable"].as_str(), "{name}");
            assert_eq!(config.base_url().as_str().trim_end_matches('/'), expect["url"].as_str().unwrap(), "{name}");
            let (authorization, apikey) = headers(&config);
            assert_eq!(authorization.as_deref(), expect["authorization"].as_str(), "{name}");
            assert_eq!(apikey.as_deref(), expect["apikey"].as_str(), "{name}");
        }
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
