//! Where the PostgREST server is and how to talk to it.

use std::fmt;
use std::time::Duration;

use url::Url;

use super::error::{ClientError, KeyError};
use super::retry::RetryConfig;

/// Supabase's default `api.max_rows`, and the cap this client assumes unless told.
pub const DEFAULT_MAX_ROWS: u32 = 1000;

/// The largest row cap this client accepts: the plane's bounded functions
/// refuse larger limits, so a larger cap would only move the refusal from
/// here to the server.
pub const MAX_MAX_ROWS: u32 = 100_000;

/// The largest response body the client reads unless told otherwise: 8 MiB.
/// A claim row holds at most a 64 KiB answer by default and 4 MiB under any
/// legal policy (`MAX_POLICY_RESPONSE_BYTES`), which PostgreSQL writes back
/// as at most 6 MiB; the largest bounded read (100,000 rows of
/// `id,retain_until`) is about 7.5 MB. A lower limit can leave a client
/// unable to read a key whose answer its policy allows.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 8 * 1024 * 1024;

/// How long one operation may take unless told otherwise: every attempt,
/// backoff and retry of one call together. 25 s, below API Gateway's 29 s
/// integration timeout, so a caller behind one hears the client's own typed
/// error rather than the gateway's 504.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(25);

/// The variables [`ClientConfig::from_env`] reads a service key from, in
/// order of precedence: the first one set wins.
///
/// `IDEM_SERVICE_KEY` is this crate's own and overrides the platform's;
/// `SUPABASE_SECRET_KEY` (`sb_secret_…`) is today's Supabase key;
/// `SUPABASE_SERVICE_ROLE_KEY` is the legacy `service_role` JWT, which
/// Supabase is retiring (and which its Edge Functions export by default,
/// so it must not win over a key chosen on purpose).
pub const SERVICE_KEY_VARIABLES: [&str; 3] = ["IDEM_SERVICE_KEY", "SUPABASE_SECRET_KEY", "SUPABASE_SERVICE_ROLE_KEY"];

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

    /// Whether this is one of Supabase's opaque `sb_` keys, which its
    /// gateway accepts in `Authorization` only when the same value is the
    /// `apikey`.
    fn is_supabase_api_key(self) -> bool {
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
    /// PostgREST itself: the key goes in `Authorization: Bearer` only
    /// (unless the key is an `sb_secret_…` key or an `apikey` was set).
    Plain,
    /// Supabase's API gateway, which wants the key in `apikey` as well as
    /// `Authorization: Bearer`, as supabase-js sends it.
    Supabase,
}

impl Gateway {
    /// [`Gateway::Supabase`] for a hosted Supabase project's URL (a host
    /// under `supabase.co`), else [`Gateway::Plain`]. A Supabase behind a
    /// custom domain or the local Supabase CLI is not recognisable by its
    /// URL: use `SUPABASE_URL`, `IDEM_APIKEY` or
    /// [`ClientConfig::with_gateway`].
    pub fn of_url(url: &Url) -> Gateway {
        match url.host_str() {
            Some(host) if host.to_ascii_lowercase().trim_end_matches('.').ends_with(".supabase.co") => {
                Gateway::Supabase
            }
            _ => Gateway::Plain,
        }
    }
}

/// The authentication headers of every request, before they become header
/// values.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct AuthHeaders {
    /// `Authorization`, `Bearer ` included.
    pub(crate) authorization: String,
    /// `apikey`, when one is sent.
    pub(crate) apikey: Option<String>,
}

