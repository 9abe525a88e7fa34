//! The console's JSON API under `/api/`: the reads each panel shows, and the
//! three actions. Every read is one of the plane's own bounded functions;
//! every action answers what happened in a sentence (`message`) besides its
//! figures. The service key stays in this process: the page only ever
//! talks to this API.

use std::sync::Arc;
use std::time::{Duration, Instant};

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

use idempotency_plane::postgrest::codes;
use idempotency_plane::repo::{ClaimStatus, FailureRow, FailuresCall, JournaledFailures, EVERY_SCOPE};
use idempotency_plane::{ClientError, PostgrestClient, PostgrestRepository};

use super::routes::Routes;
use crate::redrive;

/// How many rows a panel asks for at most, below the row cap.
const PANEL_ROWS: u32 = 100;

/// The longest version the console passes on: the plane's are far shorter.
const MAX_VERSION_CHARS: usize = 200;

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
    /// The plane refused the call's input: an argument it does not take
    /// (22023, answered 400) or a scope it does not know (IDEM1, 404).
    /// Nothing was done. `message` is the plane's, which never holds a key.
    #[error("the plane refused it: {message}")]
    Refused { status: StatusCode, message: String },
    /// The plane could not be reached, or failed the call.
    #[error("the plane: {0}")]
    Plane(ClientError),
    /// The plane failed the call (as the library reports it).
    #[error("the plane: {0}")]
    Library(idempotency_plane::Error),
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
            ApiError::Refused { status, .. } => *status,
            ApiError::Plane(_) | ApiError::Library(_) | ApiError::Route(_) => StatusCode::BAD_GATEWAY,
        };
        if status == StatusCode::BAD_GATEWAY {
            tracing::warn!(error = %self, "console: a call failed");
        } else if matches!(self, ApiError::Refused { .. }) {
            tracing::info!(error = %self, status = status.as_u16(), "console: the plane refused a request");
        }
        (status, Json(json!({ "error": self.to_string() }))).into_response()
    }
}

impl From<ClientError> for ApiError {
    /// The plane's refusals of bad input are the request's fault (4xx);
    /// everything else, the transport's or the plane's (502).
    fn from(error: ClientError) -> Self {
        match refusal(&error) {
            Some((status, message)) => ApiError::Refused { status, message },
            None => ApiError::Plane(error),
        }
    }
}

impl From<idempotency_plane::Error> for ApiError {
    fn from(error: idempotency_plane::Error) -> Self {
        match error {
            idempotency_plane::Error::Store(store) => ApiError::from(store),
            idempotency_plane::Error::UnknownScope { .. } => {
                ApiError::Refused { status: StatusCode::NOT_FOUND, message: error.to_string() }
            }
            other => ApiError::Library(other),
        }
    }
}

