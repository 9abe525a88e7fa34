//! The embedded local stack: a fresh PostgreSQL database with the migrations
//! applied, served by an in-process PostgREST-compatible server
//! (`postrust-server` in compatibility mode) on an ephemeral loopback port.
//!
//! Used by the tests, `idem demo` and `idem up`. Needs a PostgreSQL it can
//! create databases on: `DATABASE_URL`, else `postgres://postgres@127.0.0.1:5432/postgres`.
//! The database is dropped by [`LocalStack::stop`], or on drop, unless it is
//! a named one ([`LocalStackConfig::with_database`]), which is kept across
//! starts.
//!
//! The server answers as Supabase's API does: at its root (as plain
//! PostgREST, which the Rust client and `curl` use) and beneath
//! [`SUPABASE_REST_PATH`] (`/rest/v1`, where supabase-js calls), exposing the
//! schemas `supabase/config.toml` lists ([`exposed_schemas`]), the first of
//! which (`public`) is the default: a request that names no schema
//! (`Content-Profile` / `Accept-Profile`) does not reach `agent`, as on
//! Supabase.
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

pub use jwt::{mint_stable_token, mint_token, STABLE_KEY_EXPIRES_AT, SUPABASE_CLI_JWT_SECRET};

/// Where Supabase serves PostgREST beneath a project's URL: supabase-js
/// calls `<SUPABASE_URL>/rest/v1/rpc/...`. The local server answers there
/// exactly as at its root.
pub const SUPABASE_REST_PATH: &str = "/rest/v1";

/// The Supabase CLI's configuration of this project, embedded: the schemas
/// the local server exposes are read from its `[api] schemas`, so the two
/// cannot drift.
const SUPABASE_CONFIG_TOML: &str = include_str!("../../supabase/config.toml");

/// The shortest JWT secret PostgREST accepts for HS256.
const MIN_JWT_SECRET_BYTES: usize = 32;

/// How long the keys of a stack with a random JWT secret are valid.
const THROWAWAY_KEY_TTL: Duration = Duration::from_secs(7 * 24 * 3600);

/// A named database's comment: this, then the template it was copied from
/// (which names its migration set's digest).
const NAMED_COMMENT: &str = "idempotency-plane local database, kept across starts; migrations ";

/// The longest database name PostgreSQL keeps whole (NAMEDATALEN - 1).
const MAX_DATABASE_NAME_BYTES: usize = 63;

/// Names a named database may not take: the cluster's own databases.
const RESERVED_DATABASE_NAMES: &[&str] = &["postgres", "template0", "template1"];

/// SQLSTATE duplicate_database: created meanwhile by another start.
const DUPLICATE_DATABASE: &str = "42P04";

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
    /// A name given for a kept database is not one the stack may use.
    #[error(transparent)]
    DatabaseName(#[from] DatabaseNameError),
    /// The named database exists but was built from another migration set
    /// than the one this build embeds: reusing it would serve stale
    /// functions. Reset it (`idem up --database NAME --reset`, or
    /// [`LocalStackConfig::with_reset`]) to drop and recreate it.
    #[error(
        "database {name} was built from another migration set ({found}, this build has {expected}); \
         reset it to drop and recreate it, losing its rows (idem up --database {name} --reset), or pick another name"
    )]
    DatabaseOutdated {
        /// The database.
        name: String,
        /// The template it records it was copied from.
        found: String,
        /// The template of this build's migrations.
        expected: String,
    },
    /// The named database exists but was not created by a local stack (it
    /// carries no comment of ours): it is neither reused nor reset.
    #[error(
        "database {name} exists but was not created by idem up (it carries no idempotency-plane comment); \
         it is left alone, even with --reset: pick another name, or drop it yourself"
    )]
    DatabaseNotOurs {
        /// The database.
        name: String,
    },
}

/// Why a name cannot be a kept database's ([`DatabaseName::new`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DatabaseNameError {
    /// The name is empty.
    #[error("a database name cannot be empty")]
    Empty,
    /// The name is longer than PostgreSQL keeps.
    #[error("database name {name:?} is {len} bytes; at most 63")]
    TooLong {
        /// The name.
        name: String,
        /// Its length in bytes.
        len: usize,
    },
    /// The name has a character other than a lowercase ASCII letter, a digit
    /// or `_`.
    #[error("database name {name:?} may hold only lowercase letters a-z, digits and _")]
    Invalid {
        /// The name.
        name: String,
    },
    /// The name starts with a prefix the stack's own databases use: the
    /// clean-up of stale throwaway databases, or of old templates, would
    /// take it for one of them.
    #[error("database name {name:?} starts with {prefix}, which the local stack's own databases use")]
    ReservedPrefix {
        /// The name.
        name: String,
        /// The prefix.
        prefix: &'static str,
    },
    /// The name is one of the cluster's own databases.
    #[error("database name {name:?} is one of the cluster's own databases")]
    Reserved {
        /// The name.
        name: String,
    },
}

