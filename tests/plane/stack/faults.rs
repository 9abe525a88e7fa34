//! Faults between the client and the server: lost responses after a commit,
//! refused connections, a server torn down and rebuilt, a statement timeout.

use std::sync::Arc;
use std::time::Duration;

use idempotency_plane::postgrest::{ClientConfig, ClientError, PostgrestClient, Repeat, RetryConfig, TransportKind};
use idempotency_plane::repo::{ClaimRequest, IdempotencyRepository};
use idempotency_plane::{ClaimOutcome, Completion, Ending, Error, IdempotencyService, PostgrestRepository};
use serde_json::json;
use sqlx::Executor;

use crate::support::harness::*;
use crate::support::transport::{proxy_retry, FaultServer, RefusedPort};

#[tokio::test]
async fn a_claim_whose_answer_was_lost_after_its_insert_committed_is_recognized_as_ours() {
    let stack = stack().await;
    let proxy = FaultServer::lossy_proxy(stack.url()).await;
    let client = proxy.client(stack.service_key(), proxy_retry());
    let service = IdempotencyService::new(PostgrestRepository::new(client.clone()));

    proxy.lose_answer(1);
    let outcome = service.claim(org(), "tool.email.send", "lost-insert", &hash("x"), LEASE).await.unwrap();
    assert!(matches!(outcome, ClaimOutcome::Claimed(ref c) if !c.reclaimed()), "claimed, not processing: {outcome:?}");
    assert_eq!(client.requests_sent(), 2, "the insert, then its retry");
    assert_eq!(count_rows(&stack).await, 1);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_completion_whose_answer_was_lost_is_recorded_not_a_lost_fence() {
    let stack = stack().await;
    let proxy = FaultServer::lossy_proxy(stack.url()).await;
    let service = IdempotencyService::new(PostgrestRepository::new(proxy.client(stack.service_key(), proxy_retry())));
    let claim = claimed(service.claim(org(), "tool.email.send", "lost-complete", &hash("x"), LEASE).await);

    proxy.lose_answer(1);
    let ending = service.complete(&claim, Completion::response(json!({"sent": true}))).await.unwrap();
    assert_eq!(ending, Ending::Recorded);
    let status: String =
        sqlx::query_scalar("select status from agent.idempotency_keys").fetch_one(stack.db()).await.unwrap();
    assert_eq!(status, "completed");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_release_whose_answer_was_lost_is_harmless() {
    let stack = stack().await;
    let proxy = FaultServer::lossy_proxy(stack.url()).await;
    let client = proxy.client(stack.service_key(), proxy_retry());
    let service = IdempotencyService::new(PostgrestRepository::new(client.clone()));
    let org = org();
    let claim = claimed(service.claim(org, "tool.email.send", "lost-release", &hash("x"), LEASE).await);

    proxy.lose_answer(1);
    let before = client.requests_sent();
    // Release is not repeat-safe in what it reports, so the client does not
    // resend it: the caller learns the outcome is unknown...
    let unknown = service.release(&claim).await;
    assert!(
        matches!(unknown, Err(Error::Store(ClientError::Transport { kind: TransportKind::Interrupted, .. }))),
        "{unknown:?}"
    );
    assert_eq!(client.requests_sent() - before, 1);
    // ...and whatever it does next is harmless: the release did commit.
    assert_eq!(count_rows(&stack).await, 0);
    assert_eq!(service.release(&claim).await.unwrap(), Ending::LeaseMovedOn);
    let again = claimed(service.claim(org, "tool.email.send", "lost-release", &hash("x"), LEASE).await);
    assert!(!again.reclaimed(), "the next attempt executes");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_reclaim_whose_answer_was_lost_is_recognized_as_ours() {
    let stack = stack().await;
    let proxy = FaultServer::lossy_proxy(stack.url()).await;
    let client = proxy.client(stack.service_key(), proxy_retry());
    let service = IdempotencyService::new(PostgrestRepository::new(client.clone()));
    let org = org();
    let crashed = claimed(service.claim(org, "tool.email.send", "lost-reclaim", &hash("x"), LEASE).await);
    pass_lease(&stack, crashed.id()).await;

    // claim() is one call: lose its answer after the reclaim committed.
    proxy.lose_answer(1);
    let before = client.requests_sent();
    let outcome = service.claim(org, "tool.email.send", "lost-reclaim", &hash("x"), LEASE).await.unwrap();
    let ClaimOutcome::Claimed(ours) = outcome else { panic!("claimed, not processing: {outcome:?}") };
    assert!(ours.reclaimed(), "the repeat answers the caller's own reclaim, as a reclaim");
    assert_eq!(client.requests_sent() - before, 2, "the claim, its retry");
    assert_eq!(service.complete(&ours, Completion::response(json!(1))).await.unwrap(), Ending::Recorded);

    // The repository's own view: the repeat of a committed reclaim is ours.
    let repo = PostgrestRepository::new(client);
    let token = uuid::Uuid::new_v4();
    let other = claimed(service.claim(org, "tool.email.send", "lost-reclaim-2", &hash("x"), LEASE).await);
    pass_lease(&stack, other.id()).await;
    let x = hash("x");
    let request = ClaimRequest {
        organization_id: org,
        scope: "tool.email.send",
        key: "lost-reclaim-2",
        request_hash: x.as_str(),
        lease_token: token,
        lease: LEASE,
        retain: LEASE,
    };
    let first = repo.reclaim(&request).await.unwrap().expect("reclaimed");
    let repeat = repo.reclaim(&request).await.unwrap().expect("recognized as ours");
    assert_eq!((first.id, first.lease_token), (repeat.id, repeat.lease_token));
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_refused_connection_is_retried_until_the_server_is_back() {
    let stack = stack().await;
    // A port that refuses connections until the server comes up on it. It
    // stays bound throughout (see `RefusedPort`), so it is refused for sure
    // and nobody else can take it before the server does.
    let port = RefusedPort::new();
    let retry = RetryConfig {
        max_retries: 20,
        initial_backoff: Duration::from_millis(50),
        max_backoff: Duration::from_millis(100),
        max_elapsed: Duration::from_secs(10),
    };
    let client =
        PostgrestClient::new(ClientConfig::new(&port.url(), stack.service_key().to_owned()).unwrap().with_retry(retry))
            .unwrap();
    let service = IdempotencyService::new(PostgrestRepository::new(client.clone()));
    // The server comes up on that port after a few refusals.
    let upstream = stack.url().to_owned();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        FaultServer::lossy_proxy_on(port.listen(), &upstream);
    });
    let outcome = service.claim(org(), "tool.email.send", "refused-then-up", &hash("x"), LEASE).await.unwrap();
    assert!(matches!(outcome, ClaimOutcome::Claimed(_)), "{outcome:?}");
    assert!(client.requests_sent() > 1, "refused at least once first");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_server_torn_down_and_rebuilt_mid_run_loses_no_completion_and_repeats_no_effect() {
    let mut stack = stack().await;
    let retry = RetryConfig {
        max_retries: 40,
        initial_backoff: Duration::from_millis(20),
        max_backoff: Duration::from_millis(100),
        max_elapsed: Duration::from_secs(20),
    };
    let client = PostgrestClient::new(stack.client_config().unwrap().with_retry(retry)).unwrap();
    let service = Arc::new(IdempotencyService::new(PostgrestRepository::new(client.clone())));
    let org = org();
    let effects = Arc::new(std::sync::Mutex::new(std::collections::HashMap::<String, usize>::new()));
    let keys = 120;

    let workers: Vec<_> = (0..8)
        .map(|w| {
            let (service, effects) = (service.clone(), effects.clone());
            tokio::spawn(async move {
                for k in (w..keys).step_by(8) {
                    let key = format!("restart-{k}");
                    loop {
                        // An orchestrator retries the whole step until it settles.
                        match service.claim(org, "tool.email.send", &key, &hash("r"), Duration::from_secs(30)).await {
                            Ok(ClaimOutcome::Claimed(claim)) => {
                                *effects.lock().unwrap().entry(key.clone()).or_default() += 1;
                                // The effect happened: its completion must land, however long the outage.
                                while service.complete(&claim, Completion::response(json!(k))).await.is_err() {
                                    tokio::time::sleep(Duration::from_millis(50)).await;
                                }
                                break;
                            }
                            Ok(ClaimOutcome::Completed { .. }) => break,
                            Ok(other) => panic!("{key}: unexpected {other:?}"),
                            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                        }
                    }
                }
            })
        })
        .collect();
    // Restart once a quarter of the effects ran: the workload is under way
    // and most of it is still ahead, whatever this machine's speed.
    eventually("a quarter of the effects ran", || effects.lock().unwrap().len() >= keys / 4).await;
    let sent_before = client.requests_sent();
    stack.restart_server().await.unwrap();
    let sent_by_restart = client.requests_sent();
    within(Duration::from_secs(120), "the workload settles after the restart", async {
        for worker in workers {
            worker.await.unwrap();
        }
    })
    .await;
    let sent_after = client.requests_sent() - sent_by_restart;

    // The workload overlapped the restart: requests went out before it and
    // after it, so the teardown met work in flight and the rebuilt server
    // finished it.
    assert!(sent_before > 0, "no request before the restart");
    assert!(sent_after > 0, "no request after the restart: the workload was over before it");

    let effects = effects.lock().unwrap().clone();
    assert_eq!(effects.len(), keys, "every effect ran");
    assert!(effects.values().all(|&n| n == 1), "no effect ran twice: {effects:?}");
    let completed: i64 = sqlx::query_scalar("select count(*) from agent.idempotency_keys where status = 'completed'")
        .fetch_one(stack.db())
        .await
        .unwrap();
    assert_eq!(completed, keys as i64, "no completion was lost");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_statement_timeout_surfaces_as_a_typed_error() {
    let mut stack = stack().await;
    let database = stack.database_name().to_owned();
    // The timeout holds for every statement of the database, the server's
    // schema cache load included: 2 s, so that load does not time out on a
    // machine busy with the other tests (200 ms did), and a probe that
    // sleeps five times as long.
    stack
        .db()
        .execute(sqlx::AssertSqlSafe(format!(
            "create function agent.slow_probe() returns integer language sql volatile set search_path = ''
               as $$ select 1 from pg_catalog.pg_sleep(10) $$;
             grant execute on function agent.slow_probe() to service_role;
             alter database \"{database}\" set statement_timeout = '2s';"
        )))
        .await
        .unwrap();
    // New connections (and the new schema cache) see both.
    stack.restart_server().await.unwrap();
    let client = PostgrestClient::new(stack.client_config().unwrap()).unwrap();
    let timed_out = client.rpc::<serde_json::Value>("slow_probe", &json!({}), Repeat::Safe).await;
    match timed_out {
        Err(error @ ClientError::Api { .. }) => {
            assert_eq!(error.code(), Some("57014"), "{error}");
            assert!(!error.is_retryable(true), "a slow statement repeats: not retried");
        }
        other => panic!("expected a 57014 query_canceled, got {other:?}"),
    }
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_run_admission_whose_answer_was_lost_is_still_admitted_for_its_caller_and_for_nobody_else() {
    let stack = stack().await;
    let proxy = FaultServer::lossy_proxy(stack.url()).await;
    let client = proxy.client(stack.service_key(), proxy_retry());
    let (org, input) = (org(), json!({"capability": "summarize", "request": "req-1"}));

    proxy.lose_answer(1);
    let admission = idempotency_plane::callers::runs::RunAdmission::new(PostgrestRepository::new(client.clone()));
    let run = admission.admit(org, "capability:summarize:req-1", &input).await.unwrap();
    assert!(run.admitted, "the retry carried the admitting call's token, so it is still that call");
    assert_eq!(client.requests_sent(), 2, "the admission, then its retry");
    assert_eq!(count_runs(&stack).await, 1);

    let replay = admission.admit(org, "capability:summarize:req-1", &input).await.unwrap();
    assert!(!replay.admitted, "another call (another token) is a replay");
    assert_eq!(replay.id, run.id);
    stack.stop().await.unwrap();
}
