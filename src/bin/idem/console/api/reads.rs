//! The panels' reads: each one of the plane's bounded functions, at most
//! a panel's rows (or the row cap when lower).

use std::sync::Arc;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::Json;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::json;

use idempotency_plane::repo::{FailuresCall, JournaledFailures, EVERY_SCOPE};

use super::{rows, Answer, Console, FailureView};

/// The plane's address (without secrets), the row cap the console holds
/// to (the lower of the configured one and the plane's own), and the
/// scopes with a re-drive route.
pub(super) async fn about(State(console): State<Arc<Console>>) -> Answer {
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

pub(super) async fn in_flight(State(console): State<Arc<Console>>) -> Answer {
    let plane = console.plane().await?;
    let bound = plane.panel_rows();
    match plane.repo.in_flight(bound).await {
        Ok(found) => rows(found, bound),
        Err(error) => Err(console.failed(error).await),
    }
}

#[derive(Debug, Deserialize)]
pub(super) struct ScopeQuery {
    scope: String,
}

pub(super) async fn processing(
    State(console): State<Arc<Console>>,
    query: Result<Query<ScopeQuery>, QueryRejection>,
) -> Answer {
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

pub(super) async fn orphans(State(console): State<Arc<Console>>) -> Answer {
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

pub(super) async fn failures(State(console): State<Arc<Console>>) -> Answer {
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

pub(super) async fn failure_counts(State(console): State<Arc<Console>>) -> Answer {
    let plane = console.plane().await?;
    let bound = plane.panel_rows();
    match plane.repo.failure_counts(bound).await {
        Ok(found) => rows(found, bound),
        Err(error) => Err(console.failed(error).await),
    }
}

pub(super) async fn sweep_backlog(State(console): State<Arc<Console>>) -> Answer {
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
pub(super) struct ActivityQuery {
    window: Window,
}

pub(super) async fn activity(
    State(console): State<Arc<Console>>,
    query: Result<Query<ActivityQuery>, QueryRejection>,
) -> Answer {
    let Query(ActivityQuery { window }) = query?;
    let plane = console.plane().await?;
    let (span_s, bucket_s, bound) = activity_plan(window.span_s(), plane.panel_rows());
    let since = Utc::now() - chrono::Duration::seconds(i64::from(span_s));
    match plane.repo.activity(since, bucket_s, bound).await {
        Ok(buckets) => Ok(Json(json!({ "rows": buckets, "bound": bound, "since": since, "bucket_s": bucket_s }))),
        Err(error) => Err(console.failed(error).await),
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
}
