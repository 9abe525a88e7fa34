//! Every connection slot of the database taken mid-run (`max_connections`
//! reached), on a PostgreSQL 15 cluster of the test's own.
//!
//! The server reaches the database through a TCP forwarder. Mid-run the
//! forwarder is cut (the server's connections close, and their slots free
//! up), another role takes every slot but the superusers' reserved ones,
//! and the forwarder is put back: each connection the server opens now is
//! refused with SQLSTATE 53300 ("too many clients"). After a while the
//! other role lets go, and the run finishes on the same server.
//!
//! A call made while the slots are taken, with retries off, shows what the
//! server answers and that the client classifies it transient. Per key: the
//! vendor made one effect, every acknowledged completion is stored, no key
//! is left processing (a release that failed waited out its lease), and
//! every error the workers saw was transient.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency_plane::local::LocalStackConfig;
use idempotency_plane::postgrest::RetryConfig;
use idempotency_plane::{ClientError, Error, IdempotencyService, PostgrestClient, PostgrestRepository};
use sqlx::{Connection, PgConnection};

use super::database_crash::{
    assert_acknowledged_completions_kept, assert_each_key_completed_once, claims_by_key, run_attempts, Seen, Vendor,
};
use crate::support::cluster::{server_binaries_missing, Cluster};
use crate::support::harness::*;
use crate::support::tcp_forward::TcpForward;
use crate::support::*;

const WORKERS: usize = 12;
const KEYS: usize = 200;
const EXHAUST_AFTER_ACKS: u64 = 40;
const EXHAUSTED_FOR: Duration = Duration::from_millis(1500);
const BOUND: Duration = Duration::from_secs(120);
const SCOPE: &str = "tool.email.send";
/// The cluster's slots: `max_connections`, of which the superusers keep some.
const MAX_CONNECTIONS: usize = 24;
const RESERVED: usize = 4;

