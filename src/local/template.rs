//! The template database of a migration set: built once per set (under the
//! cluster-wide migration lock, under a temporary name, closed to
//! connections), copied for every stack's database, and dropped once stale.

use std::sync::OnceLock;
use std::time::Duration;

use sha2::{Digest, Sha256};
use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection, PgPool};
use url::Url;

use super::cluster::{database_exists, drop_database, quote_ident, redacted, sqlstate};
use super::database_name::TEMPLATE_PREFIX;
use super::error::LocalError;
use crate::migrations::{Layout, MIGRATIONS};

/// A template carries this suffix while its migrations apply.
const BUILDING_SUFFIX: &str = "_building";

/// A finished template's comment: this, then when it was built (RFC 3339).
const TEMPLATE_COMMENT: &str = "idempotency-plane local template, built ";

/// Templates of other migration sets built longer ago than this are dropped
/// when a new template is built. A run still using one builds it again.
const STALE_TEMPLATE_AFTER: chrono::TimeDelta = chrono::TimeDelta::hours(24);

/// The cluster-wide advisory lock every migration run and template build
/// takes, in the maintenance database (advisory locks are per database).
const MIGRATION_LOCK: &str = "idempotency-plane local migrations";

/// Migrations whose effects are cluster-wide (roles), which a template does
/// not carry: applied again on every copy, as they were on every fresh
/// database before templates. They are written to race safely.
const CLUSTER_WIDE_MIGRATIONS: &[&str] = &["20261130000001_roles.sql"];

/// Tries of a `CREATE DATABASE ... TEMPLATE` or a template rename that
/// PostgreSQL refuses because the template is in use (each try already waits
/// up to 5 s for other sessions to leave).
const IN_USE_TRIES: u32 = 5;

/// SQLSTATE object_in_use: "source database ... is being accessed by other users".
const OBJECT_IN_USE: &str = "55006";

/// SQLSTATE invalid_catalog_name: the template was dropped meanwhile.
const NO_SUCH_DATABASE: &str = "3D000";

/// Migrations as `(file name, contents)`, in the order they apply.
pub(super) type Migrations = &'static [(&'static str, &'static str)];

/// A migration set and the name of its template database.
pub(super) struct MigrationSet {
    migrations: Migrations,
    /// Its template database's name.
    pub(super) template: String,
}

impl MigrationSet {
    /// The set under its template: `idem_tpl_` and the first 16 hex digits
    /// of a SHA-256 over every migration's name and contents, in order.
    fn new(migrations: Migrations) -> Self {
        let mut digest = Sha256::new();
        for (file, sql) in migrations {
            // Length-prefixed, so no two migration sets hash alike by shifting bytes.
            for part in [file.as_bytes(), sql.as_bytes()] {
                digest.update((part.len() as u64).to_le_bytes());
                digest.update(part);
            }
        }
        let hex = hex::encode(digest.finalize());
        MigrationSet { migrations, template: format!("{TEMPLATE_PREFIX}{}", &hex[..16]) }
    }

    /// The migrations this crate embeds, in the single-table layout.
    #[cfg(test)]
    pub(super) fn embedded() -> &'static MigrationSet {
        MigrationSet::of(Layout::Single)
    }

    /// The migrations this crate embeds for `layout`.
    pub(super) fn of(layout: Layout) -> &'static MigrationSet {
        static SINGLE: OnceLock<MigrationSet> = OnceLock::new();
        static PARTITIONED: OnceLock<MigrationSet> = OnceLock::new();
        let set = match layout {
            Layout::Single => &SINGLE,
            Layout::PartitionedByOrganization => &PARTITIONED,
        };
        set.get_or_init(|| MigrationSet::new(layout.migrations()))
    }
}