/// The name of a database a stack keeps across starts
/// ([`LocalStackConfig::with_database`]): 1 to 63 bytes of lowercase ASCII
/// letters, digits and `_`, not starting with `idem_local_` (the stack's
/// throwaway databases, which a start drops when no session uses them) or
/// `idem_tpl_` (its templates), and not `postgres`, `template0` or
/// `template1`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DatabaseName(String);

impl DatabaseName {
    /// Checks `name`.
    pub fn new(name: &str) -> Result<DatabaseName, DatabaseNameError> {
        let owned = || name.to_owned();
        if name.is_empty() {
            return Err(DatabaseNameError::Empty);
        }
        if name.len() > MAX_DATABASE_NAME_BYTES {
            return Err(DatabaseNameError::TooLong { name: owned(), len: name.len() });
        }
        if !name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_') {
            return Err(DatabaseNameError::Invalid { name: owned() });
        }
        if let Some(prefix) = [DB_PREFIX, TEMPLATE_PREFIX].into_iter().find(|prefix| name.starts_with(prefix)) {
            return Err(DatabaseNameError::ReservedPrefix { name: owned(), prefix });
        }
        if RESERVED_DATABASE_NAMES.contains(&name) {
            return Err(DatabaseNameError::Reserved { name: owned() });
        }
        Ok(DatabaseName(owned()))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for DatabaseName {
    type Err = DatabaseNameError;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        DatabaseName::new(name)
    }
}

impl std::fmt::Display for DatabaseName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// How to start a [`LocalStack`]. `Debug` never prints the JWT secret or
/// the database URL's password.
#[derive(Clone)]
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
    /// The HS256 secret the server verifies tokens with
    /// ([`with_jwt_secret`](Self::with_jwt_secret)). `None`, the default: a
    /// random secret per start, and keys ([`LocalStack::service_key`],
    /// [`LocalStack::anon_key`]) valid for 7 days that no other start
    /// accepts.
    pub jwt_secret: Option<String>,
    /// A database kept across starts ([`with_database`](Self::with_database));
    /// `None`, the default: a throwaway database, dropped on stop.
    pub database: Option<DatabaseName>,
    /// With [`database`](Self::database): drop and recreate it first
    /// ([`with_reset`](Self::with_reset)). Default false.
    pub reset_database: bool,
}

impl std::fmt::Debug for LocalStackConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let database_url = match Url::parse(&self.database_url) {
            Ok(url) => redacted(&url),
            Err(_) => "<not a URL>".to_owned(),
        };
        f.debug_struct("LocalStackConfig")
            .field("database_url", &database_url)
            .field("max_rows", &self.max_rows)
            .field("pool_size", &self.pool_size)
            .field("port", &self.port)
            .field("jwt_secret", &self.jwt_secret.as_ref().map(|_| "<redacted>"))
            .field("database", &self.database)
            .field("reset_database", &self.reset_database)
            .finish()
    }
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
            jwt_secret: None,
            database: None,
            reset_database: false,
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

    /// Verifies tokens with `secret` (at least 32 bytes, PostgREST's
    /// minimum; [`LocalStack::start`] refuses a shorter one) instead of a
    /// random secret, and hands out *stable* keys: [`mint_stable_token`]'s,
    /// the same strings on every start with this secret, valid until
    /// [`STABLE_KEY_EXPIRES_AT`] (2032), so a key written down once keeps
    /// working across restarts. With [`SUPABASE_CLI_JWT_SECRET`] they are the
    /// Supabase CLI's own demo keys.
    ///
    /// Anyone who knows the secret can mint any role's key, `service_role`
    /// included: use a public one only where the server is reached by this
    /// machine alone (the stack binds 127.0.0.1 only).
    pub fn with_jwt_secret(mut self, secret: impl Into<String>) -> Self {
        self.jwt_secret = Some(secret.into());
        self
    }

    /// Serves the database `name` and keeps it across starts instead of a
    /// throwaway one: created as a copy of the migrations' template when
    /// absent, reused when present, never dropped by [`LocalStack::stop`]
    /// (nor by the clean-up of stale throwaway databases, whose prefix its
    /// name cannot carry). The database records which migration set it was
    /// built from (`COMMENT ON DATABASE`); a start refuses one built from
    /// another set ([`LocalError::DatabaseOutdated`]) unless
    /// [`with_reset`](Self::with_reset), and always refuses one it did not
    /// create ([`LocalError::DatabaseNotOurs`]).
    pub fn with_database(mut self, name: DatabaseName) -> Self {
        self.database = Some(name);
        self
    }

    /// With [`with_database`](Self::with_database): drops the database (its
    /// rows with it, and the sessions of any server still on it) and creates
    /// it afresh from this build's migrations. Ignored without a named
    /// database.
    pub fn with_reset(mut self, reset: bool) -> Self {
        self.reset_database = reset;
        self
    }
}

