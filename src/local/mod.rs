//! The embedded local stack: a fresh PostgreSQL database with the migrations
//! applied, served by an in-process PostgREST-compatible server
//! (`postrust-server` in compatibility mode) on an ephemeral loopback port.
//!
//! Used by the tests, `idem demo` and `idem up`. Needs a PostgreSQL it can
//! create databases on: `DATABASE_URL`, else `postgres://postgres@127.0.0.1:5432/postgres`.
//! The database is dropped by [`LocalStack::stop`], or on drop.
//!
//! The migrations are applied once per migration set, into a template
//! database named after a digest of every embedded migration
//! (`idem_tpl_<16 hex>`), and each stack's database is a copy of it
//! (`CREATE DATABASE ... TEMPLATE`): a changed migration names a new template,
//! never a stale one. The template is built under the cluster-wide advisory
//! lock the migrations always took, under a temporary name that is renamed
//! only once every migration applied, and nobody may connect to it
//! (`ALLOW_CONNECTIONS false`), so a copy never waits on a stray session.

mod jwt;

use std::str::FromStr;
use std::sync::OnceLock;
use std::time::Duration;

use sha2::{Digest, Sha256};
use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection, PgPool};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use url::Url;

use crate::migrations::MIGRATIONS;
use crate::postgrest::{ClientConfig, ClientError, PostgrestClient};
use crate::{IdempotencyService, PostgrestRepository};

pub use jwt::mint_token;

/// The maintenance database used when `DATABASE_URL` is unset.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// Names of the databases the stack creates start with this.
const DB_PREFIX: &str = "idem_local_";

/// A database of this prefix that no session is connected to is left over
/// from a run that was killed, unless its name says it was created less than
/// this long ago: a stack connects its keeper right after creating its
/// database, and one in that window is not yet in use.
const SETTING_UP_FOR: chrono::TimeDelta = chrono::TimeDelta::minutes(10);

/// The advisory lock (in the maintenance database) that a start holds
/// shared from creating its database until its keeper is connected, and
/// that a clean-up takes exclusively.
const SETUP_LOCK: &str = "idempotency-plane local stack set-up";

/// What a stack's keeper session calls itself in `pg_stat_activity`.
const KEEPER_APPLICATION_NAME: &str = "idempotency-plane local stack";

/// Names of the template databases, one per migration set, start with this.
const TEMPLATE_PREFIX: &str = "idem_tpl_";

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
const CLUSTER_WIDE_MIGRATIONS: &[&str] = &["0001_roles.sql"];

/// Tries of a `CREATE DATABASE ... TEMPLATE` or a template rename that
/// PostgreSQL refuses because the template is in use (each try already waits
/// up to 5 s for other sessions to leave).
const IN_USE_TRIES: u32 = 5;

/// Rounds of trying to build the server (each with both logins) before
/// [`LocalStack::start`] or [`LocalStack::restart_server`] gives up.
const SERVER_BUILD_ROUNDS: u32 = 4;

/// SQLSTATE object_in_use: "source database ... is being accessed by other users".
const OBJECT_IN_USE: &str = "55006";

/// SQLSTATE invalid_catalog_name: the template was dropped meanwhile.
const NO_SUCH_DATABASE: &str = "3D000";

/// Why the local stack could not start or stop.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LocalError {
    /// PostgreSQL refused or failed.
    #[error("local PostgreSQL at {url} failed")]
    Database {
        /// The URL, without its password.
        url: String,
        /// sqlx's error.
        #[source]
        source: sqlx::Error,
    },
    /// A migration failed to apply.
    #[error("applying migration {file} failed")]
    Migration {
        /// The file.
        file: &'static str,
        /// sqlx's error.
        #[source]
        source: sqlx::Error,
    },
    /// The PostgREST-compatible server could not be built or bound.
    #[error("starting the local PostgREST-compatible server: {0}")]
    Server(String),
    /// The configuration is unusable.
    #[error("local stack configuration: {0}")]
    Config(String),
    /// Building the client against the stack failed.
    #[error(transparent)]
    Client(#[from] ClientError),
}

