//! The HTTP client: calls `POST /rpc/<function>` and turns every answer into
//! a value or a typed error.

use std::sync::Arc;
use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue, ACCEPT, AUTHORIZATION, CONTENT_TYPE};
use reqwest::StatusCode;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::time::Instant;

use super::codes;
use super::config::ClientConfig;
use super::error::{ClientError, PostgrestError, TransportKind};
use super::range::{ContentRange, ContentRangeError};
use super::retry::{self, Repeat};
use crate::telemetry;

/// A PostgREST client for one server and schema. Cheap to clone: clones share
/// one connection pool.
#[derive(Clone, Debug)]
pub struct PostgrestClient {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    http: reqwest::Client,
    config: ClientConfig,
    requests: std::sync::atomic::AtomicU64,
}

/// A success answer, before decoding.
struct Answer {
    status: StatusCode,
    content_range: Option<Result<ContentRange, ContentRangeError>>,
    body: bytes::Bytes,
}

impl Answer {
    /// The `Content-Range` a counted read must carry.
    fn counted_range(&self, function: &'static str) -> Result<ContentRange, ClientError> {
        match &self.content_range {
            Some(Ok(range)) => Ok(*range),
            Some(Err(source)) => Err(ClientError::ContentRange { function, source: source.clone() }),
            None => Err(ClientError::ContentRange {
                function,
                source: ContentRangeError { value: String::new(), reason: "missing from a counted read" },
            }),
        }
    }
}

