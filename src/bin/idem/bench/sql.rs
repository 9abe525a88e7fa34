//! Claim → complete pairs over direct connections: the SQL functions against
//! the floor, and the functions as SECURITY DEFINER against INVOKER.

use std::time::Duration;

use idempotency_plane::repo::SqlFunction;
use idempotency_plane::RequestHash;
use serde_json::{json, Value};
use sqlx::{PgPool, Row};
use uuid::Uuid;

use super::drive::{alternating, drive, own_pool, Run, SEGMENTS};
use super::figure::Figure;
use super::floor::{FLOOR_CLAIM, FLOOR_COMPLETE};
use crate::BoxError;

/// The SQL functions over direct connections and the floor, measured in
/// alternating segments of one pool each: figures for both.
pub(super) async fn functions_against_floor(
    db: &PgPool,
    workers: usize,
    duration: Duration,
) -> Result<(Figure, Figure), BoxError> {
    let (functions_pool, floor_pool) = (own_pool(db).await?, own_pool(db).await?);
    let segment = duration / SEGMENTS;
    let (functions, floor) = alternating(|first, round| {
        let pool = if first { functions_pool.clone() } else { floor_pool.clone() };
        async move {
            if first {
                pairs_direct_sql(&pool, workers, segment, round).await
            } else {
                pairs_floor(&pool, workers, segment, round).await
            }
        }
    })
    .await?;
    Ok((
        Figure::from("pairs via direct SQL", functions.0, functions.1),
        Figure::from("pairs via floor SQL", floor.0, floor.1),
    ))
}

/// The two hot-path functions as they are (SECURITY DEFINER, acting as the
/// plane's owner) against the same functions switched to SECURITY INVOKER,
/// in alternating segments: what the role switch on every call costs. The
/// functions are SECURITY DEFINER again afterwards, whatever happened.
pub(super) async fn definer_against_invoker(
    db: &PgPool,
    workers: usize,
    duration: Duration,
) -> Result<(Figure, Figure), BoxError> {
    // The signatures come from the SQL surface the crate calls, so a
    // migration that changes either function changes them here too.
    async fn security(db: &PgPool, mode: &str) -> Result<(), BoxError> {
        for name in ["idempotency_claim", "idempotency_complete"] {
            let function = SqlFunction::named(name).ok_or("a function of the SQL surface")?;
            let statement = format!("alter function {} security {mode}", function.signature());
            sqlx::raw_sql(sqlx::AssertSqlSafe(statement)).execute(db).await?;
        }
        Ok(())
    }
    let pool = own_pool(db).await?;
    let segment = duration / SEGMENTS;
    let measured = alternating(|definer, round| {
        let (db, pool) = (db.clone(), pool.clone());
        async move {
            security(&db, if definer { "definer" } else { "invoker" }).await?;
            pairs_direct_sql(&pool, workers, segment, round).await
        }
    })
    .await;
    security(db, "definer").await?;
    let (definer, invoker) = measured?;
    Ok((
        Figure::from("pairs via direct SQL, definer", definer.0, definer.1),
        Figure::from("pairs via direct SQL, invoker", invoker.0, invoker.1),
    ))
}

/// The plane's two hot-path functions, called as a client of direct SQL
/// calls them.
const DIRECT_CLAIM: &str = "select * from agent.idempotency_claim($1, 'tool.bench', $2, $3, $4, 60000)";
const DIRECT_COMPLETE: &str =
    "select * from agent.idempotency_complete($1, $2, null, null, '{\"ok\":true}'::jsonb, $3)";

/// Claim → complete through the SQL functions over direct connections.
async fn pairs_direct_sql(pool: &PgPool, workers: usize, duration: Duration, round: u32) -> Result<Run, BoxError> {
    statement_pairs(pool, workers, duration, format!("sql-{round}"), DIRECT_CLAIM, DIRECT_COMPLETE, None).await
}

/// Claim → complete with the floor's plain statements over direct
/// connections: what the plane's functions cost is measured against it.
async fn pairs_floor(pool: &PgPool, workers: usize, duration: Duration, round: u32) -> Result<Run, BoxError> {
    let response = Some(json!({"ok": true}));
    statement_pairs(pool, workers, duration, format!("floor-{round}"), FLOOR_CLAIM, FLOOR_COMPLETE, response).await
}

/// Claim → complete pairs on `workers` connections of `pool` for
/// `duration`, each on a fresh key under `prefix`: `claim` binds the tenant,
/// the key, the request hash and a fresh token and answers the claim's `id`;
/// `complete` binds that id, the token and the tenant, and `response` when
/// there is one.
async fn statement_pairs(
    pool: &PgPool,
    workers: usize,
    duration: Duration,
    prefix: String,
    claim: &'static str,
    complete: &'static str,
    response: Option<Value>,
) -> Result<Run, BoxError> {
    let pool = pool.clone();
    let org = Uuid::new_v4();
    let hash = RequestHash::of_json(&json!({"bench": true})).as_str().to_owned();
    drive(workers, duration, move |worker, i| {
        let (pool, hash, prefix, response) = (pool.clone(), hash.clone(), prefix.clone(), response.clone());
        async move {
            let token = Uuid::new_v4();
            let row = sqlx::query(claim)
                .bind(org)
                .bind(format!("{prefix}-{worker}-{i}"))
                .bind(&hash)
                .bind(token)
                .fetch_one(&pool)
                .await?;
            let id: Uuid = row.try_get("id")?;
            let completion = sqlx::query(complete).bind(id).bind(token).bind(org);
            match response {
                Some(response) => completion.bind(response).fetch_one(&pool).await?,
                None => completion.fetch_one(&pool).await?,
            };
            Ok(())
        }
    })
    .await
}
