//! Supabase Queues on the local stack: the pgmq extension's own SQL,
//! installed from the `pgmq` crate (which embeds the extension's scripts,
//! so no extension files are needed on the server), then the `pgmq_public`
//! wrappers Supabase creates when queues are exposed through its Data API
//! (`sql/queues/pgmq_public.sql`), then the queues asked for, each with the
//! privileges the plane's own queue functions need on it
//! (`agent.idempotency_queue_privileges`), as a queue and as a dead-letter
//! queue.

use sqlx::{AssertSqlSafe, PgPool};
use url::Url;

use super::cluster::redacted;
use super::error::LocalError;

/// The schema the queue wrappers are served from, as on Supabase.
pub const QUEUES_SCHEMA: &str = "pgmq_public";

/// Supabase's `pgmq_public` wrappers, for a database that is not Supabase.
const PGMQ_PUBLIC: &str = include_str!("../../sql/queues/pgmq_public.sql");

/// Installs (or upgrades) pgmq and the wrappers in the database at
/// `db_url`, and creates each of `queues` that does not exist yet. Safe to
/// run again on the same database.
pub(super) async fn install(db: &PgPool, db_url: &Url, queues: &[String]) -> Result<(), LocalError> {
    let failed = |what: &str, error: &dyn std::fmt::Display| {
        LocalError::Queues(format!("{what} in {}: {error}", redacted(db_url)))
    };
    let pgmq_pool =
        sqlx08::PgPool::connect(db_url.as_str()).await.map_err(|error| failed("connecting to install pgmq", &error))?;
    let installed = pgmq::install::install_sql_from_embedded(&pgmq_pool).await;
    pgmq_pool.close().await;
    installed.map_err(|error| failed("installing pgmq's SQL", &error))?;
    sqlx::raw_sql(AssertSqlSafe(PGMQ_PUBLIC))
        .execute(db)
        .await
        .map_err(|source| LocalError::Migration { file: "queues/pgmq_public.sql", source })?;
    for queue in queues {
        check_queue_name(queue)?;
        let exists: bool =
            sqlx::query_scalar("select exists (select 1 from pgmq.list_queues() q where q.queue_name = $1)")
                .bind(queue)
                .fetch_one(db)
                .await
                .map_err(|error| failed("listing queues", &error))?;
        if !exists {
            sqlx::query("select pgmq.create($1)")
                .bind(queue)
                .execute(db)
                .await
                .map_err(|error| failed(&format!("creating queue {queue}"), &error))?;
        }
        // Any local queue may be read, or take another's dead letters: the
        // grants of both, as an operator runs them for each pair.
        let grants: Vec<String> = sqlx::query_scalar("select g from agent.idempotency_queue_privileges($1, $1) g")
            .bind(queue)
            .fetch_all(db)
            .await
            .map_err(|error| failed(&format!("listing the privileges of queue {queue}"), &error))?;
        for grant in grants {
            sqlx::raw_sql(AssertSqlSafe(grant.as_str()))
                .execute(db)
                .await
                .map_err(|error| failed(&format!("granting the plane queue {queue}: {grant}"), &error))?;
        }
    }
    Ok(())
}

/// A queue name pgmq takes: 1 to 47 characters of a-z, 0-9 and `_`
/// (its tables are named after it, `q_<name>` and `a_<name>`).
pub fn check_queue_name(name: &str) -> Result<(), LocalError> {
    let fits = (1..=47).contains(&name.len()) && name.bytes().all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_'));
    if fits {
        return Ok(());
    }
    Err(LocalError::Config(format!("{name:?} is not a queue name: 1 to 47 characters of a-z, 0-9 and _")))
}
