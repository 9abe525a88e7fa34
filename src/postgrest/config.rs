//! Where the PostgREST server is and how to talk to it.

use std::fmt;
use std::time::Duration;

use url::Url;

use super::error::ClientError;
use super::key::{Gateway, KeyError, KeyKind};
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

/// The environment variable [`ClientConfig::from_env`] reads the hosts from
/// that may be reached over plain `http://` besides loopback: host names,
/// comma-separated ([`ClientConfig::new_allowing_plain_http`]).
pub const PLAIN_HTTP_HOSTS_VAR: &str = "IDEM_ALLOW_PLAIN_HTTP";

/// The authentication headers of every request, before they become header
/// values.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct AuthHeaders {
    /// `Authorization`, `Bearer ` included; none for an `sb_` key, which
    /// goes in `apikey` alone.
    pub(crate) authorization: Option<String>,
    /// `apikey`, when one is sent.
    pub(crate) apikey: Option<String>,
}

/// Configuration of a [`PostgrestClient`](super::PostgrestClient).
///
/// `Debug` never prints the service key or the `apikey`.
///
/// **Headers.** An `sb_secret_…` key is not a JWT: it goes in `apikey`
/// alone, as Supabase documents its gateway wants it (the gateway swaps it
/// for a short-lived `service_role` token; nothing else understands it).
/// A JWT goes in `Authorization: Bearer`, unchanged, and in `apikey` too,
/// as supabase-js sends it, when the [`Gateway`] is Supabase's
/// (`SUPABASE_URL` was used, the URL is a `*.supabase.co` host, or
/// [`with_gateway`](Self::with_gateway) said so). An explicit
/// [`with_apikey`](Self::with_apikey) / `IDEM_APIKEY` replaces that
/// `apikey`; beside an `sb_` key it must be the same key. Plain PostgREST
/// with a JWT gets `Authorization` alone.
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
    /// A server at `base_url`, called with `service_key` (a JWT as the
    /// Bearer token, an `sb_` key as `apikey`: see the type's headers).
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
    ///
    /// Plain `http://` is refused except to a loopback host (`localhost`,
    /// `127.0.0.0/8`, `[::1]`): the service key travels in every request, and
    /// whoever reads it on the wire owns the plane. A server on a private
    /// network reached without TLS must be named:
    /// [`new_allowing_plain_http`](Self::new_allowing_plain_http).
    pub fn new(base_url: &str, service_key: impl Into<String>) -> Result<Self, ClientError> {
        Self::new_allowing_plain_http(base_url, service_key, &[])
    }

    /// As [`new`](Self::new), and plain `http://` is also allowed to the
    /// hosts named in `plain_http_hosts` (exact host names, compared without
    /// case): for a PostgREST on a private network whose traffic never
    /// leaves it. [`from_env`](Self::from_env) reads them from
    /// [`PLAIN_HTTP_HOSTS_VAR`].
    pub fn new_allowing_plain_http(
        base_url: &str,
        service_key: impl Into<String>,
        plain_http_hosts: &[&str],
    ) -> Result<Self, ClientError> {
        let mut base_url = Url::parse(base_url)
            .map_err(|e| ClientError::Config(format!("base URL {:?}: {e}", redacted_text(base_url))))?;
        if !matches!(base_url.scheme(), "http" | "https") {
            return Err(ClientError::Config(format!("base URL must be http or https, got {:?}", base_url.scheme())));
        }
        if base_url.scheme() == "http" && !plain_http_allowed(&base_url, plain_http_hosts) {
            let host = base_url.host_str().unwrap_or_default();
            return Err(ClientError::Config(format!(
                "base URL {}: plain http:// to {host} would send the service key unencrypted; use https://, \
                 or name the host to allow it ({PLAIN_HTTP_HOSTS_VAR}={host}, or \
                 ClientConfig::new_allowing_plain_http); loopback hosts are always allowed",
                redacted(&base_url)
            )));
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

    /// The root every `rpc/<name>` is resolved against, with a trailing
    /// slash. It may carry a password: print [`redacted_url`](Self::redacted_url).
    pub fn base_url(&self) -> &Url {
        &self.base_url
    }

    /// The base URL for logs and reports: any password it carries replaced
    /// by `***`.
    pub fn redacted_url(&self) -> String {
        redacted(&self.base_url)
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
        let authorization = (!self.key_kind.is_supabase_api_key()).then(|| format!("Bearer {}", self.service_key));
        Ok(AuthHeaders { authorization, apikey })
    }
}

impl fmt::Debug for ClientConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientConfig")
            .field("base_url", &self.redacted_url())
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

/// Whether plain `http://` may reach `url`'s host: loopback, or one named.
pub(super) fn plain_http_allowed(url: &Url, named: &[&str]) -> bool {
    let loopback = match url.host() {
        Some(url::Host::Domain(name)) => name.eq_ignore_ascii_case("localhost"),
        Some(url::Host::Ipv4(address)) => address.is_loopback(),
        Some(url::Host::Ipv6(address)) => address.is_loopback(),
        None => false,
    };
    let host = url.host_str().unwrap_or_default();
    loopback || named.iter().any(|name| !name.is_empty() && name.eq_ignore_ascii_case(host))
}

/// `url` with any password replaced by `***`.
pub(super) fn redacted(url: &Url) -> String {
    let mut url = url.clone();
    if url.password().is_some() {
        let _ = url.set_password(Some("***"));
    }
    url.to_string()
}

/// `text` redacted when it parses as a URL with a password; else as given
/// only when it has no `@` (where a password could hide), else elided.
fn redacted_text(text: &str) -> String {
    match Url::parse(text) {
        Ok(url) => redacted(&url),
        Err(_) if text.contains('@') => "<a URL with credentials>".to_owned(),
        Err(_) => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_http_reaches_loopback_and_named_hosts_only() {
        for url in ["http://localhost:3000", "http://127.0.0.1:3000", "http://127.8.9.1", "http://[::1]:3000"] {
            assert!(ClientConfig::new(url, "k").is_ok(), "{url}");
        }
        for url in ["http://postgrest.internal:3000", "http://10.0.0.5:3000", "http://ref.supabase.co/rest/v1"] {
            let refused = ClientConfig::new(url, "k").expect_err(url).to_string();
            assert!(refused.contains("unencrypted") && refused.contains(PLAIN_HTTP_HOSTS_VAR), "{refused}");
        }
        let named =
            ClientConfig::new_allowing_plain_http("http://PostgREST.internal:3000", "k", &["postgrest.internal"]);
        assert!(named.is_ok());
        let other = ClientConfig::new_allowing_plain_http("http://other.internal:3000", "k", &["postgrest.internal"]);
        assert!(other.is_err());
        assert!(ClientConfig::new("https://postgrest.internal", "k").is_ok());
    }

    #[test]
    fn a_password_in_the_url_is_never_printed() {
        let config = ClientConfig::new("https://user:hunter2@plane.example/rest/v1", "k").unwrap();
        for printed in [format!("{config:?}"), config.redacted_url()] {
            assert!(!printed.contains("hunter2") && printed.contains("user:***@plane.example"), "{printed}");
        }
        let refused = ClientConfig::new("http://user:hunter2@plane.example", "k").unwrap_err().to_string();
        assert!(!refused.contains("hunter2"), "{refused}");
    }

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
        assert!(matches!(ClientConfig::new("http://localhost?a=1", "k"), Err(ClientError::Config(_))));
        assert!(matches!(ClientConfig::new("http://localhost", ""), Err(ClientError::Config(_))));
        let config = ClientConfig::new("http://localhost", "k").unwrap();
        assert!(matches!(config.clone().with_max_rows(0), Err(ClientError::Config(_))));
        assert!(matches!(config.clone().with_max_rows(MAX_MAX_ROWS + 1), Err(ClientError::Config(_))));
        assert!(config.with_max_rows(MAX_MAX_ROWS).is_ok());
    }

    /// A legacy `service_role`-shaped JWT (not signed by anyone).
    #[test]
    fn the_deadline_defaults_below_api_gateways_and_must_be_above_zero() {
        let config = ClientConfig::new("http://localhost", "k").unwrap();
        assert_eq!(config.deadline(), DEFAULT_DEADLINE);
        assert!(DEFAULT_DEADLINE < Duration::from_secs(29));
        assert!(matches!(config.clone().with_deadline(Duration::ZERO), Err(ClientError::Config(_))));
        assert_eq!(config.with_deadline(Duration::from_millis(2500)).unwrap().deadline(), Duration::from_millis(2500));
    }

    #[test]
    fn debug_never_prints_secrets() {
        let config = ClientConfig::new("http://localhost", "secret-service-key").unwrap().with_apikey("secret-apikey");
        let printed = format!("{config:?}");
        assert!(!printed.contains("secret"), "{printed}");
        assert!(printed.contains("<redacted>"));
    }
}
