//! The local stack's own doors, as a hostile page or a careless operator
//! meets them: the server logs in as `authenticator` only (never the
//! cluster's superuser, even where `authenticator` needs a password it was
//! not given), accepts tokens of the API roles only, answers loopback hosts
//! only, and sends no CORS headers unless origins were configured.

use idempotency_plane::local::{LocalError, LocalStack, LocalStackConfig};
use idempotency_plane::{Completion, Ending};
use reqwest::header::{HeaderMap, ACCESS_CONTROL_ALLOW_ORIGIN};
use serde_json::{json, Value};
use sqlx::{Connection, PgConnection};

use crate::support::cluster::{server_binaries_missing, Cluster};
use crate::support::harness::*;

/// `POST /rpc/idempotency_get` with `token` and extra `headers`: the status,
/// the headers and the body.
async fn get_with(url: &str, token: &str, headers: &[(&str, &str)]) -> (u16, HeaderMap, Value) {
    let mut request = reqwest::Client::new()
        .post(format!("{url}/rpc/idempotency_get"))
        .bearer_auth(token)
        .header("Content-Profile", "agent")
        .header("Accept-Profile", "agent")
        .json(&json!({"p_organization_id": org(), "p_scope": "tool.email.send", "p_key": "k"}));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let answer = request.send().await.expect("the server answers");
    let (status, headers) = (answer.status().as_u16(), answer.headers().clone());
    (status, headers, answer.json().await.unwrap_or(Value::Null))
}

/// The official postgres image and Debian's default TCP rule ask every
/// login for a password. A stack there used to fall back to `DATABASE_URL`'s
/// superuser, and then any token minted with the public local secret could
/// name `postgres` and write the claim table directly. Now the start fails
/// and says how to fix it; given `authenticator`'s password it serves as
/// `authenticator`; and an `authenticator` that may become a superuser is
/// refused.
#[tokio::test]
async fn on_a_cluster_that_asks_for_passwords_the_server_serves_as_authenticator_or_not_at_all() {
    let test = "on_a_cluster_that_asks_for_passwords_the_server_serves_as_authenticator_or_not_at_all";
    if server_binaries_missing(test) {
        return;
    }
    let cluster = Cluster::start_with_passwords("passwords", "superpass");
    let admin_url = format!("postgres://postgres:superpass@127.0.0.1:{}/postgres", cluster.port());
    let config = LocalStackConfig {
        database_url: admin_url.clone(),
        authenticator_password: None,
        pool_size: 4,
        ..LocalStackConfig::default()
    };

    let refused = LocalStack::start(config.clone()).await.expect_err("no login for authenticator, no server");
    let message = refused.to_string();
    assert!(matches!(refused, LocalError::Authenticator(_)), "{refused:?}");
    for fix in ["IDEM_AUTHENTICATOR_PASSWORD", "ALTER ROLE authenticator LOGIN PASSWORD", "pg_hba.conf"] {
        assert!(message.contains(fix), "the refusal names the fix ({fix}): {message}");
    }
    assert!(!message.contains("superpass"), "{message}");
    let mut admin = PgConnection::connect(&admin_url).await.expect("the superuser logs in with its password");
    let leftovers: i64 = sqlx::query_scalar("select count(*) from pg_database where datname like 'idem_local_%'")
        .fetch_one(&mut admin)
        .await
        .unwrap();
    assert_eq!(leftovers, 0, "a refused start leaves no database behind");

    // Its superuser gives authenticator a password; the stack is given it.
    sqlx::query("alter role authenticator login password 'authpass'").execute(&mut admin).await.unwrap();
    let wrong =
        LocalStack::start(config.clone().with_authenticator_password("nope")).await.expect_err("a bad password");
    assert!(matches!(&wrong, LocalError::Authenticator(m) if m.contains("28P01")), "{wrong:?}");
    let stack = LocalStack::start(config.clone().with_authenticator_password("authpass")).await.expect("it serves");
    let service = service(&stack);
    let claim = claimed(service.claim(org(), "tool.email.send", "k", &hash("x"), LEASE).await);
    assert_eq!(service.complete(&claim, Completion::response(json!("sent"))).await.unwrap(), Ending::Recorded);
    let logins: Vec<String> = sqlx::query_scalar(
        "select distinct usename::text from pg_stat_activity
          where datname = current_database() and backend_type = 'client backend'
            and usename <> 'postgres'",
    )
    .fetch_all(stack.db())
    .await
    .unwrap();
    assert_eq!(logins, ["authenticator"], "the server's sessions are authenticator's");

    // A token naming the superuser, signed with the server's own secret.
    let forged = stack.token_for("postgres");
    let (status, _, body) = get_with(stack.url(), &forged, &[]).await;
    assert_eq!((status, body["code"].as_str()), (401, Some("PGRST301")), "{body}");
    let table = reqwest::Client::new()
        .get(format!("{}/idempotency_keys", stack.url()))
        .bearer_auth(&forged)
        .header("Accept-Profile", "agent")
        .send()
        .await
        .unwrap();
    assert_eq!(table.status().as_u16(), 401, "the table is out of reach: {:?}", table.text().await);
    stack.stop().await.unwrap();

    // An authenticator that may switch to a superuser is refused outright.
    sqlx::query("grant postgres to authenticator").execute(&mut admin).await.unwrap();
    let unsafe_login = LocalStack::start(config.with_authenticator_password("authpass")).await.expect_err("refused");
    assert!(
        matches!(&unsafe_login, LocalError::Authenticator(m) if m.contains("superuser (postgres)")),
        "{unsafe_login:?}"
    );
}