/// The status and the plane's message (with its hint) when the plane
/// refused the input: 22023 (invalid parameter value) is 400, IDEM1
/// (unknown scope) 404.
fn refusal(error: &ClientError) -> Option<(StatusCode, String)> {
    let ClientError::Api { error: body, .. } = error else { return None };
    let status = match body.code.as_str() {
        codes::INVALID_PARAMETER_VALUE => StatusCode::BAD_REQUEST,
        codes::UNKNOWN_SCOPE => StatusCode::NOT_FOUND,
        _ => return None,
    };
    let message = match body.hint.as_deref().filter(|hint| !hint.is_empty()) {
        Some(hint) => format!("{} ({hint})", body.message),
        None => body.message.clone(),
    };
    Some((status, message))
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

/// The plane's address (without secrets), the row cap the console holds
/// to (the lower of the configured one and the plane's own), and the
/// scopes with a re-drive route.
async fn about(State(console): State<Arc<Console>>) -> Answer {
    let plane = console.plane().await?;
    let config = console.repo.client().config();
    Ok(Json(json!({
        "plane": config.redacted_url(),
        "row_cap": plane.cap,
        "configured_row_cap": config.max_rows(),
        "panel_rows": plane.panel_rows(),
        "routes": console.routes.scopes().collect::<Vec<_>>(),
    })))
}

/// `{"rows": …, "bound": …}`: a panel's rows and the bound they were read
/// with (a full panel may hide more).
fn rows(rows: impl Serialize, bound: u32) -> Answer {
    Ok(Json(json!({ "rows": rows, "bound": bound })))
}

async fn in_flight(State(console): State<Arc<Console>>) -> Answer {
    let plane = console.plane().await?;
    let bound = plane.panel_rows();
    match plane.repo.in_flight(bound).await {
        Ok(found) => rows(found, bound),
        Err(error) => Err(console.failed(error).await),
    }
}

#[derive(Debug, Deserialize)]
struct ScopeQuery {
    scope: String,
}

async fn processing(State(console): State<Arc<Console>>, query: Result<Query<ScopeQuery>, QueryRejection>) -> Answer {
    let Query(ScopeQuery { scope }) = query?;
    let plane = console.plane().await?;
    let bound = plane.panel_rows();
    match plane.repo.processing(&scope, bound).await {
        Ok(found) => rows(found, bound),
        Err(error) => Err(console.failed(error).await),
    }
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
    let plane = console.plane().await?;
    let bound = plane.panel_rows();
    let found = match plane.repo.orphans(bound).await {
        Ok(found) => found,
        Err(error) => return Err(console.failed(error).await),
    };
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
    let plane = console.plane().await?;
    let bound = plane.panel_rows();
    let call = FailuresCall {
        scope: EVERY_SCOPE,
        bound: u64::from(bound),
        organization_id: None,
        since: None,
        claim_ids: None,
    };
    match plane.repo.failures(&call).await {
        Ok(found) => rows(found.into_iter().map(FailureView::from).collect::<Vec<_>>(), bound),
        Err(error) => Err(console.failed(error).await),
    }
}

async fn failure_counts(State(console): State<Arc<Console>>) -> Answer {
    let plane = console.plane().await?;
    let bound = plane.panel_rows();
    match plane.repo.failure_counts(bound).await {
        Ok(found) => rows(found, bound),
        Err(error) => Err(console.failed(error).await),
    }
}

async fn sweep_backlog(State(console): State<Arc<Console>>) -> Answer {
    let plane = console.plane().await?;
    let bound = plane.panel_rows();
    match plane.repo.sweep_backlog(bound).await {
        Ok(found) => rows(found, bound),
        Err(error) => Err(console.failed(error).await),
    }
}

/// The plots' buckets, in seconds: whole minutes up to a day (what
/// `idempotency_activity` takes), finest first.
const BUCKETS_S: [u32; 7] = [60, 300, 900, 3_600, 7_200, 21_600, 86_400];

/// The plots' time windows.
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
    /// How far back, in seconds.
    fn span_s(self) -> u32 {
        match self {
            Window::Hour => 3_600,
            Window::Day => 86_400,
            Window::Week => 604_800,
        }
    }
}

/// How an activity read covers `span_s` seconds back from now within
/// `budget` buckets: how far back it starts, its bucket and its bound, in
/// the finest bucket whose count fits. The plane starts at the minute of
/// `since`, so the window spans one bucket more than it holds; one more
/// again for a plane whose clock is a little ahead of this machine's. When
/// not even days fit (a row cap below 9 for a week), the window is
/// shortened to the days that do.
fn activity_plan(span_s: u32, budget: u32) -> (u32, u32, u32) {
    for bucket_s in BUCKETS_S {
        let bound = span_s.div_ceil(bucket_s) + 2;
        if bound <= budget {
            return (span_s, bucket_s, bound);
        }
    }
    let widest = BUCKETS_S[BUCKETS_S.len() - 1];
    let budget = budget.max(1);
    // Ten minutes short of whole days: the start's minute and a clock a
    // little ahead still fit.
    (span_s.min(budget.saturating_mul(widest).saturating_sub(600)), widest, budget)
}

#[derive(Debug, Deserialize)]
struct ActivityQuery {
    window: Window,
}

