//! How to start a [`LocalStack`](super::LocalStack): the cluster, the
//! server's limits and port, the JWT secret, the database to serve.

use url::Url;

use super::authenticator::AUTHENTICATOR_PASSWORD_VAR;
use super::cluster::redacted;
use super::database_name::DatabaseName;
use crate::migrations::Layout;

/// The maintenance database used when `DATABASE_URL` is unset.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// How to start a [`LocalStack`](super::LocalStack). `Debug` never prints the JWT secret or
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
    /// random secret per start, and keys ([`LocalStack::service_key`](super::LocalStack::service_key),
    /// [`LocalStack::anon_key`](super::LocalStack::anon_key)) valid for 7 days that no other start
    /// accepts.
    pub jwt_secret: Option<String>,
    /// A database kept across starts ([`with_database`](Self::with_database));
    /// `None`, the default: a throwaway database, dropped on stop.
    pub database: Option<DatabaseName>,
    /// With [`database`](Self::database): drop and recreate it first
    /// ([`with_reset`](Self::with_reset)). Default false.
    pub reset_database: bool,
    /// How the claim table is laid out ([`with_layout`](Self::with_layout)).
    /// Default [`Layout::Single`]; `idem up` and the tests read
    /// [`Layout::from_env`] (`IDEM_LAYOUT`).
    pub layout: Layout,
    /// The password the server logs in to the cluster with, as
    /// `authenticator` (it never serves as `database_url`'s user). `None`:
    /// none, for a cluster that lets `authenticator` in from loopback
    /// without one. Default: [`AUTHENTICATOR_PASSWORD_VAR`] when set.
    pub authenticator_password: Option<String>,
    /// Host names the server answers beyond loopback's (`127.0.0.1`,
    /// `localhost`, `[::1]`), with or without a port
    /// ([`with_allowed_host`](Self::with_allowed_host)). Default none: a
    /// request whose `Host` names anything else is refused, so a web page
    /// cannot reach the server through a name that resolves to loopback (DNS
    /// rebinding).
    pub allowed_hosts: Vec<String>,
    /// Browser origins the server sends CORS headers for
    /// ([`with_cors_origin`](Self::with_cors_origin)). Default none: no
    /// CORS headers at all, so no web page may read an answer.
    pub cors_origins: Vec<String>,
    /// Supabase Queues ([`with_queues`](Self::with_queues)): `None`, the
    /// default, installs nothing; `Some(names)` installs pgmq and its
    /// `pgmq_public` wrappers, serves that schema too, and creates the
    /// queues named.
    pub queues: Option<Vec<String>>,
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
            .field("layout", &self.layout)
            .field("authenticator_password", &self.authenticator_password.as_ref().map(|_| "<redacted>"))
            .field("allowed_hosts", &self.allowed_hosts)
            .field("cors_origins", &self.cors_origins)
            .field("queues", &self.queues)
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
            layout: Layout::Single,
            authenticator_password: std::env::var(AUTHENTICATOR_PASSWORD_VAR).ok().filter(|v| !v.is_empty()),
            allowed_hosts: Vec::new(),
            cors_origins: Vec::new(),
            queues: None,
        }
    }
}

impl LocalStackConfig {
    /// Sets the server's `db-max-rows`, and the plane's row cap
    /// (`agent.idempotency_settings.max_rows`, 1 to 100000) to match.
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
    /// minimum; [`LocalStack::start`](super::LocalStack::start) refuses a shorter one) instead of a
    /// random secret, and hands out *stable* keys: [`mint_stable_token`](super::mint_stable_token)'s,
    /// the same strings on every start with this secret, valid until
    /// [`STABLE_KEY_EXPIRES_AT`](super::STABLE_KEY_EXPIRES_AT) (2032), so a key written down once keeps
    /// working across restarts. With [`SUPABASE_CLI_JWT_SECRET`](super::SUPABASE_CLI_JWT_SECRET) they are the
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
    /// absent, reused when present, never dropped by [`LocalStack::stop`](super::LocalStack::stop)
    /// (nor by the clean-up of stale throwaway databases, whose prefix its
    /// name cannot carry). The database records which migration set it was
    /// built from (`COMMENT ON DATABASE`); a start refuses one built from
    /// another set ([`LocalError::DatabaseOutdated`](super::LocalError::DatabaseOutdated)) unless
    /// [`with_reset`](Self::with_reset), and always refuses one it did not
    /// create ([`LocalError::DatabaseNotOurs`](super::LocalError::DatabaseNotOurs)).
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

    /// Logs the server in as `authenticator` with `password`, for a cluster
    /// that asks for one (set it as the superuser: `ALTER ROLE
    /// authenticator LOGIN PASSWORD '…'`).
    pub fn with_authenticator_password(mut self, password: impl Into<String>) -> Self {
        self.authenticator_password = Some(password.into());
        self
    }

    /// Also answers requests whose `Host` is `host` (a name, or `name:port`),
    /// for a server reached through a name of this machine's own.
    pub fn with_allowed_host(mut self, host: impl Into<String>) -> Self {
        self.allowed_hosts.push(host.into());
        self
    }

    /// Sends CORS headers to `origin` (`http://localhost:5173`, say), so a
    /// page served from there may call the server. Only the origins given
    /// ever get them.
    pub fn with_cors_origin(mut self, origin: impl Into<String>) -> Self {
        self.cors_origins.push(origin.into());
        self
    }

    /// Installs Supabase Queues: pgmq's own SQL (from the `pgmq` crate) and
    /// the `pgmq_public` wrappers Supabase's Data API serves, which the
    /// server then exposes too; and creates each queue of `queues` that
    /// does not exist (pgmq names: a-z, 0-9, `_`). Safe on a kept database.
    pub fn with_queues(mut self, queues: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.queues = Some(queues.into_iter().map(Into::into).collect());
        self
    }

    /// Lays the claim table out as `layout`. A named database built in
    /// another layout is refused as built from another migration set.
    pub fn with_layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_prints_the_jwt_secret_or_a_password() {
        let config = LocalStackConfig {
            database_url: "postgres://u:hunter2@127.0.0.1/postgres".into(),
            ..LocalStackConfig::default()
        }
        .with_jwt_secret("a-secret-of-at-least-thirty-two-bytes-long")
        .with_authenticator_password("swordfish");
        let printed = format!("{config:?}");
        assert!(
            !printed.contains("hunter2") && !printed.contains("a-secret-of") && !printed.contains("swordfish"),
            "{printed}"
        );
        assert!(printed.contains("jwt_secret: Some(\"<redacted>\")"), "{printed}");
    }
}
