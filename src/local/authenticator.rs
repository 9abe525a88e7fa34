//! The login the local server serves as: `authenticator`, as PostgREST and
//! Supabase log in, never the cluster's superuser.
//!
//! The server switches to the role a request's token names, and the local
//! stack may sign with a public secret ([`SUPABASE_CLI_JWT_SECRET`](super::SUPABASE_CLI_JWT_SECRET)):
//! whoever reaches its port can mint any role's token. Logged in as a role
//! that is, or may become, a superuser, such a token would read and write
//! the plane's tables directly. So the server logs in as `authenticator`
//! only, which the migrations make a member of `anon`, `authenticated` and
//! `service_role` and nothing else, and a start refuses (with the fix in
//! the error) a cluster where that login fails or where `authenticator` is
//! or may become a superuser.

use sqlx::{Connection, PgConnection};
use url::Url;

use super::cluster::{redacted, sqlstate};
use super::error::LocalError;

/// The role the server logs in as.
pub const AUTHENTICATOR: &str = "authenticator";

/// The environment variable [`LocalStackConfig`](super::LocalStackConfig)
/// reads `authenticator`'s password from, for a cluster that asks for one.
pub const AUTHENTICATOR_PASSWORD_VAR: &str = "IDEM_AUTHENTICATOR_PASSWORD";

/// `db_url` (the stack's database, reached with the admin credentials) with
/// `authenticator`'s credentials instead.
pub(super) fn authenticator_url(db_url: &Url, password: Option<&str>) -> Url {
    let mut url = db_url.clone();
    // A postgres: URL with a host always takes credentials.
    let _ = url.set_username(AUTHENTICATOR);
    let _ = url.set_password(password);
    url
}

/// Logs in as `authenticator` at `url` and checks it is safe to serve as:
/// neither a superuser nor a member of one (a member may `SET ROLE` to it).
/// The refusals name the fix.
pub(super) async fn check_login(url: &Url, password_given: bool) -> Result<(), LocalError> {
    let mut login = super::cluster::while_slots_are_full(|| PgConnection::connect(url.as_str())).await.map_err(|error| {
        let code = sqlstate(&error);
        let fix = if password_given {
            format!(
                "check the password in {AUTHENTICATOR_PASSWORD_VAR} (ALTER ROLE {AUTHENTICATOR} LOGIN PASSWORD '…' sets it)"
            )
        } else {
            format!(
                "this cluster asks {AUTHENTICATOR} for a password: set one as its superuser \
                 (ALTER ROLE {AUTHENTICATOR} LOGIN PASSWORD 'choose-one') and pass it in \
                 {AUTHENTICATOR_PASSWORD_VAR}, or let {AUTHENTICATOR} log in from 127.0.0.1 without one \
                 (a `host all {AUTHENTICATOR} 127.0.0.1/32 trust` line in pg_hba.conf)"
            )
        };
        LocalError::Authenticator(format!(
            "the local server logs in as {AUTHENTICATOR} (never as the superuser of DATABASE_URL), \
             and {} refused that login{}: {error}; {fix}",
            redacted(url),
            code.map(|code| format!(" ({code})")).unwrap_or_default(),
        ))
    })?;
    let superusers: Option<String> = sqlx::query_scalar(
        "select string_agg(r.rolname::text, ', ' order by r.rolname)
           from pg_catalog.pg_roles r
          where r.rolsuper and pg_catalog.pg_has_role(current_user, r.oid, 'MEMBER')",
    )
    .fetch_one(&mut login)
    .await
    .map_err(|source| LocalError::Database { url: redacted(url), source })?;
    let _ = login.close().await;
    match superusers {
        None => Ok(()),
        Some(roles) => Err(LocalError::Authenticator(format!(
            "{AUTHENTICATOR} is, or may switch to, a superuser ({roles}): a token naming that role would \
             bypass the plane's functions. Serve with an {AUTHENTICATOR} that is NOSUPERUSER and a member of \
             anon, authenticated and service_role only (REVOKE the superuser role FROM {AUTHENTICATOR})"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_login_keeps_the_database_and_host_and_swaps_the_credentials() {
        let db = Url::parse("postgres://postgres:hunter2@127.0.0.1:5432/idem_local_x?sslmode=disable").unwrap();
        let without = authenticator_url(&db, None);
        assert_eq!(without.as_str(), "postgres://authenticator@127.0.0.1:5432/idem_local_x?sslmode=disable");
        let with = authenticator_url(&db, Some("p@ss word"));
        assert_eq!((with.username(), with.password()), ("authenticator", Some("p%40ss%20word")));
        assert_eq!(with.path(), "/idem_local_x");
    }
}