/// How to start a [`LocalStack`].
#[derive(Debug, Clone)]
pub struct LocalStackConfig {
    /// A superuser URL of the cluster's maintenance database; the stack
    /// creates its own database beside it. Default: `DATABASE_URL`, else
    /// [`DEFAULT_DATABASE_URL`]. On a loopback host the stack connects
    /// without TLS unless the URL (`sslmode=`) or `PGSSLMODE` asks for a mode.
    pub database_url: String,
    /// The server's `db-max-rows`. Default 1000, Supabase's default.
    pub max_rows: u32,
    /// The server's connection pool size. Default 20.
    pub pool_size: u32,
    /// The port to bind on 127.0.0.1; 0 picks a free one. Default 0.
    pub port: u16,
}

impl Default for LocalStackConfig {
    fn default() -> Self {
        LocalStackConfig {
            database_url: std::env::var("DATABASE_URL")
                .ok()
                .filter(|v| !v.is_empty())
                .unwrap_or_else(|| DEFAULT_DATABASE_URL.to_owned()),
            max_rows: 1000,
            pool_size: 20,
            port: 0,
        }
    }
}

impl LocalStackConfig {
    /// Sets the server's `db-max-rows`.
    pub fn with_max_rows(mut self, max_rows: u32) -> Self {
        self.max_rows = max_rows;
        self
    }

    /// Binds the server on `port` of 127.0.0.1 (0 picks a free one).
    pub fn with_port(mut self, port: u16) -> Self {
        self.port = port;
        self
    }
}

/// A running local plane. Stop it with [`LocalStack::stop`]; dropping it
/// also drops its database, from a helper thread. `Debug` never prints the
/// service key or the JWT secret.
pub struct LocalStack {
    url: String,
    service_key: String,
    jwt_secret: String,
    config: LocalStackConfig,
    db_name: String,
    db_url: Url,
    admin_url: Url,
    db: PgPool,
    /// A session on the stack's database for as long as the stack lives:
    /// what tells every other start that the database is in use, even when
    /// the pools have let their idle connections go.
    keeper: Option<PgConnection>,
    /// The port was picked by the system (config port 0): it is bound
    /// shareable, so a restart can hold it while no server listens on it.
    picked_port: bool,
    shutdown: Option<oneshot::Sender<()>>,
    server: Option<JoinHandle<()>>,
    dropped: bool,
}

impl std::fmt::Debug for LocalStack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalStack")
            .field("url", &self.url)
            .field("service_key", &"<redacted>")
            .field("jwt_secret", &"<redacted>")
            .field("max_rows", &self.config.max_rows)
            .field("database", &self.db_name)
            .field("admin_url", &redacted(&self.admin_url))
            .finish_non_exhaustive()
    }
}

/// Serves `router` on `listener` until the returned sender fires.
fn serve(listener: tokio::net::TcpListener, router: axum::Router) -> (oneshot::Sender<()>, JoinHandle<()>) {
    let (shutdown, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let serve = axum::serve(listener, router).with_graceful_shutdown(async {
            let _ = stopped.await;
        });
        if let Err(error) = serve.await {
            tracing::error!(%error, "local PostgREST-compatible server stopped");
        }
    });
    (shutdown, server)
}

impl LocalStack {
    /// Creates a database (a copy of the migration set's template, built
    /// first when missing) and serves it. Databases earlier stacks left
    /// behind are dropped first, but only those no session is connected to:
    /// a live stack keeps one open on its database.
    pub async fn start(config: LocalStackConfig) -> Result<LocalStack, LocalError> {
        let db_name = format!(
            "{DB_PREFIX}{}_{}_{:08x}",
            chrono::Utc::now().format("%Y%m%d%H%M%S"),
            std::process::id(),
            rand::random::<u32>()
        );
        Self::start_as(config, db_name).await
    }