/// Creates database `db_name` as a copy of the template of `set`, building
/// the template first when it is missing.
pub(super) async fn create_from_template(
    admin: &mut PgConnection,
    admin_url: &Url,
    set: &MigrationSet,
    db_name: &str,
) -> Result<(), LocalError> {
    let (mut in_use, mut rebuilt) = (0, 0);
    loop {
        let template = ensure_template(admin, admin_url, set).await?;
        let create = format!("create database {} template {}", quote_ident(db_name), quote_ident(template));
        let Err(source) = admin.execute(AssertSqlSafe(create)).await else {
            return Ok(());
        };
        match sqlstate(&source).as_deref() {
            // A session on the template (one that outlived its build, or an
            // operator's): PostgreSQL waited 5 s for it; wait a little more.
            Some(OBJECT_IN_USE) if in_use + 1 < IN_USE_TRIES => {
                in_use += 1;
                tokio::time::sleep(Duration::from_millis(100 << in_use)).await;
            }
            // Dropped as stale by another run between the check and the copy.
            Some(NO_SUCH_DATABASE) if rebuilt < 2 => rebuilt += 1,
            _ => return Err(LocalError::Database { url: redacted(admin_url), source }),
        }
    }
}

/// Returns the template of `set`, building it when it is missing.
async fn ensure_template<'s>(
    admin: &mut PgConnection,
    admin_url: &Url,
    set: &'s MigrationSet,
) -> Result<&'s str, LocalError> {
    let name = set.template.as_str();
    let database_error = |source| LocalError::Database { url: redacted(admin_url), source };
    // A template under its final name is complete: the name is given last.
    if database_exists(admin, name).await.map_err(database_error)? {
        return Ok(name);
    }
    // Roles are cluster-wide: serialize the builds of concurrent stacks
    // (tests run in parallel processes) on a lock the whole cluster shares.
    let lock = AssertSqlSafe(format!("select pg_advisory_lock(hashtext('{MIGRATION_LOCK}'))"));
    admin.execute(lock).await.map_err(|source| LocalError::Migration { file: "(advisory lock)", source })?;
    let built = async {
        if database_exists(admin, name).await.map_err(database_error)? {
            return Ok(());
        }
        build_template(admin, admin_url, set).await?;
        drop_old_templates(admin, name).await;
        Ok(())
    }
    .await;
    let unlock = AssertSqlSafe(format!("select pg_advisory_unlock(hashtext('{MIGRATION_LOCK}'))"));
    let _ = admin.execute(unlock).await;
    built.map(|()| name)
}

/// Applies `migrations`, in order, to the database at `db_url`.
async fn apply_migrations(db_url: &Url, migrations: Migrations) -> Result<(), LocalError> {
    let mut conn = super::cluster::while_slots_are_full(|| PgConnection::connect(db_url.as_str()))
        .await
        .map_err(|source| LocalError::Database { url: redacted(db_url), source })?;
    let mut result = Ok(());
    for (file, sql) in migrations {
        if let Err(source) = sqlx::raw_sql(*sql).execute(&mut conn).await {
            result = Err(LocalError::Migration { file, source });
            break;
        }
    }
    let _ = conn.close().await;
    result
}

