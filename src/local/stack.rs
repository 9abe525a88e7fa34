//! A running local plane ([`LocalStack`]): its start (database, keeper
//! session, server, keys), what it hands out, a server restart, and its
//! stop.

use std::str::FromStr;
use std::time::Duration;

use sqlx::{Connection, PgConnection, PgPool};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use url::Url;

use super::api_keys::ApiKeys;
use super::cluster::{drop_database, redacted, while_slots_are_full, without_loopback_tls};
use super::config::LocalStackConfig;
use super::database::{drop_stale_databases, open_named_database, throwaway_name, SETUP_LOCK};
use super::error::LocalError;
use super::jwt::{mint_stable_token, mint_token};
use super::ports::{bind_listener, reserve_port};
use super::server::{build_router, exposed_schemas, serve};
use super::template::{apply_cluster_wide_migrations, create_from_template, MigrationSet};
use crate::postgrest::{ClientConfig, ClientError, PostgrestClient};
use crate::{IdempotencyService, PostgrestRepository};

/// The shortest JWT secret PostgREST accepts for HS256.
const MIN_JWT_SECRET_BYTES: usize = 32;

/// How long the keys of a stack with a random JWT secret are valid.
const THROWAWAY_KEY_TTL: Duration = Duration::from_secs(7 * 24 * 3600);

/// What a stack's keeper session calls itself in `pg_stat_activity`.
const KEEPER_APPLICATION_NAME: &str = "idempotency-plane local stack";

/// A running local plane. Stop it with [`LocalStack::stop`]; dropping it
/// also drops its database (unless it is a named one), from a helper thread.
/// `Debug` never prints the keys or the JWT secret.
pub struct LocalStack {
    url: String,
    service_key: String,
    anon_key: String,
    api_keys: ApiKeys,
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
            .field("secret_key", &"<redacted>")
            .field("publishable_key", &"<redacted>")
            .field("jwt_secret", &"<redacted>")
            .field("keeps_database", &self.keep_database)
            .field("max_rows", &self.config.max_rows)
            .field("database", &self.db_name)
            .field("admin_url", &redacted(&self.admin_url))
            .finish_non_exhaustive()
    }
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
        for queue in config.queues.iter().flatten() {
            super::queues::check_queue_name(queue)?;
        }
        let admin_url = Url::parse(&config.database_url)
            .map_err(|e| LocalError::Config(format!("DATABASE_URL is not a URL: {e}")))?;
        let admin_url = without_loopback_tls(admin_url);
        let database_error = |source| LocalError::Database { url: redacted(&admin_url), source };

        let mut admin =
            while_slots_are_full(|| PgConnection::connect(admin_url.as_str())).await.map_err(database_error)?;
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
            open_named_database(
                &mut admin,
                &admin_url,
                MigrationSet::of(config.layout),
                &db_name,
                config.reset_database,
            )
            .await?;
        } else {
            create_from_template(&mut admin, &admin_url, MigrationSet::of(config.layout), &db_name).await?;
        }

        let mut db_url = admin_url.clone();
        db_url.set_path(&format!("/{db_name}"));
        let picked_port = config.port == 0;
        let stack_result = async {
            let stack_error = |source| LocalError::Database { url: redacted(&db_url), source };
            let keeper_options = sqlx::postgres::PgConnectOptions::from_str(db_url.as_str())
                .map_err(stack_error)?
                .application_name(KEEPER_APPLICATION_NAME);
            let keeper =
                while_slots_are_full(|| PgConnection::connect_with(&keeper_options)).await.map_err(stack_error)?;
            let db = while_slots_are_full(|| PgPool::connect(db_url.as_str())).await.map_err(stack_error)?;
            apply_cluster_wide_migrations(&db).await?;
            // The plane's row cap is the server's db-max-rows, as a
            // deployment sets it (docs/deploying.md).
            sqlx::query("update agent.idempotency_settings set max_rows = $1")
                .bind(i32::try_from(config.max_rows).unwrap_or(i32::MAX))
                .execute(&db)
                .await
                .map_err(stack_error)?;
            if let Some(queues) = &config.queues {
                super::queues::install(&db, &db_url, queues).await?;
            }
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
        let api_keys = ApiKeys::for_jwt_secret(&jwt_secret);
        tracing::info!(url = %format!("http://{address}"), database = %db_name, kept = keep_database, "local plane up");
        Ok(LocalStack {
            url: format!("http://{address}"),
            service_key,
            anon_key,
            api_keys,
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
    /// API answers beneath [`SUPABASE_REST_PATH`](super::SUPABASE_REST_PATH).
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

    /// The project's secret key, `sb_secret_…`, as hosted Supabase hands
    /// one out: understood beneath [`SUPABASE_REST_PATH`](super::SUPABASE_REST_PATH)
    /// only (Supabase's gateway), where it is the `service_role`, sent in
    /// `apikey`. The Supabase CLI's with
    /// [`SUPABASE_CLI_JWT_SECRET`](super::SUPABASE_CLI_JWT_SECRET), else one
    /// derived from the JWT secret.
    pub fn secret_key(&self) -> &str {
        &self.api_keys.secret
    }

    /// The project's publishable key, `sb_publishable_…`: the `anon` role
    /// beneath [`SUPABASE_REST_PATH`](super::SUPABASE_REST_PATH).
    pub fn publishable_key(&self) -> &str {
        &self.api_keys.publishable
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
        let mut admin = while_slots_are_full(|| PgConnection::connect(self.admin_url.as_str()))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::local::database::aged_name;

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
}