    async fn start_as(config: LocalStackConfig, db_name: String) -> Result<LocalStack, LocalError> {
        let admin_url = Url::parse(&config.database_url)
            .map_err(|e| LocalError::Config(format!("DATABASE_URL is not a URL: {e}")))?;
        let admin_url = without_loopback_tls(admin_url);
        let database_error = |source| LocalError::Database { url: redacted(&admin_url), source };

        let mut admin = PgConnection::connect(admin_url.as_str()).await.map_err(database_error)?;
        drop_stale_databases(&mut admin).await;
        // Until its keeper connects, the new database has no session: the
        // shared set-up lock keeps other starts' clean-ups away meanwhile.
        // Closing `admin` releases it.
        sqlx::query("select pg_advisory_lock_shared(hashtext($1))")
            .bind(SETUP_LOCK)
            .execute(&mut admin)
            .await
            .map_err(database_error)?;
        create_from_template(&mut admin, &admin_url, MigrationSet::embedded(), &db_name).await?;

        let mut db_url = admin_url.clone();
        db_url.set_path(&format!("/{db_name}"));
        let picked_port = config.port == 0;
        let stack_result = async {
            let stack_error = |source| LocalError::Database { url: redacted(&db_url), source };
            let keeper_options = sqlx::postgres::PgConnectOptions::from_str(db_url.as_str())
                .map_err(stack_error)?
                .application_name(KEEPER_APPLICATION_NAME);
            let keeper = PgConnection::connect_with(&keeper_options).await.map_err(stack_error)?;
            let db = PgPool::connect(db_url.as_str()).await.map_err(stack_error)?;
            apply_cluster_wide_migrations(&db).await?;
            let jwt_secret = hex::encode(rand::random::<[u8; 32]>());
            let router = build_router(&config, &db_url, &jwt_secret).await?;
            let listener = bind_listener(config.port, picked_port)?;
            Ok::<_, LocalError>((keeper, db, jwt_secret, listener, router))
        }
        .await;
        let (keeper, db, jwt_secret, listener, router) = match stack_result {
            Ok(parts) => parts,
            Err(error) => {
                let _ = drop_database(&mut admin, &db_name).await;
                return Err(error);
            }
        };
        let _ = admin.close().await;

        let address =
            listener.local_addr().map_err(|e| LocalError::Server(format!("reading the bound address: {e}")))?;
        let (shutdown, server) = serve(listener, router);
        let service_key = mint_token(&jwt_secret, "service_role", Duration::from_secs(7 * 24 * 3600));
        tracing::info!(url = %format!("http://{address}"), database = %db_name, "local plane up");
        Ok(LocalStack {
            url: format!("http://{address}"),
            service_key,
            jwt_secret,
            config: LocalStackConfig { port: address.port(), ..config },
            db_name,
            db_url,
            admin_url,
            db,
            keeper: Some(keeper),
            picked_port,
            shutdown: Some(shutdown),
            server: Some(server),
            dropped: false,
        })
    }

    /// The server's root URL, e.g. `http://127.0.0.1:41234`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A `service_role` JWT the server accepts.
    pub fn service_key(&self) -> &str {
        &self.service_key
    }

    /// A JWT for any `role`, signed with the server's secret.
    pub fn token_for(&self, role: &str) -> String {
        mint_token(&self.jwt_secret, role, Duration::from_secs(3600))
    }

    /// The server's `db-max-rows`.
    pub fn max_rows(&self) -> u32 {
        self.config.max_rows
    }

    /// Tears the server down and builds a new one on the same port and
    /// database, with a fresh connection pool and schema cache: a server
    /// restart as a deployment sees it. Requests in the gap are refused.
    /// A port the system picked stays reserved to this stack through the gap
    /// (bound, not listening), so no other socket can take it meanwhile.
    pub async fn restart_server(&mut self) -> Result<(), LocalError> {
        let reservation = if self.picked_port { reserve_port(self.config.port)? } else { None };
        self.stop_server().await;
        let router = build_router(&self.config, &self.db_url, &self.jwt_secret).await?;
        let listener = bind_listener(self.config.port, self.picked_port)?;
        drop(reservation);
        let (shutdown, server) = serve(listener, router);
        self.shutdown = Some(shutdown);
        self.server = Some(server);
        Ok(())
    }

