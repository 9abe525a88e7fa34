//! Claim → complete pairs over direct connections: the SQL functions against
//! the floor, and the functions as SECURITY DEFINER against INVOKER.

use std::time::Duration;

use idempotency_plane::RequestHash;
use serde_json::json;
use sqlx::{PgPool, Row};
use uuid::Uuid;

use super::drive::{alternating, drive, own_pool, SEGMENTS};
use super::floor::pairs_floor;
use super::report::Figure;
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
    async fn security(db: &PgPool, mode: &str) -> Result<(), sqlx::Error> {
        let statement = format!(
            "alter function agent.idempotency_claim(uuid, text, text, text, uuid, bigint) security {mode};
             alter function agent.idempotency_complete(uuid, uuid, text, text, jsonb) security {mode};"
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement)).execute(db).await.map(|_| ())
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

async fn pairs_direct_sql(
    pool: &PgPool,
    workers: usize,
    duration: Duration,
    round: u32,
) -> Result<(Vec<Duration>, Duration), BoxError> {
    let pool = pool.clone();
    let org = Uuid::new_v4();
    let hash = RequestHash::of_json(&json!({"bench": true})).as_str().to_owned();
    drive(workers, duration, move |worker, i| {
        let (pool, hash) = (pool.clone(), hash.clone());
        async move {
            let token = Uuid::new_v4();
            let row = sqlx::query("select * from agent.idempotency_claim($1, 'tool.bench', $2, $3, $4, 60000)")
                .bind(org)
                .bind(format!("sql-{round}-{worker}-{i}"))
                .bind(&hash)
                .bind(token)
                .fetch_one(&pool)
                .await?;
            let id: Uuid = row.try_get("id")?;
            sqlx::query("select * from agent.idempotency_complete($1, $2, null, null, '{\"ok\":true}'::jsonb)")
                .bind(id)
                .bind(token)
                .fetch_one(&pool)
                .await?;
            Ok(())
        }
    })
    .await
}
