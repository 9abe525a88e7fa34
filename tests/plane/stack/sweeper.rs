//! The retention sweeper, and responses above the store limit, on the real stack.

use std::sync::Arc;

use idempotency_plane::local::LocalStackConfig;
use idempotency_plane::postgrest::{ClientConfig, ClientError, PostgrestClient};
use idempotency_plane::sweeper::Sweeper;
use idempotency_plane::{ClaimOutcome, Completion, Ending, Error, InvalidInput, RequestHash};
use serde_json::json;
use sqlx::Executor;

use crate::support::harness::*;

#[tokio::test]
async fn a_row_whose_retention_was_extended_between_read_and_delete_survives() {
    let stack = stack().await;
    expired_rows(&stack, 4).await;
    let sweeper = Sweeper::new(client(&stack), 10).unwrap();
    let expired = sweeper.read_expired().await.unwrap();
    assert_eq!(expired.len(), 4);
    // A reclaim (or a late completion) extends one of them meanwhile.
    sqlx::query("update agent.idempotency_keys set retain_until = now() + interval '1 hour' where id = $1")
        .bind(expired[0].id)
        .execute(stack.db())
        .await
        .unwrap();
    let ids: Vec<uuid::Uuid> = expired.iter().map(|c| c.id).collect();
    assert_eq!(sweeper.delete(&ids).await.unwrap().deleted, 3);
    let survivor: i64 = sqlx::query_scalar("select count(*) from agent.idempotency_keys where id = $1")
        .bind(expired[0].id)
        .fetch_one(stack.db())
        .await
        .unwrap();
    assert_eq!(survivor, 1);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_claim_whose_lease_passed_but_whose_retention_holds_is_never_swept() {
    let stack = stack().await;
    let service = service(&stack);
    let claim = claimed(service.claim(org(), "webhook.nylas", "d-1", &hash("x"), LEASE).await);
    pass_lease(&stack, claim.id()).await;
    let report = Sweeper::new(client(&stack), 100).unwrap().pass().await.unwrap();
    assert_eq!((report.read, report.deleted), (0, 0));
    assert_eq!(count_rows(&stack).await, 1);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn claims_keep_succeeding_while_a_sweep_runs() {
    let stack = stack().await;
    expired_rows(&stack, 5000).await;
    let sweeper = Sweeper::new(client(&stack), 500).unwrap();
    let sweeping = tokio::spawn(async move {
        for filled in 0..50 {
            if !sweeper.pass().await.expect("sweep pass").filled {
                return (filled, std::time::Instant::now());
            }
        }
        panic!("the sweep did not drain 5000 rows in 50 passes of 500");
    });
    let service = Arc::new(service(&stack));
    let org = org();
    let claims = (0..60).map(|i| {
        let service = service.clone();
        tokio::spawn(async move {
            let outcome =
                service.claim(org, "tool.email.send", &format!("during-sweep-{i}"), &hash("c"), LEASE).await?;
            let ClaimOutcome::Claimed(claim) = outcome else { panic!("claim {i}: {outcome:?}") };
            let ending = service.complete(&claim, Completion::response(json!(i))).await?;
            Ok::<_, Error>((ending, std::time::Instant::now()))
        })
    });
    let mut finished = Vec::new();
    for joined in futures::future::join_all(claims).await {
        let (ending, at) = joined.expect("task").expect("claim during sweep");
        assert_eq!(ending, Ending::Recorded);
        finished.push(at);
    }
    let (filled_passes, sweep_ended) = sweeping.await.expect("sweeper");
    assert_eq!(filled_passes, 10, "5000 rows, 500 a pass");
    assert!(finished.iter().any(|at| *at < sweep_ended), "claims completed while the sweep was still running");
    assert_eq!(count_rows(&stack).await, 60, "every expired row gone, every new claim kept");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn the_backlog_is_judged_by_the_read_even_when_fewer_rows_are_deleted() {
    let stack = stack().await;
    expired_rows(&stack, 10).await;
    // A writer holds on to one of the rows between the read and the delete:
    // a trigger makes its delete a no-op, as a concurrent extension would.
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
    let report = Sweeper::new(client(&stack), 10).unwrap().pass().await.unwrap();
    assert_eq!((report.read, report.deleted), (10, 9));
    assert!(report.filled, "the read filled the bound: a backlog, whatever the delete count says");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_sweep_bound_above_the_cap_is_refused_naming_the_setting_and_sends_nothing() {
    let server = wiremock::MockServer::start().await;
    wiremock::Mock::given(wiremock::matchers::any())
        .respond_with(wiremock::ResponseTemplate::new(200))
        .expect(0)
        .mount(&server)
        .await;
    let client =
        PostgrestClient::new(ClientConfig::new(&server.uri(), "key").unwrap().with_max_rows(100).unwrap()).unwrap();
    let refused = Sweeper::new(client, 101).unwrap_err();
    assert!(matches!(refused, ClientError::BoundAboveCap { bound: 101, cap: 100 }));
    let message = refused.to_string();
    for setting in ["db-max-rows", "PGRST_DB_MAX_ROWS", "max_rows"] {
        assert!(message.contains(setting), "{message}");
    }
    server.verify().await;
}

#[tokio::test]
async fn a_server_capped_lower_than_configured_makes_the_sweep_fail_loudly() {
    let stack = stack_with(LocalStackConfig::default().with_max_rows(5)).await;
    set_plane_row_cap(&stack, 20).await;
    expired_rows(&stack, 12).await;
    let told_twenty = PostgrestClient::new(stack.client_config().unwrap().with_max_rows(20).unwrap()).unwrap();
    let failed = Sweeper::new(told_twenty, 20).unwrap().pass().await;
    match failed {
        Err(Error::Store(ClientError::Truncated { received: 5, total: 12, .. })) => {}
        other => panic!("expected Truncated {{ received: 5, total: 12 }}, got {other:?}"),
    }
    assert_eq!(count_rows(&stack).await, 12, "a truncated read deletes nothing");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_response_above_the_store_limit_is_stored_as_a_reference_and_replayed_as_one() {
    let stack = stack().await;
    let service = service(&stack).with_response_limit(1024);
    let org = org();
    let h = hash("export");
    let claim = claimed(service.claim(org, "tool.report.export", "run-1:step-1", &h, LEASE).await);
    let big = json!({"rows": "x".repeat(4096)});
    let ending =
        service.complete(&claim, Completion::response(big.clone()).with_resource("blob", "exports/1.json")).await;
    assert_eq!(ending.unwrap(), Ending::Recorded);

    let stored_size: i32 = sqlx::query_scalar("select pg_column_size(response) from agent.idempotency_keys")
        .fetch_one(stack.db())
        .await
        .unwrap();
    assert!(stored_size < 1024, "the body was not stored: {stored_size} bytes");
    let replay = service.claim(org, "tool.report.export", "run-1:step-1", &h, LEASE).await.unwrap();
    let ClaimOutcome::Completed { response: None, resource: Some(resource), response_ref: Some(reference) } = replay
    else {
        panic!("expected a reference, got {replay:?}");
    };
    let body = serde_json::to_vec(&big).unwrap();
    assert_eq!(reference.size, body.len() as u64);
    assert_eq!(reference.sha256, RequestHash::of_bytes(&body).as_str());
    assert_eq!((reference.resource_type.as_str(), reference.resource_id.as_str()), ("blob", "exports/1.json"));
    assert_eq!(resource.resource_id, "exports/1.json");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_response_above_the_limit_with_nothing_to_point_at_is_refused_and_the_claim_stays_ours() {
    let stack = stack().await;
    let service = service(&stack).with_response_limit(1024);
    let claim = claimed(service.claim(org(), "tool.report.export", "k", &hash("y"), LEASE).await);
    let refused = service.complete(&claim, Completion::response(json!({"rows": "x".repeat(4096)}))).await;
    match refused {
        Err(Error::Invalid(InvalidInput::ResponseTooLarge { size, limit: 1024 })) => assert!(size > 4096),
        other => panic!("expected ResponseTooLarge, got {other:?}"),
    }
    let status: String =
        sqlx::query_scalar("select status from agent.idempotency_keys").fetch_one(stack.db()).await.unwrap();
    assert_eq!(status, "processing", "nothing was sent");
    // Still ours: a smaller answer completes it.
    assert_eq!(service.complete(&claim, Completion::response(json!({"rows": 4096}))).await.unwrap(), Ending::Recorded);
    stack.stop().await.unwrap();
}

/// Work a worker acknowledged (a claim still processing, carrying its
/// request) that nobody re-drove before its retention passed is never
/// deleted: the sweep journals it as a dead letter, counts it, and the
/// failures list it, re-drivable; beside it, an unfinished claim without
/// work and a finished one are deleted. Sent back after a fix, it runs
/// once more.
#[tokio::test]
async fn unfinished_work_past_its_retention_is_dead_lettered_never_deleted() {
    use idempotency_plane::repo::{
        ClaimCall, FailuresCall, IdempotencyRepository, JournaledFailures, OrphanedWork, RedriveCall,
    };
    use idempotency_plane::PostgrestRepository;

    let stack = stack().await;
    let repo = PostgrestRepository::new(client(&stack));
    let (org, h) = (org(), hash("acknowledged").as_str().to_owned());
    let work = json!({"order": 42});
    let claim = |key: &'static str, request| ClaimCall {
        organization_id: org,
        scope: "webhook.sweep",
        key,
        request_hash: &h,
        lease_token: uuid::Uuid::new_v4(),
        lease: LEASE,
        request,
    };
    let unfinished = repo.claim(&claim("unfinished", Some(&work))).await.unwrap();
    let bare = repo.claim(&claim("bare", None)).await.unwrap();
    // Their worker died, and their retention passed with nobody re-driving them.
    stack
        .db()
        .execute(
            "update agent.idempotency_keys
                set claimed_at = now() - interval '2 days', lease_expires_at = now() - interval '2 days',
                    retain_until = now() - interval '1 hour',
                    redrive_at = case when redrive_at is not null then now() - interval '2 days' end",
        )
        .await
        .unwrap();
    expired_rows(&stack, 1).await;

    let report = Sweeper::new(client(&stack), 10).unwrap().pass().await.unwrap();
    assert_eq!((report.read, report.deleted, report.dead_lettered), (3, 2, 1), "{report:?}");
    assert_eq!(count_rows(&stack).await, 1, "only the unfinished work is kept");
    let kept: (uuid::Uuid, String, serde_json::Value, bool) = sqlx::query_as(
        "select id, status, response, retain_until > now() + interval '23 hours' from agent.idempotency_keys",
    )
    .fetch_one(stack.db())
    .await
    .unwrap();
    assert_eq!(kept.0, unfinished.id);
    assert_eq!((kept.1.as_str(), &kept.2["error"]), ("completed", &json!("swept_unredriven")));
    assert!(kept.3, "kept for its scope's retention (24 h) from now");
    assert_ne!(bare.id, kept.0);

    let listed =
        FailuresCall { scope: "webhook.*", bound: 10, organization_id: Some(org), since: None, claim_ids: None };
    let failures = repo.failures(&listed).await.unwrap();
    assert_eq!(failures.len(), 1);
    assert_eq!((failures[0].error.as_deref(), failures[0].redrivable), (Some("swept_unredriven"), true));

    // A second pass finds nothing more to do.
    let again = Sweeper::new(client(&stack), 10).unwrap().pass().await.unwrap();
    assert_eq!((again.read, again.deleted, again.dead_lettered), (0, 0, 0));

    // Sent back after a fix, a re-drive runs it with its work.
    let chosen = [unfinished.id];
    let back = FailuresCall { claim_ids: Some(&chosen), ..listed };
    assert_eq!(repo.redrive_failed(&back).await.unwrap().len(), 1);
    let tokens = crate::support::lease_tokens(5);
    let call = RedriveCall { scope: "webhook.*", lease_tokens: tokens, lease: LEASE, organization_id: Some(org) };
    let taken = repo.redrive(&call).await.unwrap();
    assert_eq!(taken.len(), 1);
    assert_eq!((taken[0].key.as_str(), taken[0].request.as_ref()), ("unfinished", Some(&work)));
    stack.stop().await.unwrap();
}
