//! One fresh local stack per test, and helpers for looking under it. Needs
//! feature `local`. The helpers every folder uses are re-exported from
//! [`crate::support`], so `use crate::support::harness::*` brings them too.

use std::time::Duration;

use idempotency_plane::local::{LocalStack, LocalStackConfig};
use idempotency_plane::migrations::Layout;
use idempotency_plane::{IdempotencyService, PostgrestRepository};
use uuid::Uuid;

pub use crate::support::{claimed, eventually, hash, org, within, LEASE, WAIT};

pub type Service = IdempotencyService<PostgrestRepository>;

pub async fn stack() -> LocalStack {
    stack_with(LocalStackConfig::default()).await
}

/// A stack started with `config`, in the layout `IDEM_LAYOUT` names (the
/// single table when unset), so the whole suite can run on either layout.
pub async fn stack_with(config: LocalStackConfig) -> LocalStack {
    let layout = Layout::from_env().unwrap_or_else(|error| panic!("{error}"));
    match LocalStack::start(config.with_layout(layout)).await {
        Ok(stack) => stack,
        Err(error) => panic!("the local stack did not start: {error}"),
    }
}

pub fn service(stack: &LocalStack) -> Service {
    stack.service().expect("a client for the local stack")
}

/// Rows of the claim table, by a superuser connection.
pub async fn count_rows(stack: &LocalStack) -> i64 {
    sqlx::query_scalar("select count(*) from agent.idempotency_keys").fetch_one(stack.db()).await.expect("count rows")
}

/// Moves a claim's lease into the past, as if `by` had passed.
pub async fn pass_lease(stack: &LocalStack, claim_id: Uuid) {
    sqlx::query(
        "update agent.idempotency_keys
            set lease_expires_at = now() - interval '1 second',
                claimed_at = claimed_at - (lease_expires_at - now()) - interval '1 second',
                redrive_at = case when redrive_at is not null then now() - interval '1 second' end
          where id = $1",
    )
    .bind(claim_id)
    .execute(stack.db())
    .await
    .expect("move the lease back");
}

/// Moves every timestamp of a claim `by` into the past.
pub async fn travel_back(stack: &LocalStack, claim_id: Uuid, by: Duration) {
    sqlx::query(
        "update agent.idempotency_keys
            set claimed_at = claimed_at - $2::interval,
                lease_expires_at = lease_expires_at - $2::interval,
                retain_until = retain_until - $2::interval,
                redrive_at = redrive_at - $2::interval
          where id = $1",
    )
    .bind(claim_id)
    .bind(format!("{} milliseconds", by.as_millis()))
    .execute(stack.db())
    .await
    .expect("move timestamps back");
}

/// Sets the plane's row cap (`agent.idempotency_settings.max_rows`), as an
/// operator would, e.g. to one that disagrees with the server's.
pub async fn set_plane_row_cap(stack: &LocalStack, cap: i32) {
    sqlx::query("update agent.idempotency_settings set max_rows = $1")
        .bind(cap)
        .execute(stack.db())
        .await
        .expect("set the plane's row cap");
}

/// A PostgREST client on the stack, with the service key.
pub fn client(stack: &LocalStack) -> idempotency_plane::PostgrestClient {
    idempotency_plane::PostgrestClient::new(stack.client_config().expect("config")).expect("client")
}

/// Rows of `agent.runs`.
pub async fn count_runs(stack: &LocalStack) -> i64 {
    sqlx::query_scalar("select count(*) from agent.runs").fetch_one(stack.db()).await.expect("count runs")
}

/// Puts `n` claims past their retention.
pub async fn expired_rows(stack: &idempotency_plane::local::LocalStack, n: i64) {
    sqlx::query(
        "insert into agent.idempotency_keys
           (organization_id, scope, key, request_hash, status, lease_token, response,
            claimed_at, lease_expires_at, retain_until)
         select gen_random_uuid(), 'tool.x', 'k' || i, repeat('a', 64), 'completed', gen_random_uuid(), '1',
                now() - interval '31 days', now() - interval '31 days', now() - interval '1 day' + i * interval '1 second'
           from generate_series(1, $1) i",
    )
    .bind(n)
    .execute(stack.db())
    .await
    .unwrap();
}

/// `lease_expires_at - claimed_at` of the only claim, in milliseconds.
pub async fn stored_lease_ms(stack: &LocalStack) -> f64 {
    sqlx::query_scalar(
        "select extract(epoch from lease_expires_at - claimed_at)::float8 * 1000 from agent.idempotency_keys",
    )
    .fetch_one(stack.db())
    .await
    .expect("the claim's lease")
}
