//! The tower [`Service`] the layer wraps a handler in: it hands each
//! request to a task of its own, which [`handle`](super::future::handle)s it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::http::{Request, Response};
use tower_service::Service;
use tracing::Instrument;

use super::config::Config;
use super::future;
use super::problem::Problem;
use crate::repo::IdempotencyRepository;

/// The service [`IdempotencyKeyLayer`](super::IdempotencyKeyLayer) wraps a handler in.
pub struct IdempotencyKey<S, R> {
    inner: S,
    config: Arc<Config<R>>,
}

impl<S, R> IdempotencyKey<S, R> {
    /// `inner` behind the layer configured as `config`.
    pub(super) fn new(inner: S, config: Arc<Config<R>>) -> Self {
        IdempotencyKey { inner, config }
    }
}

impl<S, R> std::fmt::Debug for IdempotencyKey<S, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyKey").field("config", &self.config).finish_non_exhaustive()
    }
}

impl<S: Clone, R> Clone for IdempotencyKey<S, R> {
    fn clone(&self) -> Self {
        IdempotencyKey { inner: self.inner.clone(), config: self.config.clone() }
    }
}

impl<S, R> Service<Request<Body>> for IdempotencyKey<S, R>
where
    S: Service<Request<Body>, Response = Response<Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    R: IdempotencyRepository + 'static,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        // The clone that was made ready serves this request.
        let fresh = self.inner.clone();
        let ready = std::mem::replace(&mut self.inner, fresh);
        let config = self.config.clone();
        // A task of its own: a client that hangs up must not cancel a claim
        // half-way (an effect made and never journaled would run again once
        // the lease passed).
        let lifecycle = tokio::spawn(future::handle(config, ready, request).in_current_span());
        Box::pin(async move {
            match lifecycle.await {
                Ok(answer) => answer,
                Err(failed) => {
                    tracing::error!(%failed, "the Idempotency-Key task failed");
                    Ok(Problem::handler_failed().into_response())
                }
            }
        })
    }
}
