//! The database a stack serves: a throwaway one, named so that a later
//! start can tell it is left over ([`throwaway_name`]), or a named one kept
//! across starts; and the clean-up of the throwaway databases that killed
//! runs left behind.

use sqlx::{AssertSqlSafe, Executor, PgConnection};
use url::Url;

use super::cluster::{drop_database, quote_ident, quote_literal, redacted, sqlstate};
use super::database_name::DB_PREFIX;
use super::error::LocalError;
use super::template::{create_from_template, MigrationSet};

/// A database of this prefix that no session is connected to is left over
/// from a run that was killed, unless its name says it was created less than
/// this long ago: a stack connects its keeper right after creating its
/// database, and one in that window is not yet in use.
const SETTING_UP_FOR: chrono::TimeDelta = chrono::TimeDelta::minutes(10);

/// The advisory lock (in the maintenance database) that a start holds
/// shared from creating its database until its keeper is connected, and
/// that a clean-up takes exclusively.
pub(super) const SETUP_LOCK: &str = "idempotency-plane local stack set-up";

/// A named database's comment: this, then the template it was copied from
/// (which names its migration set's digest).
const NAMED_COMMENT: &str = "idempotency-plane local database, kept across starts; migrations ";

/// SQLSTATE duplicate_database: created meanwhile by another start.
const DUPLICATE_DATABASE: &str = "42P04";

/// A fresh name for a throwaway database: [`DB_PREFIX`], when (UTC, to the
/// second; [`drop_unused_databases`] reads it), the process, a random part.
pub(super) fn throwaway_name() -> String {
    format!(
        "{DB_PREFIX}{}_{}_{:08x}",
        chrono::Utc::now().format("%Y%m%d%H%M%S"),
        std::process::id(),
        rand::random::<u32>()
    )
}

/// Makes the named database `name` ready to serve, under the shared set-up
/// lock: reused when it records the template of `set` (its comment, see
/// [`NAMED_COMMENT`]); created when absent; dropped and created again when
/// `reset`. Refuses one that records another template
/// ([`LocalError::DatabaseOutdated`]), and one without our comment
/// ([`LocalError::DatabaseNotOurs`]), reset or not.
///
/// It is created whole under a throwaway name (so a start killed half-way
/// leaves a database the stale clean-up drops), given its comment, then
/// renamed: no start ever sees it under its name without its comment.
pub(super) async fn open_named_database(
    admin: &mut PgConnection,
    admin_url: &Url,
    set: &MigrationSet,
    name: &str,
    reset: bool,
) -> Result<(), LocalError> {
    let database_error = |source| LocalError::Database { url: redacted(admin_url), source };
    let expected = format!("{NAMED_COMMENT}{}", set.template);
    let mut reset_pending = reset;
    // A concurrent start of the same name can create or reset it between
    // the look-up and the rename: look again, a few times.
    for _ in 0..4 {
        let comment: Option<Option<String>> = sqlx::query_scalar(
            "select pg_catalog.shobj_description(oid, 'pg_database') from pg_catalog.pg_database where datname = $1",
        )
        .bind(name)
        .fetch_optional(&mut *admin)
        .await
        .map_err(database_error)?;
        match comment {
            Some(comment) => {
                let Some(found) = comment.as_deref().and_then(|c| c.strip_prefix(NAMED_COMMENT)) else {
                    return Err(LocalError::DatabaseNotOurs { name: name.to_owned() });
                };
                if reset_pending {
                    drop_database(admin, name).await.map_err(database_error)?;
                    tracing::info!(database = %name, "named local database reset");
                    reset_pending = false;
                    continue;
                }
                if comment.as_deref() == Some(expected.as_str()) {
                    return Ok(());
                }
                return Err(LocalError::DatabaseOutdated {
                    name: name.to_owned(),
                    found: found.to_owned(),
                    expected: set.template.clone(),
                });
            }
            None => {
                let building = throwaway_name();
                create_from_template(admin, admin_url, set, &building).await?;
                let named = async {
                    let comment =
                        format!("comment on database {} is {}", quote_ident(&building), quote_literal(&expected));
                    admin.execute(AssertSqlSafe(comment)).await?;
                    let rename = format!("alter database {} rename to {}", quote_ident(&building), quote_ident(name));
                    admin.execute(AssertSqlSafe(rename)).await
                }
                .await;
                match named {
                    Ok(_) => {
                        tracing::info!(database = %name, "named local database created");
                        return Ok(());
                    }
                    Err(source) => {
                        let _ = drop_database(admin, &building).await;
                        if sqlstate(&source).as_deref() != Some(DUPLICATE_DATABASE) {
                            return Err(database_error(source));
                        }
                    }
                }
            }
        }
    }
    Err(LocalError::Contended { name: name.to_owned() })
}

