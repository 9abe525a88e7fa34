//! The plane an operator command talks to: the one the environment names.

use idempotency_plane::{ClientConfig, PostgrestClient};

use crate::BoxError;

/// The client `IDEM_POSTGREST_URL` / `SUPABASE_URL` and the service key name.
/// Operator commands never start a local stack: they act on a deployment.
pub(crate) fn client() -> Result<PostgrestClient, BoxError> {
    let config = ClientConfig::from_env()?.ok_or(
        "no plane configured: set IDEM_POSTGREST_URL (or SUPABASE_URL) and IDEM_SERVICE_KEY \
         (or SUPABASE_SERVICE_ROLE_KEY); `idem up` prints both for a local one",
    )?;
    Ok(PostgrestClient::new(config)?)
}
