//! `agent.idempotency_sweep`, the sweep as one SQL call (for pg_cron), on the
//! real stack: one bounded pass of `idem sweep`, with its refusals.

use std::sync::{Arc, Mutex};

use idempotency_plane::postgrest::{codes, ClientError, Repeat};
use serde_json::{json, Value};
use sqlx::Executor;
use tracing::instrument::WithSubscriber;
use tracing_subscriber::layer::SubscriberExt;

use crate::support::harness::*;

/// The one row a sweep answers, through PostgREST as the service role.
async fn sweep(stack: &idempotency_plane::local::LocalStack, args: Value) -> Value {
    let mut rows: Vec<Value> =
        client(stack).rpc("idempotency_sweep", &args, Repeat::Safe).await.unwrap_or_else(|e| panic!("{args}: {e}"));
    assert_eq!(rows.len(), 1, "one row: {rows:?}");
    rows.remove(0)
}

/// Keys of the claims left, in order.
async fn keys(stack: &idempotency_plane::local::LocalStack) -> Vec<String> {
    sqlx::query_scalar("select key from agent.idempotency_keys order by key").fetch_all(stack.db()).await.unwrap()
}

#[tokio::test]
async fn a_sql_sweep_is_one_bounded_pass_oldest_first_that_keeps_what_retention_holds() {
    // Arrange: eight claims past retention (k1 the oldest), a live claim, and
    // one whose lease passed but whose retention holds.
    let stack = stack().await;
    expired_rows(&stack, 8).await;
    let service = service(&stack);
    claimed(service.claim(org(), "tool.email.send", "live", &hash("live"), LEASE).await);
    let passed = claimed(service.claim(org(), "tool.email.send", "passed", &hash("passed"), LEASE).await);
    pass_lease(&stack, passed.id()).await;

    // Act and assert: a pass of 5 reads the five oldest and fills its bound;
    // the next reads the other three and does not.
    let first = sweep(&stack, json!({"p_bound": 5})).await;
    assert_eq!(first, json!({"read": 5, "deleted": 5, "bound": 5, "filled": true, "dead_lettered": 0}));
    assert_eq!(keys(&stack).await, ["k6", "k7", "k8", "live", "passed"], "the five oldest went first");
    let second = sweep(&stack, json!({"p_bound": 5, "p_row_cap": 5})).await;
    assert_eq!(second, json!({"read": 3, "deleted": 3, "bound": 5, "filled": false, "dead_lettered": 0}));
    let third = sweep(&stack, json!({"p_bound": 1000})).await;
    assert_eq!(third, json!({"read": 0, "deleted": 0, "bound": 1000, "filled": false, "dead_lettered": 0}));
    assert_eq!(keys(&stack).await, ["live", "passed"], "only what retention still holds is left");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_sql_sweep_refuses_a_bound_below_one_or_above_the_row_cap_and_deletes_nothing() {
    let stack = stack().await;
    expired_rows(&stack, 10).await;
    let client = client(&stack);
    // JSON nulls are refused by SQL too (stack::arguments binds SQL NULL);
    // the embedded server hands an integer null over as '', which PostgreSQL
    // refuses before the function runs.
    let mut wrong = Vec::new();
    for (args, names) in [
        (json!({"p_bound": 0}), "p_bound must be at least 1"),
        (json!({"p_bound": -1}), "p_bound must be at least 1"),
        (json!({"p_bound": 1001}), "p_bound 1001 is above the row cap 1000"),
        (json!({"p_bound": 6, "p_row_cap": 5}), "p_bound 6 is above the row cap 5"),
        (json!({"p_bound": 1, "p_row_cap": 0}), "p_row_cap 0 is outside 1 to the plane's row cap 1000"),
        (json!({"p_bound": 1, "p_row_cap": 1001}), "p_row_cap 1001 is outside 1 to the plane's row cap 1000"),
        (json!({"p_bound": 100001, "p_row_cap": 100001}), "p_row_cap 100001 is outside 1 to the plane's row cap"),
    ] {
        match client.rpc::<Value>("idempotency_sweep", &args, Repeat::Safe).await {
            Err(ClientError::Api { status: 400, error, .. })
                if error.code == codes::INVALID_PARAMETER_VALUE && error.message.contains(names) => {}
            other => wrong.push(format!("{args}: {other:?}")),
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    assert_eq!(count_rows(&stack).await, 10, "no refused sweep deleted anything");
    // The largest pass the plane allows is accepted, its own cap by default.
    let largest = sweep(&stack, json!({"p_bound": 1000})).await;
    assert_eq!((&largest["read"], &largest["filled"]), (&json!(10), &json!(false)));
    set_plane_row_cap(&stack, 100_000).await;
    let largest = sweep(&stack, json!({"p_bound": 100000, "p_row_cap": 100000})).await;
    assert_eq!((&largest["read"], &largest["filled"]), (&json!(0), &json!(false)));
    stack.stop().await.unwrap();
}

/// The WARNING notices a connection receives (sqlx logs each as a `WARN`
/// event of target `sqlx::postgres::notice`).
#[derive(Clone, Default)]
struct Warnings(Arc<Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Warnings {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Message(String);
        impl tracing::field::Visit for Message {
            fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
                if field.name() == "message" {
                    self.0 = value.to_owned();
                }
            }
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" && self.0.is_empty() {
                    self.0 = format!("{value:?}");
                }
            }
        }
        let metadata = event.metadata();
        if metadata.target() == "sqlx::postgres::notice" && *metadata.level() == tracing::Level::WARN {
            let mut message = Message(String::new());
            event.record(&mut message);
            self.0.lock().expect("warnings").push(message.0);
        }
    }
}