/// Configuration of a [`PostgrestClient`](super::PostgrestClient).
///
/// `Debug` never prints the service key or the `apikey`.
///
/// **Headers.** The service key always goes in `Authorization: Bearer`,
/// unchanged. It also goes in `apikey`, as supabase-js sends it, when the
/// [`Gateway`] is Supabase's (`SUPABASE_URL` was used, the URL is a
/// `*.supabase.co` host, or [`with_gateway`](Self::with_gateway) said so)
/// or when it is an `sb_secret_…` key (which only Supabase's gateway
/// understands). An explicit [`with_apikey`](Self::with_apikey) /
/// `IDEM_APIKEY` replaces that `apikey`; with an `sb_` key in
/// `Authorization` it must be the same key, since Supabase's gateway
/// refuses an `sb_` key in `Authorization` that differs from the `apikey`.
/// Plain PostgREST with a JWT gets `Authorization` alone.
#[derive(Clone)]
pub struct ClientConfig {
    pub(crate) base_url: Url,
    pub(crate) service_key: String,
    pub(crate) key_kind: KeyKind,
    pub(crate) key_variable: Option<&'static str>,
    pub(crate) apikey: Option<String>,
    pub(crate) gateway: Gateway,
    pub(crate) schema: String,
    pub(crate) max_rows: u32,
    pub(crate) request_timeout: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) pool_max_idle_per_host: usize,
    pub(crate) retry: RetryConfig,
    pub(crate) deadline: Duration,
    pub(crate) max_response_bytes: usize,
}

impl ClientConfig {
    /// A server at `base_url`, called with `service_key` as the Bearer token.
    ///
    /// `base_url` is PostgREST's root: `http://host:3000` for plain
    /// PostgREST, `https://<ref>.supabase.co/rest/v1` for Supabase. Defaults:
    /// schema `agent`, `max_rows` 1000, 15 s request and 5 s connect timeouts,
    /// [`RetryConfig::default`], a [`DEFAULT_DEADLINE`] per operation, the
    /// [`Gateway`] the URL shows, bodies up to [`DEFAULT_MAX_RESPONSE_BYTES`].
    ///
    /// A publishable key (`sb_publishable_…`) is refused
    /// ([`KeyError::Publishable`]): it reaches only the `anon` role, which
    /// cannot execute the plane's functions.
    pub fn new(base_url: &str, service_key: impl Into<String>) -> Result<Self, ClientError> {
        let mut base_url =
            Url::parse(base_url).map_err(|e| ClientError::Config(format!("base URL {base_url:?}: {e}")))?;
        if !matches!(base_url.scheme(), "http" | "https") {
            return Err(ClientError::Config(format!("base URL must be http or https, got {:?}", base_url.scheme())));
        }
        if base_url.query().is_some() || base_url.fragment().is_some() {
            return Err(ClientError::Config("base URL must not carry a query or a fragment".into()));
        }
        // `…/rest/v1` and `…/rest/v1/` must both resolve `rpc/x` beneath them.
        if !base_url.path().ends_with('/') {
            let path = format!("{}/", base_url.path());
            base_url.set_path(&path);
        }
        let service_key = service_key.into();
        if service_key.is_empty() {
            return Err(ClientError::Config("the service key is empty".into()));
        }
        let key_kind = KeyKind::of(&service_key);
        if key_kind == KeyKind::Publishable {
            return Err(KeyError::Publishable { variable: "the service key" }.into());
        }
        let gateway = Gateway::of_url(&base_url);
        Ok(ClientConfig {
            base_url,
            service_key,
            key_kind,
            key_variable: None,
            apikey: None,
            gateway,
            schema: "agent".into(),
            max_rows: DEFAULT_MAX_ROWS,
            // Above PostgREST's 10 s db-pool-acquisition-timeout, so its 504
            // PGRST003 ("never ran", always safe to retry) arrives before our
            // own timeout ("may have run") would.
            request_timeout: Duration::from_secs(15),
            connect_timeout: Duration::from_secs(5),
            pool_max_idle_per_host: 64,
            retry: RetryConfig::default(),
            deadline: DEFAULT_DEADLINE,
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
        })
    }

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
        let mut config = ClientConfig::new(&url, key)?;
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

    /// Sends `apikey: <apikey>` on every request, instead of the service key
    /// the [`Gateway`] would send. With an `sb_` service key it must be the
    /// same key ([`KeyError::ApikeyDiffers`] when the client is built).
    pub fn with_apikey(mut self, apikey: impl Into<String>) -> Self {
        self.apikey = Some(apikey.into());
        self
    }

