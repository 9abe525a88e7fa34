//! The partitioned layout (`sql/layouts/partitioned_by_organization.sql`)
//! applied to a plane that already holds claims: every claim keeps its
//! answer and its fence, work in flight finishes across the change, and
//! each partition is closed to the API roles as the table is. (The whole
//! suite also runs on that layout: `IDEM_LAYOUT=partitioned`, as `.ci/run`
//! does.)

use idempotency_plane::local::LocalStackConfig;
use idempotency_plane::migrations::{Layout, PARTITIONED_BY_ORGANIZATION};
use idempotency_plane::{ClaimOutcome, Completion, Ending};
use serde_json::json;

use crate::support::harness::*;

#[tokio::test]
async fn the_layout_moves_every_claim_and_keeps_every_fence() {
    if Layout::from_env() == Ok(Layout::PartitionedByOrganization) {
        // The stack is partitioned already; there is no single table to move.
        return;
    }
    let stack = stack_with(LocalStackConfig::default()).await;
    let service = service(&stack);
    // Arrange: completed claims of several organizations, and one claim in
    // flight whose worker completes after the layout changed under it.
    let orgs: Vec<_> = (0..8).map(|_| org()).collect();
    for (n, org) in orgs.iter().enumerate() {
        let claim = claimed(service.claim(*org, "tool.email.send", "sent", &hash("sent"), LEASE).await);
        let ending = service.complete(&claim, Completion::response(json!({"n": n}))).await.unwrap();
        assert_eq!(ending, Ending::Recorded);
    }
    let in_flight = claimed(service.claim(orgs[0], "tool.email.send", "in-flight", &hash("f"), LEASE).await);
    let released = claimed(service.claim(orgs[1], "tool.email.send", "released", &hash("r"), LEASE).await);

    // Act: the layout, in one transaction, as a migration is applied.
    let mut transaction = stack.db().begin().await.unwrap();
    sqlx::raw_sql(PARTITIONED_BY_ORGANIZATION.1).execute(&mut *transaction).await.expect("the layout applies");
    transaction.commit().await.unwrap();

    // Assert: partitioned, every row moved.
    let (kind, partitions): (String, i64) = sqlx::query_as(
        "select c.relkind::text, (select count(*) from pg_inherits i where i.inhparent = c.oid)
           from pg_class c where c.oid = 'agent.idempotency_keys'::regclass",
    )
    .fetch_one(stack.db())
    .await
    .unwrap();
    assert_eq!((kind.as_str(), partitions), ("p", 16), "hash-partitioned into 16");
    assert_eq!(count_rows(&stack).await, 10);
    // Every completed claim replays its own answer, through the same server.
    for (n, org) in orgs.iter().enumerate() {
        match service.claim(*org, "tool.email.send", "sent", &hash("sent"), LEASE).await.unwrap() {
            ClaimOutcome::Completed { response, .. } => assert_eq!(response, Some(json!({"n": n})), "org {n}"),
            other => panic!("org {n}: the journal lost its answer: {other:?}"),
        }
    }
    // The claims in flight keep their fences: one completes, one releases,
    // and a stale token still cannot end either.
    assert_eq!(service.complete(&in_flight, Completion::response(json!("late"))).await.unwrap(), Ending::Recorded);
    assert_eq!(service.release(&released).await.unwrap(), Ending::Recorded);
    assert!(matches!(
        service.claim(orgs[0], "tool.email.send", "in-flight", &hash("f"), LEASE).await.unwrap(),
        ClaimOutcome::Completed { .. }
    ));
    assert_eq!(count_rows(&stack).await, 9, "the released claim is gone");

    // Each partition is closed as the table is: row level security on, and
    // no privilege for any API role.
    let open: Vec<String> = sqlx::query_scalar(
        "select c.relname::text
           from pg_inherits i join pg_class c on c.oid = i.inhrelid
          where i.inhparent = 'agent.idempotency_keys'::regclass
            and (not c.relrowsecurity
                 or c.relowner <> 'idempotency_owner'::regrole
                 or has_table_privilege('service_role', c.oid, 'select, insert, update, delete')
                 or has_table_privilege('anon', c.oid, 'select, insert, update, delete')
                 or has_table_privilege('authenticated', c.oid, 'select, insert, update, delete'))",
    )
    .fetch_all(stack.db())
    .await
    .unwrap();
    assert!(open.is_empty(), "partitions an API role could reach, or without row level security: {open:?}");
    stack.stop().await.unwrap();
}