impl PostgrestClient {
    /// Builds the client and its connection pool. Fails on a service key or
    /// schema a header cannot carry, and on an `apikey` Supabase's gateway
    /// would refuse next to the service key ([`KeyError::ApikeyDiffers`]).
    ///
    /// [`KeyError::ApikeyDiffers`]: super::KeyError::ApikeyDiffers
    pub fn new(config: ClientConfig) -> Result<Self, ClientError> {
        let auth = config.auth_headers()?;
        let mut headers = HeaderMap::new();
        if let Some(authorization) = &auth.authorization {
            headers.insert(AUTHORIZATION, sensitive(authorization, "service key")?);
        }
        if let Some(apikey) = &auth.apikey {
            headers.insert(HeaderName::from_static("apikey"), sensitive(apikey, "apikey")?);
        }
        let profile = HeaderValue::from_str(&config.schema)
            .map_err(|_| ClientError::Config(format!("schema {:?} cannot be a header", config.schema)))?;
        headers.insert(HeaderName::from_static("content-profile"), profile.clone());
        headers.insert(HeaderName::from_static("accept-profile"), profile);
        headers.insert(ACCEPT, HeaderValue::from_static("application/json"));
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));

        let http = reqwest::Client::builder()
            .default_headers(headers)
            .timeout(config.request_timeout)
            .connect_timeout(config.connect_timeout)
            .pool_max_idle_per_host(config.pool_max_idle_per_host)
            .tcp_nodelay(true)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| ClientError::Config(format!("building the HTTP client: {e}")))?;
        Ok(PostgrestClient { inner: Arc::new(Inner { http, config, requests: std::sync::atomic::AtomicU64::new(0) }) })
    }

    /// HTTP requests this client (and its clones) sent, retries included:
    /// what an operation cost in round trips.
    pub fn requests_sent(&self) -> u64 {
        self.inner.requests.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The configuration this client was built with.
    pub fn config(&self) -> &ClientConfig {
        &self.inner.config
    }

    /// Calls `function` with named arguments and decodes its answer as `T`:
    /// a `Vec` for a set-returning function (`[]` when it returned no row),
    /// the value itself for a scalar.
    pub async fn rpc<T: DeserializeOwned>(
        &self,
        function: &'static str,
        args: &impl Serialize,
        repeat: Repeat,
    ) -> Result<T, ClientError> {
        observed(function, async {
            let answer = self.call(function, args, &[], false, repeat).await?;
            decode(function, &answer.body)
        })
        .await
    }

    /// A counted read with no bound, answering the server's `Content-Range`
    /// and the rows that arrived, without judging truncation. For probes of
    /// the server's real row cap (`idem doctor`); anything that needs every
    /// row uses [`rpc_bounded`](Self::rpc_bounded).
    pub async fn rpc_counted<T: DeserializeOwned>(
        &self,
        function: &'static str,
        args: &impl Serialize,
        select: Option<&str>,
    ) -> Result<(ContentRange, Vec<T>), ClientError> {
        let query: Vec<(&str, &str)> = select.map(|s| ("select", s)).into_iter().collect();
        observed(function, async {
            let answer = self.call(function, args, &query, true, Repeat::Safe).await?;
            let range = answer.counted_range(function)?;
            Ok((range, decode(function, &answer.body)?))
        })
        .await
    }

    /// A read of at most `bound` rows from a function that returns a set of
    /// table rows, which must take the bound as an argument itself.
    ///
    /// Refused with [`ClientError::BoundAboveCap`] before any request when
    /// `bound` exceeds the configured `max_rows`. Sends `Prefer: count=exact`
    /// and fails with [`ClientError::Truncated`] when the server counted more
    /// rows than arrived, so a server whose real cap is lower than configured
    /// is loud, never a silent short page. `select` trims the columns
    /// (`?select=id,retain_until`).
    pub async fn rpc_bounded<T: DeserializeOwned>(
        &self,
        function: &'static str,
        args: &impl Serialize,
        bound: u64,
        select: Option<&str>,
        repeat: Repeat,
    ) -> Result<Vec<T>, ClientError> {
        let cap = u64::from(self.inner.config.max_rows);
        if bound > cap {
            return Err(ClientError::BoundAboveCap { bound, cap });
        }
        if bound == 0 {
            return Ok(Vec::new());
        }
        let query: Vec<(&str, &str)> = select.map(|s| ("select", s)).into_iter().collect();
        observed(function, async {
            let answer = self.call(function, args, &query, true, repeat).await?;
            let range = answer.counted_range(function)?;
            let rows: Vec<T> = decode(function, &answer.body)?;
            let received = rows.len() as u64;
            let Some(total) = range.total() else {
                return Err(ClientError::ContentRange {
                    function,
                    source: ContentRangeError {
                        value: range.to_string(),
                        reason: "the server did not count the rows, so truncation cannot be ruled out",
                    },
                });
            };
            if range.rows() != received {
                return Err(ClientError::Decode {
                    function,
                    reason: format!("Content-Range {range} announces {} rows, the body holds {received}", range.rows()),
                });
            }
            if received > bound {
                // The function ignored its bound: refuse rather than act on more
                // rows than the caller allowed.
                return Err(ClientError::Decode {
                    function,
                    reason: format!("answered {received} rows for a bound of {bound}"),
                });
            }
            if received < total || answer.status == StatusCode::PARTIAL_CONTENT {
                return Err(ClientError::Truncated { function, received, total });
            }
            Ok(rows)
        })
        .await
    }

    /// A bounded call of a function that writes and answers the rows it
    /// wrote (a re-drive), which takes the bound as an argument itself and
    /// puts in every row how many rows it answered (`taken` reads it).
    ///
    /// Refused with [`ClientError::BoundAboveCap`] before any request when
    /// `bound` exceeds the configured `max_rows`. It does not ask the server
    /// to count (a count makes some PostgREST-compatible servers run the
    /// function a second time, and a write must run once): an answer with
    /// fewer rows than its rows say were taken is [`ClientError::Truncated`],
    /// and a `Content-Range` that disagrees with the body is refused.
    pub async fn rpc_bounded_write<T: DeserializeOwned>(
        &self,
        function: &'static str,
        args: &impl Serialize,
        bound: u64,
        taken: impl Fn(&T) -> u64,
        repeat: Repeat,
    ) -> Result<Vec<T>, ClientError> {
        let cap = u64::from(self.inner.config.max_rows);
        if bound > cap {
            return Err(ClientError::BoundAboveCap { bound, cap });
        }
        observed(function, async {
            let answer = self.call(function, args, &[], false, repeat).await?;
            let rows: Vec<T> = decode(function, &answer.body)?;
            let received = rows.len() as u64;
            match &answer.content_range {
                Some(Ok(range)) if range.rows() != received => {
                    return Err(ClientError::Decode {
                        function,
                        reason: format!(
                            "Content-Range {range} announces {} rows, the body holds {received}",
                            range.rows()
                        ),
                    });
                }
                Some(Err(source)) => return Err(ClientError::ContentRange { function, source: source.clone() }),
                _ => {}
            }
            if received > bound {
                return Err(ClientError::Decode {
                    function,
                    reason: format!("answered {received} rows for a bound of {bound}"),
                });
            }
            if let Some(total) = rows.iter().map(&taken).find(|&total| total != received) {
                return Err(ClientError::Truncated { function, received, total });
            }
            Ok(rows)
        })
        .await
    }

    /// Whether [`post_route`](Self::post_route) would send the service key
    /// to `route`: `https://`, or plain `http://` to a loopback host or to
    /// the host and port of a base URL that is plain `http://` itself (one
    /// the configuration allowed). A configuration error otherwise, before
    /// any request.
    pub fn check_route(&self, route: &url::Url) -> Result<(), ClientError> {
        let base = &self.inner.config.base_url;
        // Plain http only where the key already goes in clear: loopback,
        // or the very host and port a plain-http base URL names.
        let same_plain_origin = base.scheme() == "http"
            && route.host_str() == base.host_str()
            && route.port_or_known_default() == base.port_or_known_default();
        let plain_allowed =
            route.scheme() == "http" && (super::config::plain_http_allowed(route, &[]) || same_plain_origin);
        if route.scheme() == "https" || plain_allowed {
            return Ok(());
        }
        Err(ClientError::Config(format!(
            "route {}: the service key goes only over https://, or plain http:// to loopback or the plane's own host",
            super::config::redacted(route)
        )))
    }

    /// POSTs `body` as JSON to `route`, a URL of this deployment outside
    /// PostgREST that takes the service key (an Edge Function's re-drive
    /// route, `https://<ref>.supabase.co/functions/v1/webhooks/redrive`),
    /// with this client's authentication, and decodes its 2xx answer as `T`.
    /// Sent once, never retried: such a route does work, and the caller's
    /// schedule is its retry. Cut at the client's request timeout; its
    /// answer bounded like every answer. `route` must be `https://`, or
    /// plain `http://` to a loopback host or to the base URL's own host
    /// (which the configuration already allowed): the service key never
    /// crosses a network unencrypted.
    pub async fn post_route<T: DeserializeOwned>(
        &self,
        route: &url::Url,
        body: &impl Serialize,
    ) -> Result<T, ClientError> {
        const ROUTE: &str = "route";
        self.check_route(route)?;
        let body = serde_json::to_vec(body).map_err(|e| ClientError::Decode {
            function: ROUTE,
            reason: format!("the body does not serialize: {e}"),
        })?;
        let answer = observed(ROUTE, async {
            self.inner.requests.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let transport = |source: reqwest::Error| ClientError::Transport {
                function: ROUTE,
                kind: transport_kind(&source),
                source,
            };
            let response = self.inner.http.post(route.clone()).body(body).send().await.map_err(transport)?;
            let status = response.status();
            let body = read_body(ROUTE, response, self.inner.config.max_response_bytes).await?;
            if status.is_success() {
                return Ok(body);
            }
            Err(ClientError::Http {
                function: ROUTE,
                status: status.as_u16(),
                body_excerpt: String::from_utf8_lossy(&body[..body.len().min(256)]).into_owned(),
                retry_after: None,
            })
        })
        .await?;
        decode(ROUTE, &answer)
    }

    /// Sends the call, retrying what [`ClientError::is_retryable`] allows
    /// within the configured deadline ([`retry::with_retries`]).
    async fn call(
        &self,
        function: &'static str,
        args: &impl Serialize,
        query: &[(&str, &str)],
        count: bool,
        repeat: Repeat,
    ) -> Result<Answer, ClientError> {
        let body = bytes::Bytes::from(
            serde_json::to_vec(args)
                .map_err(|e| ClientError::Decode { function, reason: format!("arguments do not serialize: {e}") })?,
        );
        let config = &self.inner.config;
        let url = config
            .base_url
            .join(&format!("rpc/{function}"))
            .map_err(|e| ClientError::Config(format!("function name {function:?}: {e}")))?;
        retry::with_retries(function, &config.retry, config.deadline, repeat, || {
            self.attempt(function, &url, query, body.clone(), count)
        })
        .await
    }

    async fn attempt(
        &self,
        function: &'static str,
        url: &url::Url,
        query: &[(&str, &str)],
        body: bytes::Bytes,
        count: bool,
    ) -> Result<Answer, ClientError> {
        self.inner.requests.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut request = self.inner.http.post(url.clone()).body(body);
        if !query.is_empty() {
            request = request.query(query);
        }
        if count {
            request = request.header("prefer", "count=exact");
        }
        let transport =
            |source: reqwest::Error| ClientError::Transport { function, kind: transport_kind(&source), source };
        let response = request.send().await.map_err(transport)?;
        let status = response.status();
        let content_range = response.headers().get("content-range").map(|value| {
            value
                .to_str()
                .map_err(|_| ContentRangeError {
                    value: String::from_utf8_lossy(value.as_bytes()).into_owned(),
                    reason: "not visible ASCII",
                })
                .and_then(str::parse)
        });
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let body = read_body(function, response, self.inner.config.max_response_bytes).await?;
        if status.is_success() {
            return Ok(Answer { status, content_range, body });
        }
        Err(match serde_json::from_slice::<Box<PostgrestError>>(&body) {
            Ok(error) if error.code == codes::LOCK_NOT_AVAILABLE => ClientError::LockTimeout { function, error },
            Ok(error) => ClientError::Api { function, status: status.as_u16(), error, retry_after },
            Err(_) => ClientError::Http {
                function,
                status: status.as_u16(),
                body_excerpt: String::from_utf8_lossy(&body[..body.len().min(256)]).into_owned(),
                retry_after,
            },
        })
    }
}

