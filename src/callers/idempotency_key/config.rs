//! What the layer is configured with: the settings its builder sets,
//! shared by every request it serves.

use std::sync::Arc;
use std::time::Duration;

use axum::http::request::Parts;
use axum::http::{HeaderName, Method};
use uuid::Uuid;

use crate::error::InvalidInput;
use crate::service::{IdempotencyService, Timing};

/// What a handler's answer above the journal's limit becomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OversizeResponse {
    /// The journal keeps its status and headers, and the first caller and
    /// every repeat get them with an empty body and
    /// `Idempotent-Body-Omitted: <bytes>`.
    #[default]
    OmitBody,
    /// The first caller gets a 500 problem instead, and so does every repeat:
    /// for an API whose clients cannot act on an answer without its body.
    Refuse,
}

/// Resolves the tenant (the plane's organization) of a request, for example
/// from its verified auth token. `None` answers 401.
pub type TenantOf = dyn Fn(&Parts) -> Option<Uuid> + Send + Sync;

/// Resolves the caller of a request within its tenant (a user id, an API
/// client id, the subject of its verified token). `None` answers 401.
pub type PrincipalOf = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// Whose keys a key is among.
#[derive(Clone)]
pub(super) enum Callers {
    /// Neither chosen: every keyed request is refused as not configured.
    Unchosen,
    /// Each caller's keys are its own.
    Each(Arc<PrincipalOf>),
    /// Every caller of a tenant shares its keys.
    Shared,
}

impl std::fmt::Debug for Callers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Callers::Unchosen => "Unchosen",
            Callers::Each(_) => "Each",
            Callers::Shared => "Shared",
        })
    }
}

impl<R> std::fmt::Debug for Config<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyKeyLayer")
            .field("methods", &self.methods)
            .field("required", &self.required)
            .field("callers", &self.callers)
            .field("body_limit", &self.body_limit)
            .field("response_body_limit", &self.response_body_limit)
            .field("handler_timeout", &self.handler_timeout)
            .field("journal_deadline", &self.journal_deadline)
            .field("lease_margin", &self.lease_margin)
            .field("heartbeat", &self.heartbeat)
            .field("counted_headers", &self.counted_headers)
            .field("kept_headers", &self.kept_headers)
            .field("oversize", &self.oversize)
            .field("fail_open", &self.fail_open)
            .finish_non_exhaustive()
    }
}

/// What the layer was configured with, shared by every request it serves.
pub(super) struct Config<R> {
    pub(super) service: Arc<IdempotencyService<R>>,
    pub(super) tenant: Arc<TenantOf>,
    pub(super) callers: Callers,
    pub(super) methods: Vec<Method>,
    pub(super) required: bool,
    pub(super) body_limit: usize,
    pub(super) response_body_limit: usize,
    pub(super) handler_timeout: Duration,
    pub(super) journal_deadline: Duration,
    pub(super) lease_margin: Duration,
    /// The heartbeat lease, when the claim is kept alive by one.
    pub(super) heartbeat: Option<Duration>,
    pub(super) counted_headers: Vec<HeaderName>,
    pub(super) kept_headers: Vec<HeaderName>,
    pub(super) oversize: OversizeResponse,
    pub(super) fail_open: bool,
    pub(super) in_flight_retry_after: u64,
    pub(super) unavailable_retry_after: u64,
}

impl<R> Clone for Config<R> {
    fn clone(&self) -> Self {
        Config {
            service: self.service.clone(),
            tenant: self.tenant.clone(),
            callers: self.callers.clone(),
            methods: self.methods.clone(),
            required: self.required,
            body_limit: self.body_limit,
            response_body_limit: self.response_body_limit,
            handler_timeout: self.handler_timeout,
            journal_deadline: self.journal_deadline,
            lease_margin: self.lease_margin,
            heartbeat: self.heartbeat,
            counted_headers: self.counted_headers.clone(),
            kept_headers: self.kept_headers.clone(),
            oversize: self.oversize,
            fail_open: self.fail_open,
            in_flight_retry_after: self.in_flight_retry_after,
            unavailable_retry_after: self.unavailable_retry_after,
        }
    }
}

impl<R> Config<R> {
    /// The handler's timeout, the journal's deadline and the margin: the
    /// lease is their sum, or the heartbeat lease when one keeps the claim
    /// alive. Checked when they are set.
    pub(super) fn timing(&self) -> Result<Timing, InvalidInput> {
        let timing = Timing::new(self.handler_timeout, self.journal_deadline, self.lease_margin)?;
        match self.heartbeat {
            Some(lease) => timing.with_heartbeats(lease),
            None => Ok(timing),
        }
    }
}
