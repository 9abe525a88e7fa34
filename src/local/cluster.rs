//! The PostgreSQL cluster the stack creates its databases on, as seen from
//! its maintenance database: the connection URL (without TLS on loopback,
//! printed without its password), quoting, the catalog look-ups and
//! drops the other parts share, and connecting while its slots are full.

use std::time::Duration;

use sqlx::{AssertSqlSafe, Executor, PgConnection};
use url::Url;

/// `url` with `sslmode=disable` added when it names a loopback host and
/// asks for no TLS mode itself (nor does `PGSSLMODE`): TLS on loopback
/// protects nothing, and its handshakes and record encryption were most of
/// the CPU a stack's connections cost in a debug build. A mode the URL or the
/// environment asks for is kept.
pub(super) fn without_loopback_tls(mut url: Url) -> Url {
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

pub(super) fn redacted(url: &Url) -> String {
    let mut url = url.clone();
    if url.password().is_some() {
        let _ = url.set_password(Some("_"));
    }
    url.to_string()
}

/// The SQLSTATE of a database error.
pub(super) fn sqlstate(error: &sqlx::Error) -> Option<String> {
    error.as_database_error().and_then(|e| e.code()).map(|code| code.into_owned())
}

pub(super) async fn database_exists(admin: &mut PgConnection, name: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("select exists (select 1 from pg_catalog.pg_database where datname = $1)")
        .bind(name)
        .fetch_one(&mut *admin)
        .await
}

pub(super) async fn drop_database(admin: &mut PgConnection, name: &str) -> Result<(), sqlx::Error> {
    admin
        .execute(AssertSqlSafe(format!("drop database if exists {} with (force)", quote_ident(name))))
        .await
        .map(|_| ())
}

/// `name` as a quoted SQL identifier: in double quotes, each one inside
/// doubled. The names quoted here are ours or [`DatabaseName`](super::DatabaseName)s, which hold
/// no quote at all; the quoting holds whatever they hold.
pub(super) fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// `text` as a quoted SQL string literal (standard_conforming_strings, on
/// since PostgreSQL 9.1: a backslash is an ordinary character).
pub(super) fn quote_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// Connects to the maintenance database the stack would use.
/// How long a start waits for a connection slot of a cluster that has none
/// free: a cluster shared by several stacks (a test suite's, a developer's)
/// runs out for a moment when they all start at once.
const SLOT_WAIT: Duration = Duration::from_secs(20);

/// `connect`, asked again every 250 ms for up to [`SLOT_WAIT`] while the
/// cluster answers that every connection slot is taken (53300, `too many
/// clients already`); any other error at once.
pub(super) async fn while_slots_are_full<T, F, Fut>(mut connect: F) -> Result<T, sqlx::Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, sqlx::Error>>,
{
    let until = tokio::time::Instant::now() + SLOT_WAIT;
    let mut warned = false;
    loop {
        match connect().await {
            Err(sqlx::Error::Database(error))
                if error.code().as_deref() == Some("53300") && tokio::time::Instant::now() < until =>
            {
                if !warned {
                    // 53300 is also a role's or a database's connection limit,
                    // which waiting does not lift: the wait is bounded, and said.
                    tracing::warn!(error = %error, wait = ?SLOT_WAIT, "no free connection slot; asking again");
                    warned = true;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            other => return other,
        }
    }
}

#[cfg(test)]
pub(super) async fn admin() -> (PgConnection, Url) {
    use sqlx::Connection;

    let url = without_loopback_tls(
        Url::parse(&super::config::LocalStackConfig::default().database_url).expect("DATABASE_URL"),
    );
    (PgConnection::connect(url.as_str()).await.expect("connect to PostgreSQL"), url)
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