/// Builds the template of `set` under a temporary name, applies every
/// migration to it, closes it to connections, and gives it its name. The
/// caller holds the migration lock, so any database of the temporary name is
/// a build a killed run left behind.
async fn build_template(admin: &mut PgConnection, admin_url: &Url, set: &MigrationSet) -> Result<(), LocalError> {
    let name = set.template.as_str();
    let building = format!("{name}{BUILDING_SUFFIX}");
    let database_error = |source| LocalError::Database { url: redacted(admin_url), source };
    drop_template(admin, &building).await.map_err(database_error)?;
    admin.execute(AssertSqlSafe(format!("create database \"{building}\""))).await.map_err(database_error)?;
    let finished = async {
        let mut building_url = admin_url.clone();
        building_url.set_path(&format!("/{building}"));
        apply_migrations(&building_url, set.migrations).await?;
        let built = format!("{TEMPLATE_COMMENT}{}", chrono::Utc::now().to_rfc3339());
        let close = format!(
            "alter database \"{building}\" with allow_connections false is_template true;
             comment on database \"{building}\" is '{built}'"
        );
        sqlx::raw_sql(AssertSqlSafe(close)).execute(&mut *admin).await.map_err(database_error)?;
        // The migrations' session may still be leaving: PostgreSQL waits 5 s
        // for it on each try.
        let rename = format!("alter database \"{building}\" rename to \"{name}\"");
        let mut tries = 0;
        loop {
            match admin.execute(AssertSqlSafe(rename.as_str())).await {
                Ok(_) => return Ok(()),
                Err(source) if sqlstate(&source).as_deref() == Some(OBJECT_IN_USE) && tries + 1 < IN_USE_TRIES => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(100 << tries)).await;
                }
                Err(source) => return Err(database_error(source)),
            }
        }
    }
    .await;
    if finished.is_err() {
        let _ = drop_template(admin, &building).await;
    }
    finished
}

/// Applies the cluster-wide migrations again on a stack's database.
pub(super) async fn apply_cluster_wide_migrations(db: &PgPool) -> Result<(), LocalError> {
    for (file, sql) in MIGRATIONS.iter().filter(|(file, _)| CLUSTER_WIDE_MIGRATIONS.contains(file)) {
        sqlx::raw_sql(*sql).execute(db).await.map_err(|source| LocalError::Migration { file, source })?;
    }
    Ok(())
}

/// Drops a template database (or one being built), if it exists.
async fn drop_template(admin: &mut PgConnection, name: &str) -> Result<(), sqlx::Error> {
    if !database_exists(admin, name).await? {
        return Ok(());
    }
    // `name` is one of ours, read back from pg_database or generated above.
    admin.execute(AssertSqlSafe(format!("alter database \"{name}\" is_template false"))).await?;
    drop_database(admin, name).await
}

