//! Which plane the demo talks to: the embedded stack, or (with `--remote`)
//! the deployment the environment names.

use idempotency_plane::local::{LocalError, LocalStack, LocalStackConfig};
use idempotency_plane::migrations::{Layout, LAYOUT_VAR};
use idempotency_plane::{ClientConfig, IdempotencyService, PostgrestClient, PostgrestRepository};

use crate::{exit, BoxError};

/// Starts the embedded stack for `up`, `demo` and `bench`, in the layout
/// `IDEM_LAYOUT` names (`single`, the default, or `partitioned`). A
/// configuration it refuses before creating anything (a `DATABASE_URL` that
/// is not a URL, a database name it may not use, an unknown layout) is a
/// usage error, exit 2; a PostgreSQL that cannot be reached is a failure,
/// exit 1.
pub(crate) async fn start_local(config: LocalStackConfig) -> Result<LocalStack, BoxError> {
    let layout = Layout::from_env().map_err(|error| exit::usage_error(format!("{LAYOUT_VAR}: {error}")))?;
    LocalStack::start(config.with_layout(layout)).await.map_err(|error| match error {
        LocalError::Config(_) | LocalError::DatabaseName(_) => exit::usage_error(error),
        other => other.into(),
    })
}

/// The service the demo drives.
pub(crate) type Service = IdempotencyService<PostgrestRepository>;

/// A plane to run against. A local one is torn down by [`Plane::shutdown`].
#[derive(Debug)]
pub(crate) enum Plane {
    /// The embedded stack: a fresh database behind an in-process server.
    Local(Box<LocalStack>),
    /// A deployment, named by the environment (`idem demo --remote`).
    Remote(Box<ClientConfig>),
}

impl Plane {
    /// A service over this plane, with its own connection pool.
    pub(crate) fn service(&self) -> Result<Service, BoxError> {
        match self {
            Plane::Local(stack) => Ok(stack.service()?),
            Plane::Remote(config) => {
                Ok(IdempotencyService::new(PostgrestRepository::new(PostgrestClient::new((**config).clone())?)))
            }
        }
    }

    /// One line saying where the plane is, without secrets.
    pub(crate) fn describe(&self) -> String {
        match self {
            Plane::Local(stack) => {
                format!("embedded local stack {} (database {}, dropped at the end)", stack.url(), stack.database_name())
            }
            Plane::Remote(config) => format!("configured server {}", config.redacted_url()),
        }
    }

    /// Stops a local stack and drops its database; nothing for a remote one.
    pub(crate) async fn shutdown(self) -> Result<(), BoxError> {
        match self {
            Plane::Local(stack) => Ok(stack.stop().await?),
            Plane::Remote(_) => Ok(()),
        }
    }
}