/// On the machine's own cluster (trust for authenticator) as anywhere: a
/// token naming any role but the three API roles is refused before the
/// server switches to it, and the three still pass.
#[tokio::test]
async fn a_token_for_a_role_other_than_the_api_roles_is_refused() {
    let stack = stack().await;
    for role in ["postgres", "authenticator", "idempotency_owner", "pg_read_all_data"] {
        let (status, _, body) = get_with(stack.url(), &stack.token_for(role), &[]).await;
        assert_eq!((status, body["code"].as_str()), (401, Some("PGRST301")), "{role}: {body}");
    }
    let (status, _, body) = get_with(stack.url(), stack.service_key(), &[]).await;
    assert_eq!(status, 200, "{body}");
    let (status, _, body) = get_with(stack.url(), stack.anon_key(), &[]).await;
    assert_eq!((status, body["code"].as_str()), (401, Some("42501")), "anon reaches the server, not the plane");
    stack.stop().await.unwrap();
}

/// A page that learns the port cannot drive the server: a name of its own
/// that resolves to 127.0.0.1 (DNS rebinding) is refused, and no answer
/// carries a CORS header a browser would let it read; an origin the
/// operator names gets them.
#[tokio::test]
async fn only_loopback_hosts_are_answered_and_cors_is_off_unless_an_origin_is_named() {
    let stack = stack().await;
    let port = stack.url().rsplit(':').next().expect("a port").to_owned();
    let key = stack.service_key();
    for host in ["127.0.0.1", "localhost", "[::1]"] {
        let (status, _, body) = get_with(stack.url(), key, &[("Host", &format!("{host}:{port}"))]).await;
        assert_eq!(status, 200, "{host}: {body}");
    }
    for host in ["attacker.example", "127.0.0.1.nip.io", "localhost.attacker.example"] {
        let (status, _, body) = get_with(stack.url(), key, &[("Host", &format!("{host}:{port}"))]).await;
        assert_eq!((status, body["code"].as_str()), (403, Some("IDEMHOST")), "{host}: {body}");
    }

    let page = "http://attacker.example";
    let (status, headers, _) = get_with(stack.url(), key, &[("Origin", page)]).await;
    assert_eq!(status, 200);
    assert!(headers.keys().all(|name| !name.as_str().starts_with("access-control-")), "{headers:?}");
    let preflight = reqwest::Client::new()
        .request(reqwest::Method::OPTIONS, format!("{}/rpc/idempotency_get", stack.url()))
        .header("Origin", page)
        .header("Access-Control-Request-Method", "POST")
        .header("Access-Control-Request-Headers", "authorization,content-type")
        .send()
        .await
        .unwrap();
    assert!(preflight.headers().get(ACCESS_CONTROL_ALLOW_ORIGIN).is_none(), "{:?}", preflight.headers());
    stack.stop().await.unwrap();

    let dev = "http://localhost:5173";
    let stack = stack_with(LocalStackConfig::default().with_cors_origin(dev)).await;
    let (_, headers, _) = get_with(stack.url(), stack.service_key(), &[("Origin", dev)]).await;
    assert_eq!(headers.get(ACCESS_CONTROL_ALLOW_ORIGIN).and_then(|v| v.to_str().ok()), Some(dev));
    let (_, headers, _) = get_with(stack.url(), stack.service_key(), &[("Origin", page)]).await;
    assert!(headers.get(ACCESS_CONTROL_ALLOW_ORIGIN).is_none(), "{headers:?}");
    stack.stop().await.unwrap();
}