/// A running local plane. Stop it with [`LocalStack::stop`]; dropping it
/// also drops its database (unless it is a named one), from a helper thread.
/// `Debug` never prints the keys or the JWT secret.
pub struct LocalStack {
    url: String,
    service_key: String,
    anon_key: String,
    jwt_secret: String,
    /// A named database: kept on stop and on drop.
    keep_database: bool,
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
            .field("anon_key", &"<redacted>")
            .field("jwt_secret", &"<redacted>")
            .field("keeps_database", &self.keep_database)
            .field("max_rows", &self.config.max_rows)
            .field("database", &self.db_name)
            .field("admin_url", &redacted(&self.admin_url))
            .finish_non_exhaustive()
    }
}

/// A fresh name for a throwaway database: [`DB_PREFIX`], when (UTC, to the
/// second; [`drop_unused_databases`] reads it), the process, a random part.
fn throwaway_name() -> String {
    format!(
        "{DB_PREFIX}{}_{}_{:08x}",
        chrono::Utc::now().format("%Y%m%d%H%M%S"),
        std::process::id(),
        rand::random::<u32>()
    )
}

/// The schemas the local server exposes, in order, the first being the
/// default one (the schema of a request without `Content-Profile` /
/// `Accept-Profile`): `supabase/config.toml`'s `[api] schemas`, read from
/// the copy embedded at build time, so local serves what Supabase is told
/// to. Today `public`, `graphql_public`, `agent`: a client of the plane
/// must name schema `agent`, as on Supabase. A listed schema that does not
/// exist (`graphql_public` on plain PostgreSQL) is served as an empty one.
pub fn exposed_schemas() -> Result<&'static [String], LocalError> {
    static SCHEMAS: OnceLock<Result<Vec<String>, String>> = OnceLock::new();
    match SCHEMAS.get_or_init(|| api_schemas(SUPABASE_CONFIG_TOML)) {
        Ok(schemas) => Ok(schemas),
        Err(error) => Err(LocalError::Config(format!("the embedded supabase/config.toml: {error}"))),
    }
}

/// The `schemas` of the `[api]` table of a Supabase CLI `config.toml`: a
/// one-line array of plain double-quoted strings, which is all this reads.
fn api_schemas(toml: &str) -> Result<Vec<String>, String> {
    let mut table = String::new();
    for line in toml.lines().map(str::trim) {
        if let Some(header) = line.strip_prefix('[') {
            table = header.split_once(']').map(|(name, _)| name.trim().to_owned()).unwrap_or_default();
            continue;
        }
        let Some(value) = line.strip_prefix("schemas").map(str::trim_start).and_then(|rest| rest.strip_prefix('='))
        else {
            continue;
        };
        if table != "api" {
            continue;
        }
        let (items, after) = value
            .trim()
            .strip_prefix('[')
            .and_then(|rest| rest.split_once(']'))
            .ok_or("[api] schemas is not a one-line array")?;
        if !(after.trim().is_empty() || after.trim_start().starts_with('#')) {
            return Err(format!("[api] schemas: unexpected {:?} after the array", after.trim()));
        }
        let mut schemas = Vec::new();
        for item in items.split(',').map(str::trim).filter(|item| !item.is_empty()) {
            let schema = item
                .strip_prefix('"')
                .and_then(|rest| rest.strip_suffix('"'))
                .filter(|name| !name.is_empty() && !name.contains(['"', '\\']))
                .ok_or_else(|| format!("[api] schemas: {item} is not a plain double-quoted name"))?;
            if schemas.iter().any(|known| known == schema) {
                return Err(format!("[api] schemas lists {schema} twice"));
            }
            schemas.push(schema.to_owned());
        }
        if schemas.is_empty() {
            return Err("[api] schemas is empty".into());
        }
        return Ok(schemas);
    }
    Err("no schemas in its [api] table".into())
}