    /// Stops the server: graceful for five seconds, then aborted.
    async fn stop_server(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if let Some(mut server) = self.server.take() {
            if tokio::time::timeout(Duration::from_secs(5), &mut server).await.is_err() {
                server.abort();
                let _ = server.await;
            }
        }
    }

    /// The database's name.
    pub fn database_name(&self) -> &str {
        &self.db_name
    }

    /// A superuser pool on the stack's database, for what only tests and
    /// operators do: counting rows, moving timestamps back in time.
    pub fn db(&self) -> &PgPool {
        &self.db
    }

    /// A client configuration pointing at this stack with the service key
    /// and the server's real row cap.
    pub fn client_config(&self) -> Result<ClientConfig, ClientError> {
        ClientConfig::new(&self.url, self.service_key.clone())?.with_max_rows(self.config.max_rows)
    }

    /// A service over this stack.
    pub fn service(&self) -> Result<IdempotencyService<PostgrestRepository>, ClientError> {
        let client = PostgrestClient::new(self.client_config()?)?;
        Ok(IdempotencyService::new(PostgrestRepository::new(client)))
    }

    /// Stops the server and drops the database.
    pub async fn stop(mut self) -> Result<(), LocalError> {
        self.stop_server().await;
        self.db.close().await;
        if let Some(keeper) = self.keeper.take() {
            let _ = keeper.close().await;
        }
        let mut admin = PgConnection::connect(self.admin_url.as_str())
            .await
            .map_err(|source| LocalError::Database { url: redacted(&self.admin_url), source })?;
        let result = drop_database(&mut admin, &self.db_name).await;
        self.dropped = true;
        let _ = admin.close().await;
        result.map_err(|source| LocalError::Database { url: redacted(&self.admin_url), source })
    }
}

impl Drop for LocalStack {
    /// A stack that was not stopped (a test that panicked) still drops its
    /// database: from a thread of its own, since this may run inside a runtime.
    fn drop(&mut self) {
        if self.dropped {
            return;
        }
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        let admin_url = self.admin_url.clone();
        let db_name = self.db_name.clone();
        let cleanup = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() else {
                return;
            };
            runtime.block_on(async {
                if let Ok(mut admin) = PgConnection::connect(admin_url.as_str()).await {
                    let _ = drop_database(&mut admin, &db_name).await;
                }
            });
        });
        let _ = cleanup.join();
    }
}

/// `url` with `sslmode=disable` added when it names a loopback host and
/// asks for no TLS mode itself (nor does `PGSSLMODE`): TLS on loopback
/// protects nothing, and its handshakes and record encryption were most of
/// the CPU a stack's connections cost in a debug build. A mode the URL or the
/// environment asks for is kept.
fn without_loopback_tls(mut url: Url) -> Url {
    let loopback = match url.host() {
        // A `postgres:` URL's host is opaque to `url`: an IPv4 address is a name.
        Some(url::Host::Domain(name)) => {
            name.eq_ignore_ascii_case("localhost")
                || name.parse::<std::net::IpAddr>().is_ok_and(|address| address.is_loopback())
        }
        Some(url::Host::Ipv4(address)) => address.is_loopback(),
        Some(url::Host::Ipv6(address)) => address.is_loopback(),
        None => false,
    };
    let asked = url.query_pairs().any(|(name, _)| name == "sslmode" || name == "ssl-mode")
        || std::env::var_os("PGSSLMODE").is_some();
    if loopback && !asked {
        url.query_pairs_mut().append_pair("sslmode", "disable");
    }
    url
}

