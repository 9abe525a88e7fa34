//! The tower [`Layer`] and its builder: each setting is checked when it is
//! set.

use std::sync::Arc;
use std::time::Duration;

use axum::http::request::Parts;
use axum::http::{HeaderName, Method};
use tower_layer::Layer;
use uuid::Uuid;

use super::config::{Callers, Config, OversizeResponse, PrincipalOf};
use super::service::IdempotencyKey;
use super::stored::is_credential;
use crate::error::InvalidInput;
use crate::repo::IdempotencyRepository;
use crate::service::{IdempotencyService, Timing};

/// A layer setting refused when it is made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A header that carries credentials ([`CREDENTIAL_HEADERS`](super::CREDENTIAL_HEADERS)) cannot be
    /// kept: the journaled answer is replayed to whoever repeats the key.
    #[error("the {name} header carries credentials and is never journaled: a replay would hand it to another caller")]
    CredentialHeader {
        /// The header refused.
        name: HeaderName,
    },
}

/// The layer; see the [module documentation](super) for what it answers.
pub struct IdempotencyKeyLayer<R> {
    config: Config<R>,
}

impl<R> std::fmt::Debug for IdempotencyKeyLayer<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.config.fmt(f)
    }
}

impl<R> Clone for IdempotencyKeyLayer<R> {
    fn clone(&self) -> Self {
        IdempotencyKeyLayer { config: self.config.clone() }
    }
}

/// The lease of a handler timeout, journal deadline and margin, refused
/// when a part that must take time is zero or the whole is outside what
/// the plane accepts (1 s to 24 h).
fn validate_lease(handler_timeout: Duration, journal_deadline: Duration, margin: Duration) -> Result<(), InvalidInput> {
    Timing::new(handler_timeout, journal_deadline, margin).map(|_| ())
}