/// Opens connections as `role`, adding to `held`, until the cluster
/// refuses one; answers the refusal's SQLSTATE.
async fn take_free_slots(cluster: &Cluster, role: &str, held: &mut Vec<PgConnection>) -> String {
    let url = format!("postgres://{role}@127.0.0.1:{}/postgres", cluster.port());
    loop {
        match PgConnection::connect(&url).await {
            Ok(connection) => held.push(connection),
            Err(error) => {
                let code = error.as_database_error().and_then(|e| e.code()).map(|code| code.into_owned());
                return code.unwrap_or_else(|| format!("no SQLSTATE: {error}"));
            }
        }
        assert!(held.len() <= MAX_CONNECTIONS, "more connections than max_connections");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_connection_slot_taken_mid_run_loses_nothing_and_the_client_retries_only_what_is_safe() {
    let test = "every_connection_slot_taken_mid_run_loses_nothing_and_the_client_retries_only_what_is_safe";
    if server_binaries_missing(test) {
        return;
    }
    let options = format!("-c max_connections={MAX_CONNECTIONS} -c superuser_reserved_connections={RESERVED}");
    let cluster = Cluster::start("connections", &options);
    let address = TcpForward::start(cluster.port()).await;
    let config = LocalStackConfig {
        database_url: format!("postgres://postgres@127.0.0.1:{}/postgres", address.port()),
        pool_size: 8,
        ..LocalStackConfig::default()
    };
    let stack = stack_with(config).await;
    sqlx::query("create role hog login").execute(stack.db()).await.expect("the role that takes every slot");
    let service = Arc::new(service(&stack));
    // Retries off: what one call meets while the slots are taken.
    let once = IdempotencyService::new(PostgrestRepository::new(
        PostgrestClient::new(stack.client_config().expect("config").with_retry(RetryConfig::disabled()))
            .expect("client"),
    ));
    let (vendor, seen) = (Arc::new(Vendor::refusing_first_send_of_every(5)), Arc::new(Seen::default()));
    let org = org();
    let keys: Vec<String> = (0..KEYS).map(|i| format!("slots-{i}")).collect();
    let began = Instant::now();

    let run = async {
        let workers = run_attempts(WORKERS, &service, org, keys.clone(), &vendor, &seen);
        while seen.acks.load(Ordering::SeqCst) < EXHAUST_AFTER_ACKS {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // The server's connections close; another role takes every slot.
        address.cut();
        // Slots of the server's closed sessions free up as they exit: keep
        // taking them until the other role holds every one but the reserved.
        let mut hogs = Vec::new();
        let refusal = within(Duration::from_secs(30), "another role taking every slot", async {
            loop {
                let refusal = take_free_slots(&cluster, "hog", &mut hogs).await;
                if hogs.len() == MAX_CONNECTIONS - RESERVED {
                    return refusal;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
        address.point_at(cluster.port());
        let probe = once.claim(org, SCOPE, "while-exhausted", &hash("exhausted"), LEASE).await;
        tokio::time::sleep(EXHAUSTED_FOR).await;
        drop(hogs);
        for worker in workers {
            worker.await.expect("a worker panicked");
        }
        (refusal, probe)
    };
    let (refusal, probe) = within(BOUND, "the run with every slot taken", run).await;
    assert_eq!(refusal, "53300", "the cluster refused the next connection with too_many_connections");
    // postrust-server answers a database it cannot reach 500 PGRST500
    // (PostgREST: 503 PGRST000); either is transient.
    let answered = match probe {
        Err(error) => {
            let code = match &error {
                Error::Store(client @ ClientError::Api { status: 500, .. }) => client.code().map(str::to_owned),
                _ => None,
            };
            assert_eq!(code.as_deref(), Some("PGRST500"), "a call while every slot was taken: {error}");
            assert!(error.is_transient(), "the exhausted server's answer classified permanent: {error}");
            error.to_string()
        }
        Ok(outcome) => panic!("a call while every slot was taken was answered: {outcome:?}"),
    };

    let rows = claims_by_key(stack.db(), org).await;
    assert_each_key_completed_once(&keys, &rows, &seen, &vendor);
    assert_acknowledged_completions_kept(stack.db(), org, &seen).await;
    let errors = seen.errors.lock().expect("seen").clone();
    let after = claimed(service.claim(org, SCOPE, "after-the-exhaustion", &hash("after"), LEASE).await);
    assert_eq!(service.release(&after).await.expect("release"), idempotency_plane::Ending::Recorded);
    eprintln!(
        "connections exhausted: {KEYS} keys, a call with retries off answered: {answered}; {} sends refused and {} \
         released ({} releases failed and waited out their lease), {} errors surfaced to workers (all transient), \
         run {:.1} s",
        vendor.refused(),
        seen.releases.load(Ordering::SeqCst),
        seen.failed_releases.load(Ordering::SeqCst),
        errors.len(),
        began.elapsed().as_secs_f64()
    );
    stack.stop().await.expect("stop the stack");
}

/// A local stack started while another role holds every connection slot of
/// its cluster (a shared cluster, several test suites starting at once)
/// waits for a slot instead of failing on the first 53300.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stack_started_while_every_slot_is_taken_waits_for_one() {
    let test = "a_stack_started_while_every_slot_is_taken_waits_for_one";
    if server_binaries_missing(test) {
        return;
    }
    const SLOTS: usize = 6;
    let cluster = Cluster::start("slots", &format!("-c max_connections={SLOTS} -c superuser_reserved_connections=0"));
    let mut admin = cluster.connect("postgres").await;
    sqlx::query("create role hog login").execute(&mut admin).await.expect("the role that takes every slot");
    admin.close().await.expect("closed");
    let mut hogs = Vec::new();
    let refusal = within(Duration::from_secs(30), "taking every slot", async {
        loop {
            let refusal = take_free_slots(&cluster, "hog", &mut hogs).await;
            if hogs.len() == SLOTS {
                return refusal;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert_eq!(refusal, "53300");
    let config = LocalStackConfig {
        database_url: format!("postgres://postgres@127.0.0.1:{}/postgres", cluster.port()),
        pool_size: 2,
        ..LocalStackConfig::default()
    };
    let starting = tokio::spawn(idempotency_plane::local::LocalStack::start(config));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!starting.is_finished(), "the start waits while every slot is taken");
    drop(hogs);
    let stack = within(Duration::from_secs(60), "the stack starting once slots free up", starting)
        .await
        .expect("the start task")
        .expect("the stack started");
    let claimed = service(&stack).claim(org(), SCOPE, "after-the-wait", &hash("x"), LEASE).await;
    assert!(matches!(claimed, Ok(idempotency_plane::ClaimOutcome::Claimed(_))), "{claimed:?}");
    stack.stop().await.expect("stopped");
}
