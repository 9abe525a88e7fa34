//! The claim table's shape: what its rows and indexes take on disk, how
//! completions update it (HOT or not), and what a completion costs on the
//! partitioned layout when it names the organization and when it does not.

use std::time::{Duration, Instant};

use serde::Serialize;
use sqlx::{Executor, PgPool};
use uuid::Uuid;

use super::figure::Figure;
use crate::BoxError;

/// Disk per million claims of one layout, in MiB.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Size {
    pub(super) layout: String,
    pub(super) rows: i64,
    pub(super) table_mib: f64,
    pub(super) primary_key_mib: f64,
    pub(super) unique_key_mib: f64,
    pub(super) retain_until_index_mib: f64,
}

/// How many completions of one table shape were HOT updates.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Hot {
    pub(super) fillfactor: u32,
    pub(super) completion_moves_retain_until: bool,
    pub(super) updates: i64,
    pub(super) hot_updates: i64,
}

/// Bytes of `relation` and, on a partitioned table or index, of all its
/// partitions (`pg_partition_tree` lists none for a plain one).
async fn bytes(db: &PgPool, relation: &str, table: bool) -> Result<i64, BoxError> {
    let sql = if table {
        "select coalesce(sum(pg_table_size(r)), 0)::int8
           from (select relid as r from pg_partition_tree($1::regclass) union select $1::regclass) t"
    } else {
        "select coalesce(sum(pg_relation_size(r)), 0)::int8
           from (select relid as r from pg_partition_tree($1::regclass) union select $1::regclass) t"
    };
    Ok(sqlx::query_scalar(sql).bind(relation).fetch_one(db).await?)
}

/// The claim table's size per million rows, table and each index.
pub(super) async fn size_per_million(db: &PgPool, layout: &str) -> Result<Size, BoxError> {
    db.execute("vacuum analyze agent.idempotency_keys").await?;
    let rows: i64 = sqlx::query_scalar("select count(*) from agent.idempotency_keys").fetch_one(db).await?;
    let per_million = |bytes: i64| bytes as f64 / rows.max(1) as f64 * 1_000_000.0 / (1024.0 * 1024.0);
    Ok(Size {
        layout: layout.to_owned(),
        rows,
        table_mib: per_million(bytes(db, "agent.idempotency_keys", true).await?),
        primary_key_mib: per_million(bytes(db, "agent.idempotency_keys_pkey", false).await?),
        unique_key_mib: per_million(bytes(db, "agent.idempotency_keys_org_scope_key_key", false).await?),
        retain_until_index_mib: per_million(bytes(db, "agent.idempotency_keys_retain_until_idx", false).await?),
    })
}

/// Rows each HOT experiment completes.
const HOT_ROWS: i64 = 20_000;

/// Completions of processing claims on copies of the claim table (every
/// column, constraint and index), with fillfactor 100, 80 (the table's) and
/// 50, by a completion that leaves `retain_until` alone (the plane's within
/// the lease: the retention already counts from the lease's end) and by one
/// that moves it (the plane's after the lease passed, which keeps the answer
/// a full retention after it is written): how many were HOT updates, which
/// write no index entry. All in
/// one transaction, so no page is pruned meanwhile: a HOT update needs room
/// the fillfactor left, which is a floor of what a live table sees.
pub(super) async fn hot_updates(db: &PgPool) -> Result<Vec<Hot>, BoxError> {
    let mut results = Vec::new();
    for fillfactor in [100u32, 80, 50] {
        for moves in [true, false] {
            let mut tx = db.begin().await?;
            let create = match fillfactor {
                100 => {
                    "create temp table hot_claims (like agent.idempotency_keys including all)
                       with (fillfactor = 100) on commit drop"
                }
                80 => {
                    "create temp table hot_claims (like agent.idempotency_keys including all)
                       with (fillfactor = 80) on commit drop"
                }
                _ => {
                    "create temp table hot_claims (like agent.idempotency_keys including all)
                       with (fillfactor = 50) on commit drop"
                }
            };
            tx.execute(create).await?;
            tx.execute(
                sqlx::query(
                    "insert into hot_claims (organization_id, scope, key, request_hash, lease_token,
                                             lease_expires_at, retain_until)
                     select gen_random_uuid(), 'tool.bench', 'hot-' || i, repeat('c', 64), gen_random_uuid(),
                            now() + interval '1 minute', now() + interval '30 days'
                       from generate_series(1, $1) i",
                )
                .bind(HOT_ROWS),
            )
            .await?;
            tx.execute(
                sqlx::query(
                    "update hot_claims
                        set status = 'completed',
                            response = jsonb_build_object('message_id', key, 'sent', true),
                            retain_until = case when $1 then retain_until + interval '1 second' else retain_until end",
                )
                .bind(moves),
            )
            .await?;
            let (updates, hot_updates): (i64, i64) = sqlx::query_as(
                "select n_tup_upd, n_tup_hot_upd from pg_stat_xact_user_tables where relid = 'hot_claims'::regclass",
            )
            .fetch_one(&mut *tx)
            .await?;
            tx.rollback().await?;
            results.push(Hot { fillfactor, completion_moves_retain_until: moves, updates, hot_updates });
        }
    }
    Ok(results)
}

/// Claim → complete pairs over a direct connection, `operations` of them in
/// turn, completing with the organization named and without it; answers
/// the two completions' latencies.
pub(super) async fn completion_addressing(db: &PgPool, operations: usize) -> Result<(Figure, Figure), BoxError> {
    let org = Uuid::new_v4();
    let hash = "d".repeat(64);
    let (mut named, mut unnamed) = (Vec::new(), Vec::new());
    let started = Instant::now();
    for i in 0..operations {
        for (with_org, latencies) in [(true, &mut named), (false, &mut unnamed)] {
            let token = Uuid::new_v4();
            let id: Uuid =
                sqlx::query_scalar("select id from agent.idempotency_claim($1, 'tool.bench', $2, $3, $4, 60000)")
                    .bind(org)
                    .bind(format!("addressing-{with_org}-{i}"))
                    .bind(&hash)
                    .bind(token)
                    .fetch_one(db)
                    .await?;
            let t = Instant::now();
            let completed: i64 = sqlx::query_scalar(
                "select count(*) from agent.idempotency_complete(
                     p_claim_id => $1, p_lease_token => $2, p_response => '{\"ok\":true}',
                     p_organization_id => case when $4 then $3 end)",
            )
            .bind(id)
            .bind(token)
            .bind(org)
            .bind(with_org)
            .fetch_one(db)
            .await?;
            latencies.push(t.elapsed());
            if completed != 1 {
                return Err(format!("the completion of claim {id} answered {completed} rows").into());
            }
        }
    }
    let elapsed: Duration = started.elapsed() / 2;
    Ok((
        Figure::from("complete, organization named", named, elapsed),
        Figure::from("complete, by id alone", unnamed, elapsed),
    ))
}
