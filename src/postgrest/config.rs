//! Where the PostgREST server is and how to talk to it.

use std::fmt;
use std::time::Duration;

use url::Url;

use super::error::ClientError;
use super::retry::RetryConfig;

/// Supabase's default `api.max_rows`, and the cap this client assumes unless told.
pub const DEFAULT_MAX_ROWS: u32 = 1000;

/// The largest row cap this client accepts: the plane's bounded functions
/// refuse larger limits, so a larger cap would only move the refusal from
/// here to the server.
pub const MAX_MAX_ROWS: u32 = 100_000;

/// The largest response body the client reads unless told otherwise: 8 MiB.
/// A claim row holds at most a 64 KiB answer by default, and the largest
/// bounded read (100,000 rows of `id,retain_until`) is about 7.5 MB.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 8 * 1024 * 1024;

/// Configuration of a [`PostgrestClient`](super::PostgrestClient).
///
/// `Debug` never prints the service key or the `apikey`.
#[derive(Clone)]
pub struct ClientConfig {
    pub(crate) base_url: Url,
    pub(crate) service_key: String,
    pub(crate) apikey: Option<String>,
    pub(crate) schema: String,
    pub(crate) max_rows: u32,
    pub(crate) request_timeout: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) pool_max_idle_per_host: usize,
    pub(crate) retry: RetryConfig,
    pub(crate) max_response_bytes: usize,
}

impl ClientConfig {
    /// A server at `base_url`, called with `service_key` as the Bearer token.
    ///
    /// `base_url` is PostgREST's root: `http://host:3000` for plain
    /// PostgREST, `https://<ref>.supabase.co/rest/v1` for Supabase. Defaults:
    /// schema `agent`, `max_rows` 1000, 15 s request and 5 s connect timeouts,
    /// [`RetryConfig::default`], no `apikey`, bodies up to
    /// [`DEFAULT_MAX_RESPONSE_BYTES`].
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
        Ok(ClientConfig {
            base_url,
            service_key,
            apikey: None,
            schema: "agent".into(),
            max_rows: DEFAULT_MAX_ROWS,
            // Above PostgREST's 10 s db-pool-acquisition-timeout, so its 504
            // PGRST003 ("never ran", always safe to retry) arrives before our
            // own timeout ("may have run") would.
            request_timeout: Duration::from_secs(15),
            connect_timeout: Duration::from_secs(5),
            pool_max_idle_per_host: 64,
            retry: RetryConfig::default(),
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
        })
    }

    /// Reads `IDEM_POSTGREST_URL` (or `SUPABASE_URL`, to which `/rest/v1` is
    /// added), `IDEM_SERVICE_KEY` (or `SUPABASE_SERVICE_ROLE_KEY`),
    /// `IDEM_APIKEY` (with Supabase it defaults to the service key) and
    /// `IDEM_MAX_ROWS`. `Ok(None)` when no URL is set.
    pub fn from_env() -> Result<Option<Self>, ClientError> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let supabase = var("SUPABASE_URL");
        let url = match (var("IDEM_POSTGREST_URL"), &supabase) {
            (Some(url), _) => url,
            (None, Some(project)) => format!("{}/rest/v1", project.trim_end_matches('/')),
            (None, None) => return Ok(None),
        };
        let key = var("IDEM_SERVICE_KEY").or_else(|| var("SUPABASE_SERVICE_ROLE_KEY")).ok_or_else(|| {
            ClientError::Config("a PostgREST URL is set but no IDEM_SERVICE_KEY / SUPABASE_SERVICE_ROLE_KEY".into())
        })?;
        let mut config = ClientConfig::new(&url, key.clone())?;
        config.apikey = var("IDEM_APIKEY").or(supabase.map(|_| key));
        if let Some(rows) = var("IDEM_MAX_ROWS") {
            let rows =
                rows.parse().map_err(|_| ClientError::Config(format!("IDEM_MAX_ROWS {rows:?} is not a number")))?;
            config = config.with_max_rows(rows)?;
        }
        Ok(Some(config))
    }

    /// Sends `apikey: <key>` on every request, as Supabase's gateway requires.
    pub fn with_apikey(mut self, apikey: impl Into<String>) -> Self {
        self.apikey = Some(apikey.into());
        self
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
}

impl fmt::Debug for ClientConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientConfig")
            .field("base_url", &self.base_url.as_str())
            .field("service_key", &"<redacted>")
            .field("apikey", &self.apikey.as_ref().map(|_| "<redacted>"))
            .field("schema", &self.schema)
            .field("max_rows", &self.max_rows)
            .field("request_timeout", &self.request_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("pool_max_idle_per_host", &self.pool_max_idle_per_host)
            .field("retry", &self.retry)
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

    #[test]
    fn debug_never_prints_secrets() {
        let config = ClientConfig::new("http://x", "secret-service-key").unwrap().with_apikey("secret-apikey");
        let printed = format!("{config:?}");
        assert!(!printed.contains("secret"), "{printed}");
        assert!(printed.contains("<redacted>"));
    }
}
