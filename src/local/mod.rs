//! The embedded local stack: a fresh PostgreSQL database with the migrations
//! applied, served by an in-process PostgREST-compatible server
//! (`postrust-server` in compatibility mode) on an ephemeral loopback port.
//!
//! Used by the tests, `idem demo` and `idem up`. Needs a PostgreSQL it can
//! create databases on: `DATABASE_URL`, else `postgres://postgres@127.0.0.1:5432/postgres`.
//! The database is dropped by [`LocalStack::stop`], or on drop.

mod jwt;

use std::time::Duration;

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

/// Databases of this prefix older than this are left over from a killed run.
const STALE_AFTER: chrono::TimeDelta = chrono::TimeDelta::hours(6);

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
    /// [`DEFAULT_DATABASE_URL`].
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
    /// Creates a database, applies the migrations and serves it.
    pub async fn start(config: LocalStackConfig) -> Result<LocalStack, LocalError> {
        let admin_url = Url::parse(&config.database_url)
            .map_err(|e| LocalError::Config(format!("DATABASE_URL is not a URL: {e}")))?;
        let db_name = format!(
            "{DB_PREFIX}{}_{}_{:08x}",
            chrono::Utc::now().format("%Y%m%d%H%M%S"),
            std::process::id(),
            rand::random::<u32>()
        );
        let database_error = |source| LocalError::Database { url: redacted(&admin_url), source };

        let mut admin = PgConnection::connect(admin_url.as_str()).await.map_err(database_error)?;
        drop_stale_databases(&mut admin).await;
        // The name is ours (ASCII letters, digits, '_'), so quoting it is safe.
        admin.execute(AssertSqlSafe(format!("create database \"{db_name}\""))).await.map_err(database_error)?;

        let mut db_url = admin_url.clone();
        db_url.set_path(&format!("/{db_name}"));
        let stack_result = async {
            apply_migrations(&mut admin, &db_url).await?;
            let db = PgPool::connect(db_url.as_str())
                .await
                .map_err(|source| LocalError::Database { url: redacted(&db_url), source })?;
            let jwt_secret = hex::encode(rand::random::<[u8; 32]>());
            let (listener, router) = build_server(&config, &db_url, &jwt_secret).await?;
            Ok::<_, LocalError>((db, jwt_secret, listener, router))
        }
        .await;
        let (db, jwt_secret, listener, router) = match stack_result {
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
    pub async fn restart_server(&mut self) -> Result<(), LocalError> {
        self.stop_server().await;
        let (listener, router) = build_server(&self.config, &self.db_url, &self.jwt_secret).await?;
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

async fn apply_migrations(admin: &mut PgConnection, db_url: &Url) -> Result<(), LocalError> {
    let mut conn = PgConnection::connect(db_url.as_str())
        .await
        .map_err(|source| LocalError::Database { url: redacted(db_url), source })?;
    // Roles are cluster-wide: serialize the migrations of concurrent stacks
    // (tests run in parallel processes) on a lock the whole cluster shares.
    // Advisory locks are per database, so take it in the maintenance one.
    let lock = "select pg_advisory_lock(hashtext('idempotency-plane local migrations'))";
    admin.execute(lock).await.map_err(|source| LocalError::Migration { file: "(advisory lock)", source })?;
    let mut result = Ok(());
    for (file, sql) in MIGRATIONS {
        if let Err(source) = sqlx::raw_sql(*sql).execute(&mut conn).await {
            result = Err(LocalError::Migration { file, source });
            break;
        }
    }
    let unlock = "select pg_advisory_unlock(hashtext('idempotency-plane local migrations'))";
    let _ = admin.execute(unlock).await;
    let _ = conn.close().await;
    result
}

/// Builds the server and binds its port. Connects as `authenticator` (the
/// role PostgREST logs in as) when the cluster lets it log in without a
/// password, else with the admin credentials, which may also switch roles.
async fn build_server(
    config: &LocalStackConfig,
    db_url: &Url,
    jwt_secret: &str,
) -> Result<(tokio::net::TcpListener, axum::Router), LocalError> {
    let mut authenticator_url = db_url.clone();
    let _ = authenticator_url.set_username("authenticator");
    let _ = authenticator_url.set_password(None);

    let mut last_error = String::new();
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
            Ok(app) => {
                let listener = tokio::net::TcpListener::bind(("127.0.0.1", config.port))
                    .await
                    .map_err(|e| LocalError::Server(format!("binding 127.0.0.1:{}: {e}", config.port)))?;
                return Ok((listener, app.router));
            }
            Err(error) => {
                tracing::debug!(uri = %redacted(uri), %error, "local server could not start with this login");
                last_error = format!("{error:#}");
            }
        }
    }
    Err(LocalError::Server(last_error))
}

async fn drop_database(admin: &mut PgConnection, name: &str) -> Result<(), sqlx::Error> {
    // `name` is one of ours, read back from pg_database or generated above.
    admin.execute(AssertSqlSafe(format!("drop database if exists \"{name}\" with (force)"))).await.map(|_| ())
}

/// Drops databases this module created in runs that were killed before they
/// could clean up. Best effort: a failure here never stops a start.
async fn drop_stale_databases(admin: &mut PgConnection) {
    let names: Vec<(String,)> = match sqlx::query_as("select datname from pg_database where datname like $1")
        .bind(format!("{DB_PREFIX}%"))
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
        if safe && now - created > STALE_AFTER {
            let _ = drop_database(admin, &name).await;
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
