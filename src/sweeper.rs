//! The retention sweeper: deletes claims past `retain_until`, a bounded pass
//! at a time. Unfinished work (a claim still processing that carries its
//! request: acknowledged, and nobody re-drove it) is never deleted: the pass
//! journals it as a dead letter (`swept_unredriven`) and counts it, so it
//! is listed among the failures and can be sent back after a fix.
//!
//! An unbounded delete would hold row locks over every expired claim of
//! every tenant, on the table the tool call path writes. So a pass reads at
//! most `bound` expired ids (oldest first) and deletes those, re-checking
//! retention in the same statement. The READ count says whether the sweeper
//! keeps up: a pass whose read fills its bound leaves rows for the next pass
//! and logs a warning. The delete count says something else (a writer that
//! removed or extended a claim between the read and the delete lowers it)
//! and is never used to judge the backlog.
//!
//! The bound must not exceed the server's row cap: PostgREST would truncate
//! the read there and report it only in `Content-Range`. A larger bound is
//! refused before any request, never clamped; a server whose real cap is
//! lower than configured is caught as [`ClientError::Truncated`].

use serde::Serialize;
use tracing::Instrument;
use uuid::Uuid;

use crate::error::Error;
use crate::postgrest::{ClientError, PostgrestClient};
use crate::repo::{ExpiredClaims, PostgrestRepository};

pub use crate::repo::{ExpiredClaim, Retired};

/// What one pass did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SweepReport {
    /// Expired claims the pass read. Equal to `bound` means a backlog.
    pub read: u64,
    /// Claims it deleted (those still past retention at the delete).
    pub deleted: u64,
    /// Unfinished claims it journaled as dead letters instead of deleting
    /// them: work nobody re-drove before its retention passed.
    pub dead_lettered: u64,
    /// The pass's bound.
    pub bound: u64,
    /// True when the read filled the bound: more expired claims are waiting.
    pub filled: bool,
}

/// Runs bounded sweeper passes.
#[derive(Debug, Clone)]
pub struct Sweeper<R = PostgrestRepository> {
    repo: R,
    bound: u64,
}

impl Sweeper<PostgrestRepository> {
    /// A sweeper through PostgREST, over `client`, reading at most `bound`
    /// claims a pass. See [`Sweeper::over`] for the refusals.
    pub fn new(client: PostgrestClient, bound: u64) -> Result<Self, ClientError> {
        Sweeper::over(PostgrestRepository::new(client), bound)
    }
}

impl<R: ExpiredClaims> Sweeper<R> {
    /// A sweeper over any [`ExpiredClaims`], reading at most `bound` claims
    /// a pass.
    ///
    /// Refused with [`ClientError::BoundAboveCap`] when `bound` exceeds the
    /// repository's row cap (for PostgREST the configured `max_rows`:
    /// PostgREST's `db-max-rows`, `PGRST_DB_MAX_ROWS`, Supabase's
    /// `api.max_rows`), and with [`ClientError::Config`] when it is zero.
    /// Nothing is sent either way.
    pub fn over(repo: R, bound: u64) -> Result<Self, ClientError> {
        let cap = repo.max_bound();
        if bound > cap {
            return Err(ClientError::BoundAboveCap { bound, cap });
        }
        if bound == 0 {
            return Err(ClientError::Config("the sweep bound must be at least 1".into()));
        }
        Ok(Sweeper { repo, bound })
    }

    /// The bound.
    pub fn bound(&self) -> u64 {
        self.bound
    }

    /// One pass: read, delete, report. Warns when the read filled the bound.
    pub async fn pass(&self) -> Result<SweepReport, Error> {
        let span = tracing::info_span!(
            "idempotency.sweep",
            bound = self.bound,
            read = tracing::field::Empty,
            deleted = tracing::field::Empty,
            dead_lettered = tracing::field::Empty,
            filled = tracing::field::Empty
        );
        let expired = self.read_expired().instrument(span.clone()).await?;
        let ids: Vec<Uuid> = expired.iter().map(|claim| claim.id).collect();
        let Retired { deleted, dead_lettered } = self.delete(&ids).instrument(span.clone()).await?;
        let report = SweepReport {
            read: ids.len() as u64,
            deleted,
            dead_lettered,
            bound: self.bound,
            filled: ids.len() as u64 >= self.bound,
        };
        span.record("read", report.read)
            .record("deleted", report.deleted)
            .record("dead_lettered", report.dead_lettered)
            .record("filled", report.filled);
        metrics::counter!(crate::telemetry::SWEEP_READ_TOTAL).increment(report.read);
        metrics::counter!(crate::telemetry::SWEEP_DELETED_TOTAL).increment(report.deleted);
        metrics::counter!(crate::telemetry::SWEEP_DEAD_LETTERED_TOTAL).increment(report.dead_lettered);
        if report.filled {
            metrics::counter!(crate::telemetry::SWEEP_FILLED_TOTAL).increment(1);
        }
        span.in_scope(|| {
            if report.dead_lettered > 0 {
                tracing::warn!(
                    dead_lettered = report.dead_lettered,
                    drop_reason = "swept_unredriven",
                    "unfinished work passed its retention with nobody re-driving it: journaled as dead letters \
                     (idem failures lists them; idem redrive --failed sends them back after a fix)"
                );
            }
            if report.filled {
                tracing::warn!(
                    read = report.read,
                    bound = report.bound,
                    deleted = report.deleted,
                    "sweep read filled its bound: expired claims are waiting for the next pass"
                );
            } else {
                tracing::info!(read = report.read, deleted = report.deleted, "sweep pass");
            }
        });
        Ok(report)
    }

    /// Reads up to `bound` expired claims, oldest first. Fails with
    /// [`ClientError::Truncated`] when the server cut the read short.
    pub async fn read_expired(&self) -> Result<Vec<ExpiredClaim>, Error> {
        self.repo.expired(self.bound).await
    }

    /// Retires those of `ids` still past retention (see
    /// [`ExpiredClaims::retire_expired`]); answers how many it deleted and
    /// how many it journaled as dead letters. At most `bound` ids, like the
    /// read that found them. Sent again after a lost response, so the
    /// counts can under-report what a pass did; the backlog is judged by
    /// the read, never by these counts. Called with no ids too: each call
    /// also trims the plane's replay counts older than 7 days.
    pub async fn delete(&self, ids: &[Uuid]) -> Result<Retired, Error> {
        if ids.len() as u64 > self.bound {
            return Err(ClientError::Config(format!(
                "{} ids to delete, more than the pass bound {}",
                ids.len(),
                self.bound
            ))
            .into());
        }
        self.repo.retire_expired(ids).await
    }
}