    /// Says what stands in front of PostgREST, when the URL does not show
    /// it (a custom domain, the local Supabase CLI): with
    /// [`Gateway::Supabase`] the service key is sent as `apikey` too.
    pub fn with_gateway(mut self, gateway: Gateway) -> Self {
        self.gateway = gateway;
        self
    }

    /// The longest one operation may take, all attempts, backoffs and
    /// retries included. No retry starts that could not finish before it
    /// (the failed attempt's duration is the estimate of the next one), a
    /// request still in flight at the deadline is cut, and the call fails
    /// with [`ClientError::DeadlineExceeded`]. Default [`DEFAULT_DEADLINE`];
    /// must be above zero.
    ///
    /// It bounds each call, not a whole service operation made of several
    /// (a webhook delivery's claim and completion): give those their own
    /// bound, as the webhook gate does.
    pub fn with_deadline(mut self, deadline: Duration) -> Result<Self, ClientError> {
        if deadline.is_zero() {
            return Err(ClientError::Config("the deadline must be above zero".into()));
        }
        self.deadline = deadline;
        Ok(self)
    }

    /// The schema sent as `Content-Profile`/`Accept-Profile`. Default `agent`.
    pub fn with_schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// The server's row cap (`db-max-rows`; Supabase `api.max_rows`). Bounded
    /// reads above it are refused. Must be at least 1.
    pub fn with_max_rows(mut self, max_rows: u32) -> Result<Self, ClientError> {
        if max_rows == 0 || max_rows > MAX_MAX_ROWS {
            return Err(ClientError::Config(format!("max_rows must be between 1 and {MAX_MAX_ROWS}, got {max_rows}")));
        }
        self.max_rows = max_rows;
        Ok(self)
    }

    /// Whole-request timeout. Default 15 s, above PostgREST's 10 s pool
    /// acquisition timeout.
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// Connect timeout. Default 5 s.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Idle keep-alive connections kept per host. Default 64.
    pub fn with_pool_max_idle_per_host(mut self, idle: usize) -> Self {
        self.pool_max_idle_per_host = idle;
        self
    }

    /// Retry policy. Default [`RetryConfig::default`].
    pub fn with_retry(mut self, retry: RetryConfig) -> Self {
        self.retry = retry;
        self
    }

    /// The largest response body read, in bytes; a longer one fails the call
    /// with [`ClientError::ResponseTooLarge`] instead of filling memory.
    /// Default [`DEFAULT_MAX_RESPONSE_BYTES`]; at least 1 KiB.
    pub fn with_max_response_bytes(mut self, bytes: usize) -> Result<Self, ClientError> {
        if bytes < 1024 {
            return Err(ClientError::Config(format!("max_response_bytes must be at least 1024, got {bytes}")));
        }
        self.max_response_bytes = bytes;
        Ok(self)
    }

    /// The root every `rpc/<name>` is resolved against, with a trailing slash.
    pub fn base_url(&self) -> &Url {
        &self.base_url
    }

    /// The configured row cap.
    pub fn max_rows(&self) -> u32 {
        self.max_rows
    }

    /// The deadline of one operation.
    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    /// The kind of the service key, by its shape.
    pub fn key_kind(&self) -> KeyKind {
        self.key_kind
    }

    /// The variable the service key was read from, when read by
    /// [`from_vars`](Self::from_vars) / [`from_env`](Self::from_env).
    pub fn key_variable(&self) -> Option<&'static str> {
        self.key_variable
    }

    /// What stands in front of PostgREST, as configured or as the URL shows.
    pub fn gateway(&self) -> Gateway {
        self.gateway
    }

    /// Whether requests carry an `apikey` header.
    pub fn sends_apikey(&self) -> bool {
        self.apikey.is_some() || self.gateway == Gateway::Supabase || self.key_kind == KeyKind::Secret
    }

    /// The authentication headers, by the rules in the type's documentation.
    pub(crate) fn auth_headers(&self) -> Result<AuthHeaders, ClientError> {
        let apikey = match &self.apikey {
            Some(apikey) => {
                if self.key_kind.is_supabase_api_key() && *apikey != self.service_key {
                    return Err(KeyError::ApikeyDiffers.into());
                }
                Some(apikey.clone())
            }
            None => self.sends_apikey().then(|| self.service_key.clone()),
        };
        Ok(AuthHeaders { authorization: format!("Bearer {}", self.service_key), apikey })
    }
}

