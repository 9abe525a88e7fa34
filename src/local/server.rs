//! The in-process PostgREST-compatible server (`postrust-server` in
//! compatibility mode): its configuration, the schemas it exposes, its
//! router at the root and beneath [`SUPABASE_REST_PATH`], and serving it.

use std::sync::OnceLock;
use std::time::Duration;

use axum::response::IntoResponse;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use url::Url;

use super::api_keys::{behind_gateway, ApiKeys};
use super::authenticator::{authenticator_url, check_login};
use super::cluster::redacted;
use super::config::LocalStackConfig;
use super::error::LocalError;
use super::guard;

/// Where Supabase serves PostgREST beneath a project's URL: supabase-js
/// calls `<SUPABASE_URL>/rest/v1/rpc/...`. The local server answers there
/// exactly as at its root.
pub const SUPABASE_REST_PATH: &str = "/rest/v1";

/// The Supabase CLI's configuration of this project, embedded: the schemas
/// the local server exposes are read from its `[api] schemas`, so the two
/// cannot drift.
const SUPABASE_CONFIG_TOML: &str = include_str!("../../supabase/config.toml");

/// Rounds of trying to build the server (each with both logins) before
/// [`LocalStack::start`](super::LocalStack::start) or
/// [`LocalStack::restart_server`](super::LocalStack::restart_server) gives up.
const SERVER_BUILD_ROUNDS: u32 = 4;

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

/// The server's router at its root (plain PostgREST) and again beneath
/// [`SUPABASE_REST_PATH`] behind Supabase's gateway ([`api_keys`](super::api_keys)):
/// the nested copy sees the path with the prefix taken off, so every route,
/// layer and header answers there as at the root once the gateway let the
/// request in.
fn with_supabase_path(router: axum::Router, keys: ApiKeys) -> axum::Router {
    axum::Router::new().nest_service(SUPABASE_REST_PATH, behind_gateway(router.clone(), keys)).fallback_service(router)
}

/// `router`, each request run to its end in a task of its own, as PostgREST
/// runs it: a client that hangs up (a worker stopped mid-call) does not
/// cancel the database work its request started. Cancelling it would be
/// worse than wasteful: sqlx 0.9.0 hands a connection back to the pool
/// still inside a transaction when the request is dropped while its `BEGIN`
/// is on the wire (sqlx issue 4385), and the next request on that
/// connection then runs in the old transaction, with its stale `now()`.
fn run_to_completion(router: axum::Router) -> axum::Router {
    router.layer(axum::middleware::from_fn(|request: axum::extract::Request, next: axum::middleware::Next| async {
        match tokio::spawn(next.run(request)).await {
            Ok(response) => response,
            Err(error) => {
                tracing::error!(%error, "local server: a request's task failed");
                axum::http::StatusCode::INTERNAL_SERVER_ERROR.into_response()
            }
        }
    }))
}

/// Serves `router` on `listener` until the returned sender fires.
pub(super) fn serve(listener: tokio::net::TcpListener, router: axum::Router) -> (oneshot::Sender<()>, JoinHandle<()>) {
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

/// Builds the server's router, logged in as `authenticator` only (see
/// [`authenticator`](super::authenticator): never the admin credentials,
/// which could serve a token naming a superuser), behind the
/// [`guard`](super::guard). A build that fails (its schema cache load cut
/// off by a `statement_timeout` on a busy machine, say) is tried again a few
/// times, as PostgREST retries loading its schema cache.
pub(super) async fn build_router(
    config: &LocalStackConfig,
    db_url: &Url,
    jwt_secret: &str,
) -> Result<axum::Router, LocalError> {
    let password = config.authenticator_password.as_deref();
    let login = authenticator_url(db_url, password);
    check_login(&login, password.is_some()).await?;

    let mut last_error = String::new();
    for round in 0..SERVER_BUILD_ROUNDS {
        if round > 0 {
            tokio::time::sleep(Duration::from_millis(100 << round)).await;
        }
        let mut server_config = postrust_core::AppConfig::default();
        server_config.db_uri = login.to_string();
        server_config.db_schemas = exposed_schemas()?.to_vec();
        if config.queues.is_some() {
            server_config.db_schemas.push(super::queues::QUEUES_SCHEMA.to_owned());
        }
        server_config.db_anon_role = Some("anon".into());
        server_config.db_pool_size = config.pool_size;
        server_config.db_max_rows = Some(i64::from(config.max_rows));
        server_config.jwt_secret = Some(jwt_secret.to_owned());
        server_config.compat_mode = true;
        server_config.server_host = "127.0.0.1".into();
        server_config.server_port = config.port;
        server_config.server_cors_origins = config.cors_origins.clone();
        match postrust_server::build(server_config, postrust_server::Host::SERVER).await {
            Ok(app) => {
                let keys = ApiKeys::for_jwt_secret(jwt_secret);
                return Ok(run_to_completion(guard::guarded(with_supabase_path(app.router, keys), config)));
            }
            Err(error) => {
                tracing::debug!(uri = %redacted(&login), %error, round, "local server could not start");
                last_error = format!("{error:#}");
            }
        }
    }
    Err(LocalError::Server(last_error))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::postgrest::ClientConfig;

    #[test]
    fn the_exposed_schemas_are_supabase_config_tomls_with_public_first() {
        let schemas = exposed_schemas().expect("the embedded config.toml parses");
        assert_eq!(schemas, ["public", "graphql_public", "agent"]);
        // The client's schema is exposed, but only when named.
        let client = ClientConfig::new("http://localhost", "k").expect("a config").schema;
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
}