/// Migrations as `(file name, contents)`, in the order they apply.
type Migrations = &'static [(&'static str, &'static str)];

/// A migration set and the name of its template database.
struct MigrationSet {
    migrations: Migrations,
    template: String,
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

    /// The migrations this crate embeds.
    fn embedded() -> &'static MigrationSet {
        static EMBEDDED: OnceLock<MigrationSet> = OnceLock::new();
        EMBEDDED.get_or_init(|| MigrationSet::new(MIGRATIONS))
    }
}

/// The SQLSTATE of a database error.
fn sqlstate(error: &sqlx::Error) -> Option<String> {
    error.as_database_error().and_then(|e| e.code()).map(|code| code.into_owned())
}

/// Creates database `db_name` as a copy of the template of `set`, building
/// the template first when it is missing.
async fn create_from_template(
    admin: &mut PgConnection,
    admin_url: &Url,
    set: &MigrationSet,
    db_name: &str,
) -> Result<(), LocalError> {
    let (mut in_use, mut rebuilt) = (0, 0);
    loop {
        let template = ensure_template(admin, admin_url, set).await?;
        // Both names are ours (ASCII letters, digits, '_'), so quoting them is safe.
        let create = format!("create database \"{db_name}\" template \"{template}\"");
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

async fn database_exists(admin: &mut PgConnection, name: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("select exists (select 1 from pg_catalog.pg_database where datname = $1)")
        .bind(name)
        .fetch_one(&mut *admin)
        .await
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

/// Applies `migrations`, in order, to the database at `db_url`.
async fn apply_migrations(db_url: &Url, migrations: Migrations) -> Result<(), LocalError> {
    let mut conn = PgConnection::connect(db_url.as_str())
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

/// Applies the cluster-wide migrations again on a stack's database.
async fn apply_cluster_wide_migrations(db: &PgPool) -> Result<(), LocalError> {
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

/// Builds the server's router. Connects as `authenticator` (the role
/// PostgREST logs in as) when the cluster lets it log in without a password,
/// else with the admin credentials, which may also switch roles. A build
/// that fails with both (its schema cache load cut off by a
/// `statement_timeout` on a busy machine, say) is tried again a few times, as
/// PostgREST retries loading its schema cache.
async fn build_router(config: &LocalStackConfig, db_url: &Url, jwt_secret: &str) -> Result<axum::Router, LocalError> {
    let mut authenticator_url = db_url.clone();
    let _ = authenticator_url.set_username("authenticator");
    let _ = authenticator_url.set_password(None);

    let mut last_error = String::new();
    for round in 0..SERVER_BUILD_ROUNDS {
        if round > 0 {
            tokio::time::sleep(Duration::from_millis(100 << round)).await;
        }
        for uri in [&authenticator_url, db_url] {
            let mut server_config = postrust_core::AppConfig::default();
            server_config.db_uri = uri.to_string();
            server_config.db_schemas = vec!["agent".into()];
            server_config.db_anon_role = Some("anon".into());
            server_config.db_pool_size = config.pool_size;
            server_config.db_max_rows = Some(i64::from(config.max_rows));
            server_config.jwt_secret = Some(jwt_secret.to_owned());
            server_config.compat_mode = true;
            server_config.server_host = "127.0.0.1".into();
            server_config.server_port = config.port;
            match postrust_server::build(server_config, postrust_server::Host::SERVER).await {
                Ok(app) => return Ok(app.router),
                Err(error) => {
                    tracing::debug!(uri = %redacted(uri), %error, round, "local server could not start with this login");
                    last_error = format!("{error:#}");
                }
            }
        }
    }
    Err(LocalError::Server(last_error))
}

/// Binds `port` (0 picks one) of 127.0.0.1 and listens. `shareable` sets
/// SO_REUSEPORT, so [`reserve_port`] can hold the port across a restart.
fn bind_listener(port: u16, shareable: bool) -> Result<tokio::net::TcpListener, LocalError> {
    let bound = (|| {
        let socket = tokio::net::TcpSocket::new_v4()?;
        // As TcpListener::bind does: connections of an earlier server in
        // TIME_WAIT do not keep the port.
        socket.set_reuseaddr(true)?;
        if shareable {
            set_reuseport(&socket)?;
        }
        socket.bind((std::net::Ipv4Addr::LOCALHOST, port).into())?;
        socket.listen(1024)
    })();
    bound.map_err(|e| LocalError::Server(format!("binding 127.0.0.1:{port}: {e}")))
}

/// Binds `port` of 127.0.0.1 without listening, beside the server's own
/// shareable socket: while it lives no other socket can take the port, and
/// connections to it are refused once the server's socket closes. `None`
/// where SO_REUSEPORT is missing.
fn reserve_port(port: u16) -> Result<Option<tokio::net::TcpSocket>, LocalError> {
    if !REUSEPORT {
        return Ok(None);
    }
    let reserved = (|| {
        let socket = tokio::net::TcpSocket::new_v4()?;
        // Without SO_REUSEADDR: with it, any socket that sets it too (as
        // std's and tokio's listeners do) could bind beside a socket that
        // does not listen.
        set_reuseport(&socket)?;
        socket.bind((std::net::Ipv4Addr::LOCALHOST, port).into())?;
        Ok::<_, std::io::Error>(socket)
    })();
    reserved.map(Some).map_err(|e| LocalError::Server(format!("reserving 127.0.0.1:{port}: {e}")))
}

#[cfg(all(unix, not(any(target_os = "solaris", target_os = "illumos", target_os = "cygwin", target_os = "nuttx"))))]
const REUSEPORT: bool = true;
#[cfg(not(all(
    unix,
    not(any(target_os = "solaris", target_os = "illumos", target_os = "cygwin", target_os = "nuttx"))
)))]
const REUSEPORT: bool = false;

#[cfg(all(unix, not(any(target_os = "solaris", target_os = "illumos", target_os = "cygwin", target_os = "nuttx"))))]
fn set_reuseport(socket: &tokio::net::TcpSocket) -> std::io::Result<()> {
    socket.set_reuseport(true)
}

#[cfg(not(all(
    unix,
    not(any(target_os = "solaris", target_os = "illumos", target_os = "cygwin", target_os = "nuttx"))
)))]
fn set_reuseport(_: &tokio::net::TcpSocket) -> std::io::Result<()> {
    Ok(())
}