async fn activity(State(console): State<Arc<Console>>, query: Result<Query<ActivityQuery>, QueryRejection>) -> Answer {
    let Query(ActivityQuery { window }) = query?;
    let plane = console.plane().await?;
    let (span_s, bucket_s, bound) = activity_plan(window.span_s(), plane.panel_rows());
    let since = Utc::now() - chrono::Duration::seconds(i64::from(span_s));
    match plane.repo.activity(since, bucket_s, bound).await {
        Ok(buckets) => Ok(Json(json!({ "rows": buckets, "bound": bound, "since": since, "bucket_s": bucket_s }))),
        Err(error) => Err(console.failed(error).await),
    }
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
    let plane = console.plane().await?;
    let cap = u64::from(plane.cap);
    let bound = claim_ids.len() as u64;
    if bound == 0 || bound > cap {
        return Err(ApiError::BadRequest(format!("name between 1 and {cap} claim ids (the row cap), not {bound}")));
    }
    let call =
        FailuresCall { scope: EVERY_SCOPE, bound, organization_id: None, since: None, claim_ids: Some(&claim_ids) };
    let sent = match plane.repo.redrive_failed(&call).await {
        Ok(sent) => sent,
        Err(error) => return Err(console.failed(error).await),
    };
    tracing::info!(sent_back = sent.len(), asked = claim_ids.len(), "console: failures sent back to re-drive");
    let skipped: Vec<Uuid> = claim_ids.iter().filter(|id| !sent.iter().any(|row| row.id == **id)).copied().collect();
    let why = match plane.repo.redrivable(&FailuresCall { claim_ids: Some(&skipped), ..call }).await {
        Ok(why) => why,
        Err(error) => return Err(console.failed(error).await),
    };
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
    let plane = console.plane().await?;
    let limit = redrive::DEFAULT_BOUND.min(u64::from(plane.cap));
    let ask = redrive::Ask { limit, scope: Some(named) };
    let report = redrive::ask_route(plane.repo.client(), route, &ask).await.map_err(ApiError::Route)?;
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
        Err(error) => console.failed(error).await.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activity_takes_the_finest_bucket_whose_count_fits_the_row_cap() {
        // At the panels' 100 rows: a minute for an hour, 15 minutes for a
        // day, 2 hours for a week.
        assert_eq!(activity_plan(Window::Hour.span_s(), 100), (3_600, 60, 62));
        assert_eq!(activity_plan(Window::Day.span_s(), 100), (86_400, 900, 98));
        assert_eq!(activity_plan(Window::Week.span_s(), 100), (604_800, 7_200, 86));
        // Below: coarser buckets, the whole window still shown.
        assert_eq!(activity_plan(Window::Hour.span_s(), 20), (3_600, 300, 14));
        assert_eq!(activity_plan(Window::Day.span_s(), 20), (86_400, 7_200, 14));
        assert_eq!(activity_plan(Window::Week.span_s(), 20), (604_800, 86_400, 9));
        // Not even days: the window shortened to what fits.
        assert_eq!(activity_plan(Window::Week.span_s(), 5), (5 * 86_400 - 600, 86_400, 5));
        assert_eq!(activity_plan(Window::Hour.span_s(), 1), (3_600, 86_400, 1));
        for cap in 1..=1_000 {
            for window in [Window::Hour, Window::Day, Window::Week] {
                let (span_s, bucket_s, bound) = activity_plan(window.span_s(), cap);
                assert!(bound <= cap && span_s <= window.span_s() && BUCKETS_S.contains(&bucket_s));
                // The start's minute and a minute of clock skew still fit.
                assert!((span_s + 120).div_ceil(bucket_s) <= bound, "cap {cap}: {span_s} s in {bucket_s} s, {bound}");
            }
        }
    }

    fn api_error(code: &str, hint: Option<&str>) -> ClientError {
        ClientError::Api {
            function: "idempotency_processing",
            status: 400,
            error: Box::new(idempotency_plane::postgrest::PostgrestError {
                code: code.to_owned(),
                message: format!("refused ({code})"),
                details: None,
                hint: hint.map(str::to_owned),
            }),
            retry_after: None,
        }
    }

    #[test]
    fn the_planes_refusals_of_bad_input_are_4xx_and_its_failures_502() {
        let status = |error: ApiError| error.into_response().status();
        let bad = ApiError::from(api_error(codes::INVALID_PARAMETER_VALUE, Some("start later")));
        assert_eq!(bad.to_string(), "the plane refused it: refused (22023) (start later)");
        assert_eq!(status(bad), StatusCode::BAD_REQUEST);
        assert_eq!(status(ApiError::from(api_error(codes::UNKNOWN_SCOPE, None))), StatusCode::NOT_FOUND);
        let unknown = idempotency_plane::Error::UnknownScope { scope: "webhook.nowhere".into() };
        assert_eq!(status(ApiError::from(unknown)), StatusCode::NOT_FOUND);
        let store = idempotency_plane::Error::Store(api_error(codes::INVALID_PARAMETER_VALUE, None));
        assert_eq!(status(ApiError::from(store)), StatusCode::BAD_REQUEST);
        for code in [codes::PGRST000, codes::LOCK_NOT_AVAILABLE, codes::INSUFFICIENT_PRIVILEGE, "XX000"] {
            assert_eq!(status(ApiError::from(api_error(code, None))), StatusCode::BAD_GATEWAY, "{code}");
        }
    }
}
