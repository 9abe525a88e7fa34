//! The console's JSON API under `/api/`: the reads each panel shows, and the
//! three actions. Every read is one of the plane's own bounded functions;
//! every action answers what happened in a sentence (`message`) besides its
//! figures. The service key stays in this process: the page only ever
//! talks to this API.

use std::sync::Arc;

use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::json;
use uuid::Uuid;

use idempotency_plane::repo::{ClaimStatus, FailureRow, FailuresCall, JournaledFailures, EVERY_SCOPE};
use idempotency_plane::{ClientError, PostgrestRepository};

use super::routes::Routes;
use crate::redrive;

/// How many rows a panel asks for at most, below the row cap.
const PANEL_ROWS: u32 = 100;

/// The longest version the console passes on: the plane's are far shorter.
const MAX_VERSION_CHARS: usize = 200;

/// What the handlers share.
#[derive(Debug)]
pub(crate) struct Console {
    /// The plane, with the service key.
    pub(crate) repo: PostgrestRepository,
    /// The re-drive routes the operator named.
    pub(crate) routes: Routes,
}

impl Console {
    /// The plane's row cap, which every read and action stays within.
    fn cap(&self) -> u32 {
        self.repo.client().config().max_rows()
    }

    /// How many rows a panel asks for: [`PANEL_ROWS`], or the row cap when
    /// lower.
    fn panel_rows(&self) -> u32 {
        PANEL_ROWS.min(self.cap())
    }
}

/// What an API call failed with: answered as `{"error": …}`.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ApiError {
    /// The request was malformed; nothing was done.
    #[error("{0}")]
    BadRequest(String),
    /// No re-drive route was named for the scope.
    #[error(
        "no re-drive route for scope {0}: start the console with --route {0}=URL (or a family's, e.g. webhook.*=URL)"
    )]
    NoRoute(String),
    /// The plane refused or failed the call.
    #[error("the plane: {0}")]
    Plane(#[from] ClientError),
    /// The plane refused or failed the call (as the library reports it).
    #[error("the plane: {0}")]
    Library(#[from] idempotency_plane::Error),
    /// The re-drive route refused or failed.
    #[error("the re-drive route: {0}")]
    Route(ClientError),
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = match &self {
            // Input the library refused before any request.
            ApiError::BadRequest(_) | ApiError::Library(idempotency_plane::Error::Invalid(_)) => {
                StatusCode::BAD_REQUEST
            }
            ApiError::NoRoute(_) => StatusCode::NOT_FOUND,
            ApiError::Plane(_) | ApiError::Library(_) | ApiError::Route(_) => StatusCode::BAD_GATEWAY,
        };
        if status == StatusCode::BAD_GATEWAY {
            tracing::warn!(error = %self, "console: a call failed");
        }
        (status, Json(json!({ "error": self.to_string() }))).into_response()
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        ApiError::BadRequest(rejection.body_text())
    }
}

impl From<QueryRejection> for ApiError {
    fn from(rejection: QueryRejection) -> Self {
        ApiError::BadRequest(rejection.body_text())
    }
}

type Answer = Result<Json<serde_json::Value>, ApiError>;

/// The API's routes, under `/api/`.
pub(crate) fn router(console: Arc<Console>) -> Router {
    Router::new()
        .route("/api/about", get(about))
        .route("/api/in-flight", get(in_flight))
        .route("/api/processing", get(processing))
        .route("/api/orphans", get(orphans))
        .route("/api/failures", get(failures))
        .route("/api/failure-counts", get(failure_counts))
        .route("/api/sweep-backlog", get(sweep_backlog))
        .route("/api/activity", get(activity))
        .route("/api/send-back", post(send_back))
        .route("/api/redrive", post(redrive_now))
        .route("/api/abandon", post(abandon))
        .with_state(console)
}

/// The plane's address (without secrets), its row cap, and the scopes with
/// a re-drive route.
async fn about(State(console): State<Arc<Console>>) -> Answer {
    let config = console.repo.client().config();
    Ok(Json(json!({
        "plane": config.redacted_url(),
        "row_cap": config.max_rows(),
        "panel_rows": console.panel_rows(),
        "routes": console.routes.scopes().collect::<Vec<_>>(),
    })))
}

