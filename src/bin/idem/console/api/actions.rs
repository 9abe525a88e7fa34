//! The console's three actions, each confirmed on the page first: send
//! failures back, ask a scope's re-drive route, end a stuck claim as a
//! failure by compare and set.

use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::json;
use uuid::Uuid;

use idempotency_plane::repo::{FailuresCall, JournaledFailures, EVERY_SCOPE};

use super::{Answer, ApiError, Console, FailureView};
use crate::redrive;

/// The longest version the console passes on: the plane's are far shorter.
const MAX_VERSION_CHARS: usize = 200;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SendBack {
    claim_ids: Vec<Uuid>,
}

/// Sends the failures the page showed back to re-drive, by claim id
/// (`idempotency_redrive_failed`), and says why each one not sent back was
/// not.
pub(super) async fn send_back(
    State(console): State<Arc<Console>>,
    body: Result<Json<SendBack>, JsonRejection>,
) -> Answer {
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
pub(super) struct RedriveNow {
    scope: String,
}

/// Asks the re-drive route of the scope for one pass, exactly as
/// `idem redrive --to URL --scope SCOPE` does, SCOPE being the scope or
/// family the route was named for (a route refuses any other).
pub(super) async fn redrive_now(
    State(console): State<Arc<Console>>,
    body: Result<Json<RedriveNow>, JsonRejection>,
) -> Answer {
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
pub(super) struct Abandon {
    id: Uuid,
    version: String,
}

/// Ends a stuck claim as a journaled failure (`abandoned_by_operator`),
/// only if it is unchanged since the page showed it: 409 otherwise, and
/// nothing written.
pub(super) async fn abandon(
    State(console): State<Arc<Console>>,
    body: Result<Json<Abandon>, JsonRejection>,
) -> Response {
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
