//! The console's JSON API under `/api/`: the reads each panel shows
//! (`reads`), and the three actions (`actions`), each answering what
//! happened in a sentence (`message`) besides its figures; what a call
//! failed with (`error`). Every read is one of the plane's own bounded
//! functions. The service key stays in this process: the page only ever
//! talks to this API.

mod actions;
mod error;
mod reads;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::json;
use uuid::Uuid;

use idempotency_plane::repo::{ClaimStatus, FailureRow};
use idempotency_plane::{PostgrestClient, PostgrestRepository};

pub(crate) use error::ApiError;

use super::routes::Routes;

/// How many rows a panel asks for at most, below the row cap.
const PANEL_ROWS: u32 = 100;

/// How long the plane's row cap, once read, holds before it is read again
/// (at once after the plane refused an argument: the cap may have dropped).
const ROW_CAP_HELD_FOR: Duration = Duration::from_secs(30);

/// What the handlers share.
#[derive(Debug)]
pub(crate) struct Console {
    /// The plane, with the service key, as configured.
    repo: PostgrestRepository,
    /// The re-drive routes the operator named.
    routes: Routes,
    /// The plane as last held to its row cap, and when that cap was read.
    capped: tokio::sync::Mutex<Option<(Plane, Instant)>>,
}

/// The plane held to its row cap: the lower of the configured one (the
/// server's, `IDEM_MAX_ROWS`) and the plane's own
/// (`agent.idempotency_settings.max_rows`), which every function that
/// answers rows refuses a larger limit (or `p_row_cap`) above.
#[derive(Debug, Clone)]
struct Plane {
    /// A repository whose configured row cap is `cap`, so that what the
    /// library passes as `p_row_cap` is within the plane's too.
    repo: PostgrestRepository,
    /// The row cap every read and action stays within.
    cap: u32,
}

impl Plane {
    /// How many rows a panel asks for: [`PANEL_ROWS`], or the row cap when
    /// lower.
    fn panel_rows(&self) -> u32 {
        PANEL_ROWS.min(self.cap)
    }
}

impl Console {
    pub(crate) fn new(repo: PostgrestRepository, routes: Routes) -> Self {
        Console { repo, routes, capped: tokio::sync::Mutex::new(None) }
    }

    /// The plane held to its row cap, read from the plane
    /// (`idempotency_row_cap`) at most every [`ROW_CAP_HELD_FOR`].
    async fn plane(&self) -> Result<Plane, ApiError> {
        let mut capped = self.capped.lock().await;
        if let Some((plane, read_at)) = capped.as_ref() {
            if read_at.elapsed() < ROW_CAP_HELD_FOR {
                return Ok(plane.clone());
            }
        }
        let configured = self.repo.client().config().max_rows();
        let own = self.repo.plane_row_cap().await?;
        let cap = u32::try_from(own).unwrap_or(u32::MAX).clamp(1, configured);
        let repo = match capped.as_ref() {
            Some((plane, _)) if plane.cap == cap => plane.repo.clone(),
            _ if cap == configured => self.repo.clone(),
            _ => {
                let config = self.repo.client().config().clone().with_max_rows(cap)?;
                PostgrestRepository::new(PostgrestClient::new(config)?)
            }
        };
        if cap < configured {
            tracing::debug!(cap, configured, "console: the plane's own row cap is below the configured one");
        }
        let plane = Plane { repo, cap };
        *capped = Some((plane.clone(), Instant::now()));
        Ok(plane)
    }

    /// `error` as the API answers it; a refused argument has the plane's row
    /// cap read afresh by the next call.
    async fn failed(&self, error: impl Into<ApiError>) -> ApiError {
        let error = error.into();
        if matches!(error, ApiError::Refused { status: StatusCode::BAD_REQUEST, .. }) {
            *self.capped.lock().await = None;
        }
        error
    }
}

type Answer = Result<Json<serde_json::Value>, ApiError>;

/// The API's routes, under `/api/`.
pub(crate) fn router(console: Arc<Console>) -> Router {
    Router::new()
        .route("/api/about", get(reads::about))
        .route("/api/in-flight", get(reads::in_flight))
        .route("/api/processing", get(reads::processing))
        .route("/api/orphans", get(reads::orphans))
        .route("/api/failures", get(reads::failures))
        .route("/api/failure-counts", get(reads::failure_counts))
        .route("/api/sweep-backlog", get(reads::sweep_backlog))
        .route("/api/activity", get(reads::activity))
        .route("/api/send-back", post(actions::send_back))
        .route("/api/redrive", post(actions::redrive_now))
        .route("/api/abandon", post(actions::abandon))
        .with_state(console)
}

/// `{"rows": …, "bound": …}`: a panel's rows and the bound they were read
/// with (a full panel may hide more).
fn rows(rows: impl Serialize, bound: u32) -> Answer {
    Ok(Json(json!({ "rows": rows, "bound": bound })))
}

/// A failure as the page lists it: the journaled answer itself stays out
/// (its `error` is shown), the rest as `idem failures` prints it.
#[derive(Debug, Serialize)]
struct FailureView {
    id: Uuid,
    organization_id: Uuid,
    scope: String,
    key: String,
    status: ClaimStatus,
    error: Option<String>,
    attempts: u32,
    requeues: u32,
    redrivable: bool,
    claimed_at: DateTime<Utc>,
    first_claimed_at: Option<DateTime<Utc>>,
    retain_until: DateTime<Utc>,
}

impl From<FailureRow> for FailureView {
    fn from(row: FailureRow) -> Self {
        FailureView {
            id: row.id,
            organization_id: row.organization_id,
            scope: row.scope,
            key: row.key,
            status: row.status,
            error: row.error,
            attempts: row.attempts,
            requeues: row.requeues,
            redrivable: row.redrivable,
            claimed_at: row.claimed_at,
            first_claimed_at: row.first_claimed_at,
            retain_until: row.retain_until,
        }
    }
}