/// `{"rows": …, "bound": …}`: a panel's rows and the bound they were read
/// with (a full panel may hide more).
fn rows(rows: impl Serialize, bound: u32) -> Answer {
    Ok(Json(json!({ "rows": rows, "bound": bound })))
}

async fn in_flight(State(console): State<Arc<Console>>) -> Answer {
    let bound = console.panel_rows();
    rows(console.repo.in_flight(bound).await?, bound)
}

#[derive(Debug, Deserialize)]
struct ScopeQuery {
    scope: String,
}

async fn processing(State(console): State<Arc<Console>>, query: Result<Query<ScopeQuery>, QueryRejection>) -> Answer {
    let Query(ScopeQuery { scope }) = query?;
    let bound = console.panel_rows();
    rows(console.repo.processing(&scope, bound).await?, bound)
}

/// A scope's orphans, and whether the console can ask its re-drive route.
#[derive(Debug, Serialize)]
struct OrphansRow {
    scope: String,
    orphans: u64,
    oldest: DateTime<Utc>,
    waited_ms: u64,
    route: bool,
}

async fn orphans(State(console): State<Arc<Console>>) -> Answer {
    let bound = console.panel_rows();
    let found = console.repo.orphans(bound).await?;
    let found: Vec<OrphansRow> = found
        .into_iter()
        .map(|row| OrphansRow {
            route: console.routes.for_scope(&row.scope).is_some(),
            scope: row.scope,
            orphans: row.orphans,
            oldest: row.oldest,
            waited_ms: row.waited_ms,
        })
        .collect();
    rows(found, bound)
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

async fn failures(State(console): State<Arc<Console>>) -> Answer {
    let bound = console.panel_rows();
    let call = FailuresCall {
        scope: EVERY_SCOPE,
        bound: u64::from(bound),
        organization_id: None,
        since: None,
        claim_ids: None,
    };
    let found = console.repo.failures(&call).await?;
    rows(found.into_iter().map(FailureView::from).collect::<Vec<_>>(), bound)
}

async fn failure_counts(State(console): State<Arc<Console>>) -> Answer {
    let bound = console.panel_rows();
    rows(console.repo.failure_counts(bound).await?, bound)
}

async fn sweep_backlog(State(console): State<Arc<Console>>) -> Answer {
    let bound = console.panel_rows();
    rows(console.repo.sweep_backlog(bound).await?, bound)
}

/// The plots' time windows, each with its bucket.
#[derive(Debug, Clone, Copy, Deserialize)]
enum Window {
    #[serde(rename = "1h")]
    Hour,
    #[serde(rename = "24h")]
    Day,
    #[serde(rename = "7d")]
    Week,
}

impl Window {
    /// How far back, and how wide a bucket, in seconds.
    fn spans(self) -> (u32, u32) {
        match self {
            Window::Hour => (3_600, 60),
            Window::Day => (86_400, 900),
            Window::Week => (604_800, 7_200),
        }
    }
}

#[derive(Debug, Deserialize)]
struct ActivityQuery {
    window: Window,
}

async fn activity(State(console): State<Arc<Console>>, query: Result<Query<ActivityQuery>, QueryRejection>) -> Answer {
    let Query(ActivityQuery { window }) = query?;
    let (span_s, bucket_s) = window.spans();
    let since = Utc::now() - chrono::Duration::seconds(i64::from(span_s));
    // The plane starts at the minute of `since`, so the window spans one
    // bucket more than it holds; one more again for a plane whose clock is
    // a little ahead of this machine's.
    let bound = (span_s / bucket_s + 2).min(console.cap());
    let buckets = console.repo.activity(since, bucket_s, bound).await?;
    Ok(Json(json!({ "rows": buckets, "bound": bound, "since": since, "bucket_s": bucket_s })))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SendBack {
    claim_ids: Vec<Uuid>,
}

/// Sends the failures the page showed back to re-drive, by claim id
/// (`idempotency_redrive_failed`), and says why each one not sent back was
/// not.
async fn send_back(State(console): State<Arc<Console>>, body: Result<Json<SendBack>, JsonRejection>) -> Answer {
    let Json(SendBack { mut claim_ids }) = body?;
    claim_ids.sort_unstable();
    claim_ids.dedup();
    let cap = u64::from(console.cap());
    let bound = claim_ids.len() as u64;
    if bound == 0 || bound > cap {
        return Err(ApiError::BadRequest(format!("name between 1 and {cap} claim ids (the row cap), not {bound}")));
    }
    let call =
        FailuresCall { scope: EVERY_SCOPE, bound, organization_id: None, since: None, claim_ids: Some(&claim_ids) };
    let sent = console.repo.redrive_failed(&call).await?;
    tracing::info!(sent_back = sent.len(), asked = claim_ids.len(), "console: failures sent back to re-drive");
    let skipped: Vec<Uuid> = claim_ids.iter().filter(|id| !sent.iter().any(|row| row.id == **id)).copied().collect();
    let why = console.repo.redrivable(&FailuresCall { claim_ids: Some(&skipped), ..call }).await?;
    let not_sent: Vec<serde_json::Value> = why
        .iter()
        .map(|row| json!({ "claim_id": row.claim_id, "reason": row.reason, "why": row.reason.explain() }))
        .collect();
    let mut message = format!("sent back {}", sent.len());
    if !not_sent.is_empty() {
        message.push_str(&format!("; not sent back {}: {}", not_sent.len(), describe_skipped(&why)));
    }
    Ok(Json(json!({
        "sent_back": sent.len(),
        "rows": sent.into_iter().map(FailureView::from).collect::<Vec<_>>(),
        "not_sent_back": not_sent,
        "message": message,
    })))
}

fn describe_skipped(rows: &[idempotency_plane::repo::RedrivableRow]) -> String {
    rows.iter().map(|row| format!("{} ({})", row.claim_id, row.reason.explain())).collect::<Vec<_>>().join("; ")
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RedriveNow {
    scope: String,
}

/// Asks the re-drive route of the scope for one pass, exactly as
/// `idem redrive --to URL --scope SCOPE` does, SCOPE being the scope or
/// family the route was named for (a route refuses any other).
async fn redrive_now(State(console): State<Arc<Console>>, body: Result<Json<RedriveNow>, JsonRejection>) -> Answer {
    let Json(RedriveNow { scope }) = body?;
    let (named, route) = console.routes.for_scope(&scope).ok_or_else(|| ApiError::NoRoute(scope.clone()))?;
    let limit = redrive::DEFAULT_BOUND.min(u64::from(console.cap()));
    let ask = redrive::Ask { limit, scope: Some(named) };
    let report = redrive::ask_route(console.repo.client(), route, &ask).await.map_err(ApiError::Route)?;
    tracing::info!(scope = named, redriven = report.redriven, "console: re-drive asked");
    let message = format!(
        "re-driven {} of {named} (bound {limit}): journaled {}, dead-lettered {}, left {}",
        report.redriven, report.journaled, report.dead_lettered, report.left
    );
    Ok(Json(json!({ "report": report, "bound": limit, "message": message })))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Abandon {
    id: Uuid,
    version: String,
}

/// Ends a stuck claim as a journaled failure (`abandoned_by_operator`),
/// only if it is unchanged since the page showed it: 409 otherwise, and
/// nothing written.
async fn abandon(State(console): State<Arc<Console>>, body: Result<Json<Abandon>, JsonRejection>) -> Response {
    let Json(Abandon { id, version }) = match body {
        Ok(body) => body,
        Err(rejection) => return ApiError::from(rejection).into_response(),
    };
    if version.is_empty() || version.chars().count() > MAX_VERSION_CHARS {
        return ApiError::BadRequest(format!("version: 1 to {MAX_VERSION_CHARS} characters, as the page showed it"))
            .into_response();
    }
    match console.repo.abandon(id, &version).await {
        Ok(Some(row)) => {
            tracing::info!(claim_id = %id, scope = row.scope, "console: a claim ended as a failure by the operator");
            let message = format!(
                "ended {}/{} as a failure ({})",
                row.scope,
                row.key,
                row.error.as_deref().unwrap_or(idempotency_plane::repo::console::ABANDONED_BY_OPERATOR)
            );
            Json(json!({ "abandoned": true, "failure": FailureView::from(row), "message": message })).into_response()
        }
        Ok(None) => (
            StatusCode::CONFLICT,
            Json(json!({
                "abandoned": false,
                "message": "changed since shown: refresh (the claim was taken over, extended or ended since; nothing was written)",
            })),
        )
            .into_response(),
        Err(error) => ApiError::from(error).into_response(),
    }
}
