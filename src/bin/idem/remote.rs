//! The plane an operator command talks to: the one `--url`/`--service-key` or the
//! environment names.

use idempotency_plane::{ClientConfig, PostgrestClient};

use crate::exit::usage_error;
use crate::BoxError;

/// Where an operator command acts: `--url` and `--service-key` win over the
/// environment, which they otherwise default to.
#[derive(Debug, Clone, Default, clap::Args)]
pub(crate) struct Target {
    /// The plane's PostgREST root (`http://host:3000`, or Supabase's
    /// `https://<ref>.supabase.co/rest/v1`). Default: IDEM_POSTGREST_URL,
    /// else SUPABASE_URL with /rest/v1 added.
    #[arg(long, value_name = "URL")]
    url: Option<String>,
    /// The service key. Default: the first set of IDEM_SERVICE_KEY,
    /// SUPABASE_SECRET_KEY, SUPABASE_SERVICE_ROLE_KEY. Prefer the
    /// environment: a flag shows in the process list. IDEM_MAX_ROWS (default
    /// 1000) is the server's row cap.
    /// (`--key` is the idempotency key in `get` and `claim`.)
    #[arg(long, value_name = "KEY")]
    service_key: Option<String>,
}

/// The configuration `--url`/`--service-key` and the environment name; a usage
/// error (exit 2) saying what to set when none is named or it is unusable.
pub(crate) fn config(target: &Target) -> Result<ClientConfig, BoxError> {
    let var = |name: &str| match name {
        "IDEM_POSTGREST_URL" if target.url.is_some() => target.url.clone(),
        "IDEM_SERVICE_KEY" if target.service_key.is_some() => target.service_key.clone(),
        _ => std::env::var(name).ok(),
    };
    let config = ClientConfig::from_vars(var).map_err(usage_error)?;
    config.ok_or_else(|| {
        usage_error(
            "no plane configured: pass --url and --service-key, or set IDEM_POSTGREST_URL (or SUPABASE_URL) and a \
             service key: IDEM_SERVICE_KEY, SUPABASE_SECRET_KEY (sb_secret_…) or SUPABASE_SERVICE_ROLE_KEY; \
             `idem up` prints both for a local one",
        )
    })
}

/// The client of the plane `target` names.
/// Operator commands never start a local stack: they act on a deployment.
pub(crate) fn client(target: &Target) -> Result<PostgrestClient, BoxError> {
    PostgrestClient::new(config(target)?).map_err(usage_error)
}
