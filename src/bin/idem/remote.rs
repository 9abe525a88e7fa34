//! The plane an operator command talks to: the one the environment names.

use idempotency_plane::{ClientConfig, PostgrestClient};

use crate::BoxError;

/// The configuration `IDEM_POSTGREST_URL` / `SUPABASE_URL` and the service
/// key name (`ClientConfig::from_env`); an error saying what to set when
/// none is named.
pub(crate) fn config() -> Result<ClientConfig, BoxError> {
    Ok(ClientConfig::from_env()?.ok_or(
        "no plane configured: set IDEM_POSTGREST_URL (or SUPABASE_URL) and a service key: IDEM_SERVICE_KEY, \
         SUPABASE_SECRET_KEY (sb_secret_…) or SUPABASE_SERVICE_ROLE_KEY; `idem up` prints both for a local one",
    )?)
}

/// The client of the plane the environment names.
/// Operator commands never start a local stack: they act on a deployment.
pub(crate) fn client() -> Result<PostgrestClient, BoxError> {
    Ok(PostgrestClient::new(config()?)?)
}