impl<R: IdempotencyRepository + 'static> IdempotencyKeyLayer<R> {
    /// A layer over `service`, with `tenant` naming each request's
    /// organization. Defaults: POST and PATCH, key required, request bodies
    /// up to 1 MiB, answers buffered up to 8 MiB, handler timeout 30 s,
    /// journal deadline 10 s (lease: 30 s + 10 s + a 5 s margin),
    /// `Content-Type` and `Location` kept with the journaled answer, fail
    /// closed.
    ///
    /// Say whose keys a key is among before serving: per caller
    /// ([`principal`](Self::principal)) or shared by a tenant's callers
    /// ([`shared_across_callers`](Self::shared_across_callers)); until one
    /// is chosen every keyed request is answered 500 `not-configured`.
    pub fn new(
        service: IdempotencyService<R>,
        tenant: impl Fn(&Parts) -> Option<Uuid> + Send + Sync + 'static,
    ) -> Self {
        IdempotencyKeyLayer {
            config: Config {
                service: Arc::new(service),
                tenant: Arc::new(tenant),
                callers: Callers::Unchosen,
                methods: vec![Method::POST, Method::PATCH],
                required: true,
                body_limit: 1024 * 1024,
                response_body_limit: 8 * 1024 * 1024,
                handler_timeout: Duration::from_secs(30),
                journal_deadline: Duration::from_secs(10),
                lease_margin: Duration::from_secs(5),
                heartbeat: None,
                counted_headers: Vec::new(),
                kept_headers: vec![HeaderName::from_static("content-type"), HeaderName::from_static("location")],
                oversize: OversizeResponse::OmitBody,
                fail_open: false,
                in_flight_retry_after: 1,
                unavailable_retry_after: 5,
            },
        }
    }

    fn edit(mut self, change: impl FnOnce(&mut Config<R>)) -> Self {
        change(&mut self.config);
        self
    }

    /// Each caller's keys are its own: `principal` names the caller of a
    /// request within its tenant (a user or API client id, the subject of
    /// a verified token), and the plane's key is scoped by its SHA-256. A
    /// request it names no caller for is answered 401 `no-principal`.
    /// Replaces [`shared_across_callers`](Self::shared_across_callers).
    pub fn principal(self, principal: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> Self {
        let principal: Arc<PrincipalOf> = Arc::new(principal);
        self.edit(|c| c.callers = Callers::Each(principal))
    }

    /// Every caller of a tenant shares its keys: a key one caller used
    /// answers another caller of the tenant with the first answer. For an
    /// API whose tenant is one caller (a service account), or whose callers
    /// coordinate their keys. Replaces [`principal`](Self::principal).
    pub fn shared_across_callers(self) -> Self {
        self.edit(|c| c.callers = Callers::Shared)
    }

    /// The methods that take a key (others pass straight through).
    pub fn methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods = methods.into_iter().collect();
        self.edit(|c| c.methods = methods)
    }

    /// Requests without a key pass straight through, unprotected, instead
    /// of being answered 400.
    pub fn optional(self) -> Self {
        self.edit(|c| c.required = false)
    }

    /// The largest request body buffered, in bytes; a larger one is 413.
    pub fn body_limit(self, bytes: usize) -> Self {
        self.edit(|c| c.body_limit = bytes)
    }

    /// The largest handler answer buffered for the journal, in bytes. A
    /// larger one cannot be returned whole either (it was read to the
    /// limit): the journal keeps its status and headers, and the caller
    /// gets them as every repeat does, with an empty body and
    /// `Idempotent-Body-Omitted` (the limit: the body was at least that
    /// long).
    pub fn response_body_limit(self, bytes: usize) -> Self {
        self.edit(|c| c.response_body_limit = bytes)
    }

    /// How long the handler may run, counted from before its claim, before
    /// it is cancelled and answered a 504 problem, kept for the key (it may
    /// have taken effect before it was cut). The lease is this,
    /// plus the [journal deadline](Self::journal_deadline), plus `margin`,
    /// so a live handler's claim is never taken over, nor one whose answer
    /// is being journaled. Refused when the timeout is zero or the lease is
    /// outside what the plane accepts (1 s to 24 h).
    pub fn handler_timeout(self, timeout: Duration, margin: Duration) -> Result<Self, InvalidInput> {
        validate_lease(timeout, self.config.journal_deadline, margin)?;
        Ok(self.edit(|c| {
            c.handler_timeout = timeout;
            c.lease_margin = margin;
        }))
    }

    /// Claims for `lease` instead of the whole lease, and keeps the claim
    /// alive with a heartbeat every third of it while the handler runs and
    /// its answer is journaled, never past the end the whole lease would
    /// have had: a worker that dies mid-handler frees its key after `lease`,
    /// while a slow live one keeps it. A heartbeat that finds the key taken
    /// over stops the handler (answered 409 `in-flight`: another worker
    /// holds the key now). Refused below 3 s or above what the plane
    /// accepts.
    pub fn heartbeats(self, lease: Duration) -> Result<Self, InvalidInput> {
        Timing::new(self.config.handler_timeout, self.config.journal_deadline, self.config.lease_margin)?
            .with_heartbeats(lease)?;
        Ok(self.edit(|c| c.heartbeat = Some(lease)))
    }

    /// How long writing the handler's answer to the journal may take after
    /// the handler's own timeout has passed (default 10 s). The write is
    /// cut off then, and retried until then when it fails transiently; it
    /// is part of the lease, so another request cannot take the key over
    /// while the answer is still being written. Refused when it is zero or
    /// the lease is outside what the plane accepts (1 s to 24 h).
    pub fn journal_deadline(self, deadline: Duration) -> Result<Self, InvalidInput> {
        validate_lease(self.config.handler_timeout, deadline, self.config.lease_margin)?;
        Ok(self.edit(|c| c.journal_deadline = deadline))
    }

    /// A header that is part of the fingerprint (a currency, an API version).
    pub fn count_header(self, name: HeaderName) -> Self {
        self.edit(|c| c.counted_headers.push(name))
    }

    /// A header of the handler's answer that is journaled and replayed
    /// (besides `Content-Type` and `Location`). A header that carries
    /// credentials ([`CREDENTIAL_HEADERS`](super::CREDENTIAL_HEADERS): `Set-Cookie`, `Authorization`,
    /// …) is refused: a replay would hand one caller's to another.
    pub fn keep_header(self, name: HeaderName) -> Result<Self, ConfigError> {
        if is_credential(name.as_str()) {
            return Err(ConfigError::CredentialHeader { name });
        }
        Ok(self.edit(|c| c.kept_headers.push(name)))
    }

    /// What an answer above the journal's response limit becomes.
    pub fn on_oversize(self, oversize: OversizeResponse) -> Self {
        self.edit(|c| c.oversize = oversize)
    }

    /// When the plane cannot be reached at all (the connection was not
    /// made, or PostgREST answered that it could not reach its database),
    /// run the handler unprotected (logged at error level for every
    /// request) instead of answering 503. Any other failure of a claim is
    /// still 503: the plane may have made the claim, and another request
    /// may hold the key.
    pub fn fail_open(self) -> Self {
        self.edit(|c| c.fail_open = true)
    }
}