#[tokio::test]
async fn a_sql_sweep_judges_the_backlog_by_the_read_and_warns_when_the_read_filled_the_bound() {
    // Arrange: ten claims past retention, and a writer that holds on to one
    // of them: a trigger makes its delete a no-op, as an extension of its
    // retention between the read and the delete would.
    let stack = stack().await;
    expired_rows(&stack, 10).await;
    stack
        .db()
        .execute(
            "create function pg_temp_keep() returns trigger language plpgsql as $$
             begin if old.key = 'k1' then return null; end if; return old; end $$;
             create trigger keep_one before delete on agent.idempotency_keys
               for each row execute function pg_temp_keep();",
        )
        .await
        .unwrap();

    // Act: as PostgREST would call it, as the service role, collecting the
    // notices the pass raised.
    let warnings = Warnings::default();
    let passes = async {
        let mut conn = stack.db().acquire().await.expect("a connection");
        let mut reports = Vec::new();
        for bound in [10, 20] {
            let mut tx = sqlx::Connection::begin(&mut *conn).await.expect("begin");
            sqlx::query("set local role service_role").execute(&mut *tx).await.expect("set role");
            let report: (i32, i32, i32, bool) = sqlx::query_as("select * from agent.idempotency_sweep($1)")
                .bind(bound)
                .fetch_one(&mut *tx)
                .await
                .expect("a sweep");
            tx.commit().await.expect("commit");
            reports.push(report);
        }
        reports
    }
    .with_subscriber(tracing_subscriber::registry().with(warnings.clone()))
    .await;

    // Assert: the read filled the bound of 10, whatever the delete count
    // says, and the pass warned; the next pass, of 20, read only the kept
    // row, so it neither filled its bound nor warned.
    assert_eq!(passes, [(10, 9, 10, true), (1, 0, 20, false)]);
    let warnings = warnings.0.lock().expect("warnings").clone();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("idempotency sweep read 10 expired claims, its whole bound: the backlog may be larger"),
        "{warnings:?}"
    );
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_sql_sweep_is_written_with_the_http_sweepers_read_and_delete() {
    // The retention rule and the order live in idempotency_expired and
    // idempotency_retire_expired alone: the sweep calls them and repeats
    // neither.
    let stack = stack().await;
    let body: String = sqlx::query_scalar("select prosrc from pg_proc where oid = 'agent.idempotency_sweep'::regproc")
        .fetch_one(stack.db())
        .await
        .unwrap();
    assert!(body.contains("from agent.idempotency_expired(p_bound) e"), "{body}");
    assert!(body.contains("agent.idempotency_retire_expired(v_ids)"), "{body}");
    for repeated in ["retain_until", "idempotency_keys", "order by"] {
        assert!(!body.contains(repeated), "the sweep repeats {repeated:?}: {body}");
    }
    stack.stop().await.unwrap();
}

/// The SQL sweep keeps unfinished work too, and says how much.
#[tokio::test]
async fn a_sql_sweep_dead_letters_unfinished_work_and_reports_it() {
    let stack = stack().await;
    sqlx::query(
        "insert into agent.idempotency_keys
           (organization_id, scope, key, request_hash, status, lease_token, request, claimed_at,
            lease_expires_at, retain_until, redrive_at)
         values (gen_random_uuid(), 'queue.sweep', 'acked', repeat('a', 64), 'processing', gen_random_uuid(),
                 '{\"job\": 1}', now() - interval '8 days', now() - interval '8 days', now() - interval '1 hour',
                 now() - interval '8 days')",
    )
    .execute(stack.db())
    .await
    .unwrap();
    expired_rows(&stack, 2).await;
    let report = sweep(&stack, json!({"p_bound": 10})).await;
    assert_eq!((&report["read"], &report["deleted"], &report["dead_lettered"]), (&json!(3), &json!(2), &json!(1)));
    let kept: String = sqlx::query_scalar("select response ->> 'error' from agent.idempotency_keys")
        .fetch_one(stack.db())
        .await
        .unwrap();
    assert_eq!(kept, "swept_unredriven");
    stack.stop().await.unwrap();
}