/// The server's router at its root and again beneath
/// [`SUPABASE_REST_PATH`]: the nested copy sees the path with the prefix
/// taken off, so every route, layer and header answers there as at the root.
fn with_supabase_path(router: axum::Router) -> axum::Router {
    axum::Router::new().nest_service(SUPABASE_REST_PATH, router.clone()).fallback_service(router)
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
    /// a live stack keeps one open on its database. With
    /// [`LocalStackConfig::with_database`], serves that database instead,
    /// created when absent and kept on stop.
    pub async fn start(config: LocalStackConfig) -> Result<LocalStack, LocalError> {
        let db_name = match &config.database {
            Some(name) => name.as_str().to_owned(),
            None => throwaway_name(),
        };
        Self::start_as(config, db_name).await
    }

    async fn start_as(config: LocalStackConfig, db_name: String) -> Result<LocalStack, LocalError> {
        let keep_database = config.database.is_some();
        if let Some(secret) = &config.jwt_secret {
            if secret.len() < MIN_JWT_SECRET_BYTES {
                return Err(LocalError::Config(format!(
                    "the JWT secret is {} bytes; PostgREST needs at least {MIN_JWT_SECRET_BYTES}",
                    secret.len()
                )));
            }
        }
        // Read before anything is created: a broken embedded config fails here.
        exposed_schemas()?;
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
        if keep_database {
            open_named_database(&mut admin, &admin_url, MigrationSet::embedded(), &db_name, config.reset_database)
                .await?;
        } else {
            create_from_template(&mut admin, &admin_url, MigrationSet::embedded(), &db_name).await?;
        }

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
            let jwt_secret = match &config.jwt_secret {
                Some(secret) => secret.clone(),
                None => hex::encode(rand::random::<[u8; 32]>()),
            };
            let router = build_router(&config, &db_url, &jwt_secret).await?;
            let listener = bind_listener(config.port, picked_port)?;
            Ok::<_, LocalError>((keeper, db, jwt_secret, listener, router))
        }
        .await;
        let (keeper, db, jwt_secret, listener, router) = match stack_result {
            Ok(parts) => parts,
            Err(error) => {
                // A named database is complete as created, and may hold rows.
                if !keep_database {
                    let _ = drop_database(&mut admin, &db_name).await;
                }
                return Err(error);
            }
        };
        let _ = admin.close().await;

        let address =
            listener.local_addr().map_err(|e| LocalError::Server(format!("reading the bound address: {e}")))?;
        let (shutdown, server) = serve(listener, router);
        let key = |role| match config.jwt_secret {
            Some(_) => mint_stable_token(&jwt_secret, role),
            None => mint_token(&jwt_secret, role, THROWAWAY_KEY_TTL),
        };
        let (service_key, anon_key) = (key("service_role"), key("anon"));
        tracing::info!(url = %format!("http://{address}"), database = %db_name, kept = keep_database, "local plane up");
        Ok(LocalStack {
            url: format!("http://{address}"),
            service_key,
            anon_key,
            jwt_secret,
            keep_database,
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

    /// The server's root URL, e.g. `http://127.0.0.1:41234`: PostgREST's
    /// root, and a Supabase project URL (`SUPABASE_URL`) too, since the same
    /// API answers beneath [`SUPABASE_REST_PATH`].
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A `service_role` JWT the server accepts: valid 7 days with a random
    /// secret, or the stable key of [`LocalStackConfig::with_jwt_secret`].
    pub fn service_key(&self) -> &str {
        &self.service_key
    }

    /// An `anon` JWT the server accepts, as Supabase's anon key is one
    /// (valid as long as [`service_key`](Self::service_key)). The `anon`
    /// role may execute none of the plane's functions.
    pub fn anon_key(&self) -> &str {
        &self.anon_key
    }

    /// Whether the database is a named one, kept on stop.
    pub fn keeps_database(&self) -> bool {
        self.keep_database
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

    /// Stops the server and drops the database, unless it is a named one
    /// ([`keeps_database`](Self::keeps_database)), which is kept.
    pub async fn stop(mut self) -> Result<(), LocalError> {
        self.stop_server().await;
        self.db.close().await;
        if let Some(keeper) = self.keeper.take() {
            let _ = keeper.close().await;
        }
        if self.keep_database {
            self.dropped = true;
            return Ok(());
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
    /// database, unless it is a named one: from a thread of its own, since
    /// this may run inside a runtime.
    fn drop(&mut self) {
        if self.dropped {
            return;
        }
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if self.keep_database {
            return;
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
async fn open_named_database(
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
    Err(LocalError::Config(format!(
        "database {name} kept being created or dropped by another start meanwhile; try again"
    )))
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
            server_config.db_schemas = exposed_schemas()?.to_vec();
            server_config.db_anon_role = Some("anon".into());
            server_config.db_pool_size = config.pool_size;
            server_config.db_max_rows = Some(i64::from(config.max_rows));
            server_config.jwt_secret = Some(jwt_secret.to_owned());
            server_config.compat_mode = true;
            server_config.server_host = "127.0.0.1".into();
            server_config.server_port = config.port;
            match postrust_server::build(server_config, postrust_server::Host::SERVER).await {
                Ok(app) => return Ok(with_supabase_path(app.router)),
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
    admin
        .execute(AssertSqlSafe(format!("drop database if exists {} with (force)", quote_ident(name))))
        .await
        .map(|_| ())
}

/// `name` as a quoted SQL identifier: in double quotes, each one inside
/// doubled. The names quoted here are ours or [`DatabaseName`]s, which hold
/// no quote at all; the quoting holds whatever they hold.
fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// `text` as a quoted SQL string literal (standard_conforming_strings, on
/// since PostgreSQL 9.1: a backslash is an ordinary character).
fn quote_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
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
    fn the_exposed_schemas_are_supabase_config_tomls_with_public_first() {
        let schemas = exposed_schemas().expect("the embedded config.toml parses");
        assert_eq!(schemas, ["public", "graphql_public", "agent"]);
        // The client's schema is exposed, but only when named.
        let client = ClientConfig::new("http://x", "k").expect("a config").schema;
        assert!(schemas.contains(&client) && schemas[0] != client, "{client}");
    }

    #[test]
    fn the_schemas_line_is_read_from_the_api_table_only_and_strictly() {
        let read = |toml: &str| api_schemas(toml);
        let toml = "[db]\nschemas = [\"db\"]\n[api] # the API\nenabled = true\n  schemas = [ \"a\" , \"b\", ] # x\n";
        assert_eq!(read(toml), Ok(vec!["a".to_owned(), "b".to_owned()]));
        assert_eq!(read("[api]\nschemas_x = [\"a\"]\nschemas=[\"c\"]"), Ok(vec!["c".to_owned()]));
        for broken in [
            "[db]\nschemas = [\"a\"]",
            "[api]\nschemas = []",
            "[api]\nschemas = [\n\"a\"]",
            "[api]\nschemas = [\"a\"] extra",
            "[api]\nschemas = ['a']",
            "[api]\nschemas = [\"a\", \"a\"]",
            "[api]\nschemas = [\"a\\\"b\"]",
        ] {
            assert!(read(broken).is_err(), "{broken:?} read as {:?}", read(broken));
        }
    }

    #[test]
    fn a_kept_database_name_is_plain_short_and_never_one_the_clean_ups_take() {
        for good in ["idem_dev", "a", "x1_2", &"n".repeat(63), "idem_localx", "idem_tplx"] {
            assert_eq!(DatabaseName::new(good).map(|n| n.as_str().to_owned()), Ok(good.to_owned()));
        }
        let refused = |name: &str| DatabaseName::new(name).expect_err(name);
        assert_eq!(refused(""), DatabaseNameError::Empty);
        assert!(matches!(refused(&"n".repeat(64)), DatabaseNameError::TooLong { len: 64, .. }));
        for bad in ["Idem", "idem-dev", "idem dev", "idem\"; drop database postgres; --", "é", "a.b"] {
            assert!(matches!(refused(bad), DatabaseNameError::Invalid { .. }), "{bad}");
        }
        for (bad, prefix) in [(format!("{DB_PREFIX}x"), DB_PREFIX), (format!("{TEMPLATE_PREFIX}x"), TEMPLATE_PREFIX)] {
            assert_eq!(refused(&bad), DatabaseNameError::ReservedPrefix { name: bad.clone(), prefix });
        }
        for bad in ["postgres", "template0", "template1"] {
            assert!(matches!(refused(bad), DatabaseNameError::Reserved { .. }), "{bad}");
        }
        // Quoting holds whatever a name holds.
        assert_eq!(quote_ident(r#"a"b"#), r#""a""b""#);
        assert_eq!(quote_literal("it's"), "'it''s'");
    }

    #[test]
    fn debug_never_prints_the_jwt_secret_or_a_password() {
        let config = LocalStackConfig {
            database_url: "postgres://u:hunter2@127.0.0.1/postgres".into(),
            ..LocalStackConfig::default()
        }
        .with_jwt_secret("a-secret-of-at-least-thirty-two-bytes-long");
        let printed = format!("{config:?}");
        assert!(!printed.contains("hunter2") && !printed.contains("a-secret-of"), "{printed}");
        assert!(printed.contains("jwt_secret: Some(\"<redacted>\")"), "{printed}");
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