/// Runs one public call, recording its latency (retries included) in
/// `idempotency_rpc_duration_seconds{function}` and a failure in
/// `idempotency_rpc_errors_total{function, kind}`.
async fn observed<T>(
    function: &'static str,
    call: impl std::future::Future<Output = Result<T, ClientError>>,
) -> Result<T, ClientError> {
    let started = Instant::now();
    let result = call.await;
    metrics::histogram!(telemetry::RPC_DURATION_SECONDS, "function" => function)
        .record(started.elapsed().as_secs_f64());
    if let Err(error) = &result {
        metrics::counter!(telemetry::RPC_ERRORS_TOTAL, "function" => function, "kind" => error.kind()).increment(1);
    }
    result
}

/// Reads the body, refusing one longer than `limit` bytes without reading
/// the rest: a server (or a proxy) must not be able to fill our memory.
async fn read_body(
    function: &'static str,
    mut response: reqwest::Response,
    limit: usize,
) -> Result<bytes::Bytes, ClientError> {
    let too_large = ClientError::ResponseTooLarge { function, limit };
    if response.content_length().is_some_and(|length| length > limit as u64) {
        return Err(too_large);
    }
    let mut body = bytes::BytesMut::new();
    let transport = |source: reqwest::Error| ClientError::Transport { function, kind: transport_kind(&source), source };
    while let Some(chunk) = response.chunk().await.map_err(transport)? {
        if body.len() + chunk.len() > limit {
            return Err(too_large);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body.freeze())
}

fn decode<T: DeserializeOwned>(function: &'static str, body: &[u8]) -> Result<T, ClientError> {
    serde_json::from_slice(body).map_err(|e| ClientError::Decode { function, reason: e.to_string() })
}

fn sensitive(value: &str, what: &str) -> Result<HeaderValue, ClientError> {
    let mut header = HeaderValue::from_str(value)
        .map_err(|_| ClientError::Config(format!("the {what} holds characters a header cannot carry")))?;
    header.set_sensitive(true);
    Ok(header)
}

/// Classifies a reqwest failure by whether the request can have reached the server.
fn transport_kind(error: &reqwest::Error) -> TransportKind {
    if error.is_connect() {
        TransportKind::Connect
    } else if error.is_timeout() {
        TransportKind::Timeout
    } else if error.is_request() || error.is_body() || error.is_decode() {
        TransportKind::Interrupted
    } else {
        TransportKind::Other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(base: &str) -> PostgrestClient {
        let config = ClientConfig::new(base, "sb_secret_test").expect("a configuration");
        PostgrestClient::new(config).expect("a client")
    }

    #[test]
    fn the_service_key_goes_to_a_route_only_over_https_or_to_a_plain_http_origin_already_allowed() {
        let route = |text: &str| url::Url::parse(text).expect("a URL");
        let hosted = client("https://ref.supabase.co/rest/v1");
        assert!(hosted.check_route(&route("https://ref.supabase.co/functions/v1/webhooks/redrive")).is_ok());
        assert!(hosted.check_route(&route("http://ref.supabase.co/functions/v1/webhooks/redrive")).is_err());
        assert!(hosted.check_route(&route("http://example.com/redrive")).is_err());
        assert!(hosted.check_route(&route("http://127.0.0.1:8081/redrive")).is_ok(), "loopback");
        assert!(hosted.check_route(&route("ftp://ref.supabase.co/redrive")).is_err());
        let local = client("http://127.0.0.1:3000");
        assert!(local.check_route(&route("http://127.0.0.1:9000/redrive")).is_ok());
    }
}