/// Drops databases this module created in runs that were killed before they
/// could clean up: those no session is connected to. A live stack holds a
/// keeper session on its database for as long as it runs, however idle, so
/// its database is never one of them. A stack still setting up holds
/// [`SETUP_LOCK`] shared, and then no clean-up runs; one that set up from
/// another maintenance database is spared by its name's time
/// ([`SETTING_UP_FOR`]). The drop is not forced: should a session connect
/// after the check, PostgreSQL refuses it. Best effort: a failure here never
/// stops a start.
pub(super) async fn drop_stale_databases(admin: &mut PgConnection) {
    let locked = sqlx::query_scalar::<_, bool>("select pg_try_advisory_lock(hashtext($1))")
        .bind(SETUP_LOCK)
        .fetch_one(&mut *admin)
        .await;
    if !matches!(locked, Ok(true)) {
        return;
    }
    drop_unused_databases(admin).await;
    let _ = sqlx::query("select pg_advisory_unlock(hashtext($1))").bind(SETUP_LOCK).execute(&mut *admin).await;
}

async fn drop_unused_databases(admin: &mut PgConnection) {
    let names: Vec<(String,)> = match sqlx::query_as(
        "select d.datname::text from pg_catalog.pg_database d
          where starts_with(d.datname, $1)
            and not exists (select 1 from pg_catalog.pg_stat_activity a where a.datid = d.oid)",
    )
    .bind(DB_PREFIX)
    .fetch_all(&mut *admin)
    .await
    {
        Ok(names) => names,
        Err(_) => return,
    };
    let now = chrono::Utc::now().naive_utc();
    for (name,) in names {
        let stamp = name.trim_start_matches(DB_PREFIX).get(..14).unwrap_or("");
        let Ok(created) = chrono::NaiveDateTime::parse_from_str(stamp, "%Y%m%d%H%M%S") else {
            continue;
        };
        let safe = name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if safe && now - created >= SETTING_UP_FOR {
            // `name` is one of ours, read back from pg_database.
            let _ = admin.execute(AssertSqlSafe(format!("drop database if exists \"{name}\""))).await;
        }
    }
}

/// A name of ours that says the database was created in 2000.
#[cfg(test)]
pub(super) fn aged_name() -> String {
    format!("{DB_PREFIX}20000101000000_{}_{:08x}", std::process::id(), rand::random::<u32>())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use sqlx::Connection;

    use super::*;
    use crate::local::cluster::{admin, database_exists};

    #[tokio::test]
    async fn a_database_with_a_session_is_never_dropped_however_old_its_name_and_is_once_it_has_none() {
        // Arrange: a database aged by its name, with a session on it.
        // The set-up lock, as a start holds it, keeps other starts' clean-ups
        // away until the session is on.
        let (mut setting_up, _) = admin().await;
        let (mut admin, url) = admin().await;
        sqlx::query("select pg_advisory_lock_shared(hashtext($1))")
            .bind(SETUP_LOCK)
            .execute(&mut setting_up)
            .await
            .expect("the set-up lock");
        let name = aged_name();
        admin.execute(AssertSqlSafe(format!("create database \"{name}\""))).await.expect("create the database");
        let mut session_url = url.clone();
        session_url.set_path(&format!("/{name}"));
        let session = PgConnection::connect(session_url.as_str()).await.expect("a session on it");
        let _ = setting_up.close().await;

        // Act: the judgement every start's clean-up makes, under the set-up
        // lock held exclusively as a clean-up holds it (a concurrent test's
        // stack may be between creating its database and connecting to it).
        clean_up_as_a_start_does(&mut admin).await;
        let kept = database_exists(&mut admin, &name).await.expect("look it up");

        // Once its last session has gone, it is dropped.
        let _ = session.close().await;
        let mut gone = false;
        for _ in 0..300 {
            clean_up_as_a_start_does(&mut admin).await;
            gone = !database_exists(&mut admin, &name).await.expect("look it up");
            if gone {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if !gone {
            let _ = drop_database(&mut admin, &name).await;
        }
        assert!(kept, "a database in use was dropped");
        assert!(gone, "a database nobody uses was kept");
    }

    /// `drop_unused_databases` under the exclusive set-up lock, waiting for
    /// it (a start's clean-up only tries it, and skips when it is taken).
    async fn clean_up_as_a_start_does(admin: &mut PgConnection) {
        sqlx::query("select pg_advisory_lock(hashtext($1))")
            .bind(SETUP_LOCK)
            .execute(&mut *admin)
            .await
            .expect("the set-up lock, exclusively");
        drop_unused_databases(admin).await;
        sqlx::query("select pg_advisory_unlock(hashtext($1))")
            .bind(SETUP_LOCK)
            .execute(&mut *admin)
            .await
            .expect("unlock");
    }
}
