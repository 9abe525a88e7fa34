//! Rows the scenarios set up in the claims table directly, as only a
//! benchmark may: leases moved into the past, expired rows for the sweep,
//! filler rows for the growth figure.

use sqlx::{Executor, PgPool};
use uuid::Uuid;

use crate::BoxError;

/// Moves the leases of the claims `ids` one second into the past, so the
/// next claim of each takes it over.
pub(super) async fn expire_leases(db: &PgPool, ids: &[Uuid]) -> Result<(), BoxError> {
    db.execute(
        sqlx::query(
            "update agent.idempotency_keys set lease_expires_at = now() - interval '1 second' where id = any($1)",
        )
        .bind(ids),
    )
    .await?;
    Ok(())
}

/// Inserts `rows` completed claims whose retention passed a day ago, then
/// refreshes the planner's statistics.
pub(super) async fn insert_expired(db: &PgPool, rows: i64) -> Result<(), BoxError> {
    db.execute(
        sqlx::query(
            "insert into agent.idempotency_keys
                   (organization_id, scope, key, request_hash, status, lease_token, response,
                    claimed_at, lease_expires_at, retain_until)
                 select gen_random_uuid(), 'tool.bench', 'expired-' || i, repeat('a', 64), 'completed',
                        gen_random_uuid(), '1', now() - interval '31 days', now() - interval '31 days',
                        now() - interval '1 day'
                   from generate_series(1, $1) i",
        )
        .bind(rows),
    )
    .await?;
    db.execute("analyze agent.idempotency_keys").await?;
    Ok(())
}

/// Brings the table to `rows` rows (completed claims of other tenants, still
/// retained), then refreshes the planner's statistics.
pub(super) async fn fill_table(db: &PgPool, rows: i64) -> Result<(), BoxError> {
    let present: i64 = sqlx::query_scalar("select count(*) from agent.idempotency_keys").fetch_one(db).await?;
    let missing = rows - present;
    if missing > 0 {
        db.execute(
            sqlx::query(
                "insert into agent.idempotency_keys
                   (organization_id, scope, key, request_hash, status, lease_token, response,
                    claimed_at, lease_expires_at, retain_until)
                 select gen_random_uuid(), 'tool.filler', 'filler-' || i, repeat('b', 64), 'completed',
                        gen_random_uuid(), '{\"ok\":true}', now(), now() + interval '1 minute', now() + interval '30 days'
                   from generate_series(1, $1) i",
            )
            .bind(missing),
        )
        .await?;
    }
    db.execute("analyze agent.idempotency_keys").await?;
    Ok(())
}