async fn drop_database(admin: &mut PgConnection, name: &str) -> Result<(), sqlx::Error> {
    // `name` is one of ours, read back from pg_database or generated above.
    admin.execute(AssertSqlSafe(format!("drop database if exists \"{name}\" with (force)"))).await.map(|_| ())
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
async fn drop_stale_databases(admin: &mut PgConnection) {
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

fn redacted(url: &Url) -> String {
    let mut url = url.clone();
    if url.password().is_some() {
        let _ = url.set_password(Some("_"));
    }
    url.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn a_loopback_url_drops_tls_unless_it_or_the_environment_asks_for_a_mode() {
        let from_env = std::env::var_os("PGSSLMODE").is_some();
        for url in [
            "postgres://postgres@127.0.0.1:5432/postgres",
            "postgres://u:p@localhost/db?application_name=x",
            "postgres://u@[::1]:5432/db",
            "postgres://u@127.0.0.2/db",
        ] {
            let local = without_loopback_tls(Url::parse(url).expect("a URL"));
            let modes: Vec<String> =
                local.query_pairs().filter(|(k, _)| k == "sslmode").map(|(_, v)| v.into()).collect();
            let expected: &[&str] = if from_env { &[] } else { &["disable"] };
            assert_eq!(modes, expected, "{url}");
        }
        for url in [
            "postgres://u@db.example.com/db",
            "postgres://u@10.0.0.5/db",
            "postgres://u@127.0.0.1/db?sslmode=require",
            "postgres://u@localhost/db?ssl-mode=verify-full",
        ] {
            let given = Url::parse(url).expect("a URL");
            assert_eq!(without_loopback_tls(given.clone()), given, "{url}");
        }
    }

    #[tokio::test]
    async fn a_reserved_port_refuses_connections_and_other_binds_until_the_next_listener_takes_it() {
        if !REUSEPORT {
            return;
        }
        let first = bind_listener(0, true).expect("a picked port");
        let port = first.local_addr().expect("the address").port();
        let reserved = reserve_port(port).expect("reserved beside the listener").expect("a reservation");
        drop(first);
        // Nothing listens, and nobody else can bind it.
        let refused = tokio::net::TcpStream::connect(("127.0.0.1", port)).await;
        assert_eq!(refused.err().map(|e| e.kind()), Some(std::io::ErrorKind::ConnectionRefused));
        let taken = std::net::TcpListener::bind(("127.0.0.1", port));
        assert_eq!(taken.err().map(|e| e.kind()), Some(std::io::ErrorKind::AddrInUse));
        // The next server's listener binds it while the reservation holds.
        let next = bind_listener(port, true).expect("the same port again");
        drop(reserved);
        let accepted = tokio::join!(next.accept(), tokio::net::TcpStream::connect(("127.0.0.1", port)));
        assert!(accepted.0.is_ok() && accepted.1.is_ok(), "{accepted:?}");
    }

    /// Connects to the maintenance database the stack would use.
    async fn admin() -> (PgConnection, Url) {
        let url = without_loopback_tls(Url::parse(&LocalStackConfig::default().database_url).expect("DATABASE_URL"));
        (PgConnection::connect(url.as_str()).await.expect("connect to PostgreSQL"), url)
    }

    /// A name of ours that says the database was created in 2000.
    fn aged_name() -> String {
        format!("{DB_PREFIX}20000101000000_{}_{:08x}", std::process::id(), rand::random::<u32>())
    }

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

        // Act: the judgement every start's clean-up makes (under the set-up
        // lock, which concurrent starts may hold at any moment here).
        drop_unused_databases(&mut admin).await;
        let kept = database_exists(&mut admin, &name).await.expect("look it up");

        // Once its last session has gone, it is dropped.
        let _ = session.close().await;
        let mut gone = false;
        for _ in 0..300 {
            drop_unused_databases(&mut admin).await;
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

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stack_started_beside_an_old_one_leaves_it_serving() {
        // Arrange: a running stack whose database's name says it is 26 years old.
        let old = LocalStack::start_as(LocalStackConfig::default(), aged_name()).await.expect("the old stack");
        let service = old.service().expect("a service");
        let (org, hash) = (uuid::Uuid::new_v4(), crate::RequestHash::of_json(&serde_json::json!({"n": 1})));
        let first = service.claim(org, "tool.email.send", "k", &hash, Duration::from_secs(60)).await;
        assert!(matches!(first, Ok(crate::ClaimOutcome::Claimed(_))), "{first:?}");

        // Act: another stack starts, and cleans up what it takes for leftovers.
        let new = LocalStack::start(LocalStackConfig::default()).await.expect("the new stack");

        // Assert: the old stack still serves its claims, and its keeper
        // session (not only its pools, which let idle connections go) is
        // what holds its database.
        let again = service.claim(org, "tool.email.send", "k", &hash, Duration::from_secs(60)).await;
        let keepers: i64 = sqlx::query_scalar(
            "select count(*) from pg_catalog.pg_stat_activity where datname = $1 and application_name = $2",
        )
        .bind(old.database_name())
        .bind(KEEPER_APPLICATION_NAME)
        .fetch_one(old.db())
        .await
        .expect("the sessions");
        new.stop().await.expect("stop the new stack");
        old.stop().await.expect("stop the old stack");
        assert!(matches!(again, Ok(crate::ClaimOutcome::Processing { .. })), "{again:?}");
        assert_eq!(keepers, 1, "one keeper session on the old stack's database");
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