/// Drops what earlier template builds left: unfinished builds (the caller
/// holds the migration lock, so nobody is building one), and templates of
/// other migration sets built more than [`STALE_TEMPLATE_AFTER`] ago. A copy
/// being made from one finishes first (a drop waits for it), and a run still
/// using that set builds its template again. Best effort.
async fn drop_old_templates(admin: &mut PgConnection, current: &str) {
    let templates: Vec<(String, Option<String>)> = match sqlx::query_as(
        "select datname::text, pg_catalog.shobj_description(oid, 'pg_database')
           from pg_catalog.pg_database
          where starts_with(datname, $1) and datname <> $2",
    )
    .bind(TEMPLATE_PREFIX)
    .bind(current)
    .fetch_all(&mut *admin)
    .await
    {
        Ok(templates) => templates,
        Err(_) => return,
    };
    let now = chrono::Utc::now();
    for (name, comment) in templates {
        if !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            continue;
        }
        let built = comment
            .as_deref()
            .and_then(|c| c.strip_prefix(TEMPLATE_COMMENT))
            .and_then(|at| chrono::DateTime::parse_from_rfc3339(at).ok());
        let stale = match built {
            Some(built) => now.signed_duration_since(built) > STALE_TEMPLATE_AFTER,
            None => name.ends_with(BUILDING_SUFFIX),
        };
        if stale {
            let _ = drop_template(admin, &name).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::local::cluster::admin;
    use crate::local::database_name::DB_PREFIX;

    #[test]
    fn the_template_is_named_after_every_migrations_name_and_contents() {
        static BASE: Migrations = &[("0001_a.sql", "select 1;"), ("0002_b.sql", "select 2;")];
        static CHANGED: Migrations = &[("0001_a.sql", "select 1;"), ("0002_b.sql", "select 3;")];
        static RENAMED: Migrations = &[("0001_a.sql", "select 1;"), ("0002_c.sql", "select 2;")];
        static SHIFTED: Migrations = &[("0001_a.sql", "select 1;0002_b.sql"), ("", "select 2;")];
        static ADDED: Migrations = &[("0001_a.sql", "select 1;"), ("0002_b.sql", "select 2;"), ("0003_c.sql", "")];
        let names: Vec<String> =
            [BASE, CHANGED, RENAMED, SHIFTED, ADDED, &BASE[..1]].map(|m| MigrationSet::new(m).template).into();
        let distinct: std::collections::HashSet<&String> = names.iter().collect();
        assert_eq!(distinct.len(), names.len(), "{names:?}");
        assert_eq!(MigrationSet::new(BASE).template, names[0], "the same set, the same template");
        for name in names.iter().chain([&MigrationSet::embedded().template]) {
            let digest = name.strip_prefix(TEMPLATE_PREFIX).expect("the prefix");
            assert!(digest.len() == 16 && digest.bytes().all(|b| b.is_ascii_hexdigit()), "{name}");
            assert!(!name.starts_with(DB_PREFIX), "never taken for a stack's database");
        }
    }

    #[test]
    fn every_cluster_wide_migration_is_an_embedded_one() {
        for file in CLUSTER_WIDE_MIGRATIONS {
            assert!(MIGRATIONS.iter().any(|(name, _)| name == file), "{file} is not embedded");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_copies_of_a_missing_template_build_it_once_and_all_get_every_migration() {
        // A migration set of this run's own (the shared template stays
        // untouched), and the unfinished build of a killed run in the way.
        let nonce = format!("{:016x}", rand::random::<u64>());
        let first: &'static str = Box::leak(format!("create table probe (id int primary key); -- {nonce}").into());
        let migrations: Migrations =
            Box::leak(vec![("0001_probe.sql", first), ("0002_row.sql", "insert into probe values (7)")].into());
        let set: &'static MigrationSet = Box::leak(Box::new(MigrationSet::new(migrations)));
        let (mut admin, url) = admin().await;
        let leftover = format!("{}{BUILDING_SUFFIX}", set.template);
        admin.execute(AssertSqlSafe(format!("create database \"{leftover}\""))).await.expect("a leftover build");

        let copies: Vec<String> = (0..4)
            .map(|i| {
                format!("{DB_PREFIX}{}_{}_{:08x}", chrono::Utc::now().format("%Y%m%d%H%M%S"), std::process::id(), i)
            })
            .collect();
        let made = futures_util::future::join_all(copies.iter().cloned().map(|copy| {
            let url = url.clone();
            tokio::spawn(async move {
                let mut admin = PgConnection::connect(url.as_str()).await.expect("connect");
                create_from_template(&mut admin, &url, set, &copy).await
            })
        }))
        .await;

        let state: Vec<(String, bool, bool)> = sqlx::query_as(
            "select datname::text, datistemplate, datallowconn from pg_database where starts_with(datname, $1)",
        )
        .bind(&set.template)
        .fetch_all(&mut admin)
        .await
        .expect("the templates");
        let mut rows = Vec::new();
        for copy in &copies {
            let mut copy_url = url.clone();
            copy_url.set_path(&format!("/{copy}"));
            if let Ok(mut conn) = PgConnection::connect(copy_url.as_str()).await {
                rows.push(sqlx::query_scalar::<_, i32>("select id from probe").fetch_all(&mut conn).await.ok());
                let _ = conn.close().await;
            }
        }
        for copy in &copies {
            let _ = drop_database(&mut admin, copy).await;
        }
        let _ = drop_template(&mut admin, &set.template).await;
        let _ = drop_template(&mut admin, &leftover).await;

        for result in made {
            result.expect("task").expect("a copy of the template");
        }
        assert_eq!(state, [(set.template.clone(), true, false)], "one finished template, closed to connections");
        assert_eq!(rows, vec![Some(vec![7]); copies.len()], "every copy holds every migration");
    }
}