impl<S, R> Layer<S> for IdempotencyKeyLayer<R> {
    type Service = IdempotencyKey<S, R>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyKey::new(inner, Arc::new(self.config.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::super::CREDENTIAL_HEADERS;
    use super::*;

    fn layer() -> IdempotencyKeyLayer<crate::repo::MemoryRepository> {
        IdempotencyKeyLayer::new(IdempotencyService::new(crate::repo::MemoryRepository::new()), |_| None)
    }

    #[test]
    fn credential_headers_are_refused_at_build_time_and_others_kept() {
        let named = [
            axum::http::header::SET_COOKIE,
            HeaderName::from_static("set-cookie2"),
            axum::http::header::AUTHORIZATION,
            axum::http::header::PROXY_AUTHORIZATION,
            axum::http::header::PROXY_AUTHENTICATE,
            axum::http::header::WWW_AUTHENTICATE,
            axum::http::header::COOKIE,
        ];
        let every = CREDENTIAL_HEADERS.iter().map(|name| HeaderName::from_static(name));
        for name in named.into_iter().chain(every) {
            match layer().keep_header(name.clone()) {
                Err(ConfigError::CredentialHeader { name: refused }) => assert_eq!(refused, name),
                Ok(_) => panic!("{name} was accepted"),
            }
        }
        let kept = layer().keep_header(HeaderName::from_static("x-request-cost")).expect("an ordinary header");
        assert!(kept.config.kept_headers.iter().any(|name| name == "x-request-cost"));
        let refused = layer().keep_header(axum::http::header::SET_COOKIE).unwrap_err();
        assert!(refused.to_string().contains("set-cookie"), "{refused}");
    }

    #[test]
    fn the_lease_covers_the_handler_the_journal_and_the_margin_and_each_setting_is_validated() {
        let defaults = layer();
        assert_eq!(defaults.config.timing().unwrap().lease(), Duration::from_secs(45));
        let set = layer()
            .handler_timeout(Duration::from_secs(2), Duration::from_secs(1))
            .unwrap()
            .journal_deadline(Duration::from_secs(3))
            .unwrap();
        assert_eq!(set.config.timing().unwrap().lease(), Duration::from_secs(6));
        assert!(matches!(layer().journal_deadline(Duration::ZERO), Err(InvalidInput::ZeroDuration { .. })));
        assert!(matches!(
            layer().handler_timeout(Duration::ZERO, Duration::from_secs(1)),
            Err(InvalidInput::ZeroDuration { .. })
        ));
        // Each is validated with the others: the whole lease stays within 24 h.
        let day = crate::service::MAX_LEASE;
        assert!(matches!(layer().journal_deadline(day), Err(InvalidInput::LeaseTooLong { .. })));
        let long_handler = layer().handler_timeout(day - Duration::from_secs(5), Duration::from_secs(1)).unwrap_err();
        assert!(matches!(long_handler, InvalidInput::LeaseTooLong { .. }), "the default journal deadline counts");
        let short = layer().journal_deadline(Duration::from_millis(100)).unwrap();
        assert!(short.handler_timeout(day - Duration::from_millis(1100), Duration::from_secs(1)).is_ok());
        // A margin below the floor: the last journal attempt could land after the lease.
        assert!(matches!(
            layer().handler_timeout(Duration::from_secs(2), Duration::ZERO),
            Err(InvalidInput::MarginBelowFloor { .. })
        ));
    }
}