impl fmt::Debug for ClientConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientConfig")
            .field("base_url", &self.base_url.as_str())
            .field("service_key", &"<redacted>")
            .field("key_kind", &self.key_kind)
            .field("key_variable", &self.key_variable)
            .field("gateway", &self.gateway)
            .field("apikey", &self.apikey.as_ref().map(|_| "<redacted>"))
            .field("schema", &self.schema)
            .field("max_rows", &self.max_rows)
            .field("request_timeout", &self.request_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("pool_max_idle_per_host", &self.pool_max_idle_per_host)
            .field("retry", &self.retry)
            .field("deadline", &self.deadline)
            .field("max_response_bytes", &self.max_response_bytes)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_url_gains_a_trailing_slash_so_rpc_resolves_beneath_it() {
        let supabase = ClientConfig::new("https://ref.supabase.co/rest/v1", "k").unwrap();
        assert_eq!(supabase.base_url().join("rpc/f").unwrap().as_str(), "https://ref.supabase.co/rest/v1/rpc/f");
        let plain = ClientConfig::new("http://localhost:3000", "k").unwrap();
        assert_eq!(plain.base_url().join("rpc/f").unwrap().as_str(), "http://localhost:3000/rpc/f");
    }

    #[test]
    fn bad_configuration_is_refused() {
        assert!(matches!(ClientConfig::new("not a url", "k"), Err(ClientError::Config(_))));
        assert!(matches!(ClientConfig::new("ftp://x", "k"), Err(ClientError::Config(_))));
        assert!(matches!(ClientConfig::new("http://x?a=1", "k"), Err(ClientError::Config(_))));
        assert!(matches!(ClientConfig::new("http://x", ""), Err(ClientError::Config(_))));
        let config = ClientConfig::new("http://x", "k").unwrap();
        assert!(matches!(config.clone().with_max_rows(0), Err(ClientError::Config(_))));
        assert!(matches!(config.clone().with_max_rows(MAX_MAX_ROWS + 1), Err(ClientError::Config(_))));
        assert!(config.with_max_rows(MAX_MAX_ROWS).is_ok());
    }

    /// A legacy `service_role`-shaped JWT (not signed by anyone).
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
            ClientConfig::new("http://x", PUBLISHABLE),
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
        let built = ClientConfig::new("http://x", SECRET).unwrap().with_apikey("other");
        assert!(matches!(built.auth_headers(), Err(ClientError::Key(KeyError::ApikeyDiffers))));
    }

    #[test]
    fn the_deadline_defaults_below_api_gateways_and_must_be_above_zero() {
        let config = ClientConfig::new("http://x", "k").unwrap();
        assert_eq!(config.deadline(), DEFAULT_DEADLINE);
        assert!(DEFAULT_DEADLINE < Duration::from_secs(29));
        assert!(matches!(config.clone().with_deadline(Duration::ZERO), Err(ClientError::Config(_))));
        assert_eq!(config.with_deadline(Duration::from_millis(2500)).unwrap().deadline(), Duration::from_millis(2500));
    }

    #[test]
    fn debug_never_prints_a_secret_key() {
        let config = configured(&[("SUPABASE_URL", "https://abcdefgh.supabase.co"), ("SUPABASE_SECRET_KEY", SECRET)]);
        let printed = format!("{config:?}");
        assert!(!printed.contains("0123456789abcdef"), "{printed}");
        assert!(!printed.contains("sb_secret"), "{printed}");
        assert!(printed.contains("<redacted>") && printed.contains("Secret"), "{printed}");
    }

    #[test]
    fn debug_never_prints_secrets() {
        let config = ClientConfig::new("http://x", "secret-service-key").unwrap().with_apikey("secret-apikey");
        let printed = format!("{config:?}");
        assert!(!printed.contains("secret"), "{printed}");
        assert!(printed.contains("<redacted>"));
    }
}
