//! The primary fails over to a streaming standby mid-run, on PostgreSQL 15
//! clusters of the test's own: a standby made with `pg_basebackup -R`,
//! streaming through a TCP forwarder, and the plane's server reaching the
//! database through another (the address a managed database moves to the
//! promoted standby).
//!
//! Mid-run the standby is partitioned from the primary (its forwarder cut),
//! the run goes on for a moment, the primary is killed (`kill -9`), the
//! standby promoted, and the plane's address switched to it; the run then
//! finishes, and every key is attempted once more (an orchestrator's next
//! attempt). Before the switch the test reads the promoted standby: every
//! completion the client saw acknowledged should be there.
//!
//! - Asynchronous replication (PostgreSQL's default, no
//!   `synchronous_standby_names`): every completion acknowledged after the
//!   partition is missing on the new primary, and the next attempt sends
//!   the effect again. The test counts them and fails if there are none
//!   (it would then prove nothing).
//! - Synchronous replication (`synchronous_standby_names` names the
//!   standby; the cluster's default `synchronous_commit` is `local`, and
//!   the role the server logs in as, `authenticator`, sets it `on`): a
//!   commit waits for the standby, so no completion begun after the
//!   partition is acknowledged, and none acknowledged is lost: 0 and 0.
//!   The partition counts from the moment the primary has no walsender for
//!   the standby left, not from the cut: a commit the standby flushed just
//!   before the cut may be acknowledged just after it, rightly. The
//!   asynchronous run is the measurement's positive control: there, it
//!   sees completions begun after the partition acknowledged.
//!
//! Per key in both: completed on the new primary with the vendor's one
//! message; every error the client saw classified transient. And a read
//! replica (a standby) does not see a claim the primary holds: claims, and
//! the reads that decide whether to claim, go to the primary.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency_plane::local::LocalStackConfig;
use idempotency_plane::Completion;
use serde_json::{json, Value};
use sqlx::{Connection, PgConnection, PgPool};
use uuid::Uuid;

use super::database_crash::{
    assert_acknowledged_completions_kept, assert_each_key_completed_once, claims_by_key, run_attempts, Seen, Vendor,
};
use crate::support::cluster::{server_binaries_missing, Cluster};
use crate::support::harness::*;
use crate::support::tcp_forward::TcpForward;
use crate::support::*;

const WORKERS: usize = 16;
const KEYS: usize = 240;
/// Acknowledged completions before the partition.
const PARTITION_AFTER_ACKS: u64 = 40;
/// Acknowledged completions, after the partition, that asynchronous
/// replication is given to lose before the primary dies.
const ACKS_DURING_PARTITION: u64 = 30;
/// How long the primary runs partitioned, at most.
const PARTITIONED_FOR: Duration = Duration::from_millis(1500);
const BOUND: Duration = Duration::from_secs(150);
const STANDBY: &str = "standby1";
/// Claims made before the partition and completed right after it is
/// established: completions known to begin after it, whatever the workers
/// happen to be doing then (under synchronous replication every worker is
/// soon waiting on a commit of its own, and begins nothing more).
const PROBES: usize = 4;
const SCOPE: &str = "tool.email.send";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Replication {
    Asynchronous,
    Synchronous,
}

/// What one failover run measured.
struct Failover {
    /// Completions acknowledged before the address moved.
    acked: usize,
    /// Of those, acknowledged after the partition was established.
    acked_during_partition: u64,
    /// Completion calls begun after the partition was established and
    /// answered by the old primary, and how many of them were acknowledged.
    begun_after_partition: usize,
    acked_begun_after_partition: usize,
    /// Of those, missing or unfinished on the promoted standby.
    lost: Vec<String>,
    /// Keys the vendor was sent more than once.
    sent_again: usize,
    errors: usize,
}

async fn streaming(primary: &PgPool, synchronous: bool) -> bool {
    let state: Option<String> = sqlx::query_scalar(
        "select sync_state from pg_stat_replication where application_name = $1 and state = 'streaming'",
    )
    .bind(STANDBY)
    .fetch_optional(primary)
    .await
    .expect("pg_stat_replication");
    state.is_some_and(|state| !synchronous || state == "sync")
}

/// Whether the primary has a walsender for the standby, in any state.
async fn standby_connected(primary: &PgPool) -> bool {
    let walsenders: i64 = sqlx::query_scalar("select count(*) from pg_stat_replication where application_name = $1")
        .bind(STANDBY)
        .fetch_one(primary)
        .await
        .expect("pg_stat_replication");
    walsenders > 0
}

async fn fail_over(replication: Replication) -> Option<Failover> {
    if server_binaries_missing(&format!("failover ({replication:?})")) {
        return None;
    }
    let options = match replication {
        Replication::Asynchronous => "-c wal_sender_timeout=5s".to_owned(),
        Replication::Synchronous => {
            format!("-c wal_sender_timeout=5s -c synchronous_standby_names={STANDBY} -c synchronous_commit=local")
        }
    };
    let mut primary = Cluster::start("failover", &options);
    // The plane's address, and the standby's road to the primary.
    let address = TcpForward::start(primary.port()).await;
    let replication_link = TcpForward::start(primary.port()).await;
    let config = LocalStackConfig {
        database_url: format!("postgres://postgres@127.0.0.1:{}/postgres", address.port()),
        // Room for every worker's request and every probe's at once: a
        // commit waiting for the standby holds its connection, and a probe
        // that waited for a connection instead would never begin a commit.
        pool_size: (WORKERS + PROBES + 4) as u32,
        ..LocalStackConfig::default()
    };
    let stack = stack_with(config).await;
    if replication == Replication::Synchronous {
        // Per role: every session the server opens waits for the standby.
        sqlx::query("alter role authenticator set synchronous_commit = on")
            .execute(stack.db())
            .await
            .expect("synchronous_commit for the server's role");
        // Sessions take role settings when they log in: close them all.
        address.point_at(primary.port());
    }
    let standby = Cluster::standby_streaming_from(replication_link.port(), STANDBY, "");
    within(Duration::from_secs(30), "the standby streaming", async {
        while !streaming(stack.db(), replication == Replication::Synchronous).await {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;

    let service = Arc::new(service(&stack));
    let (vendor, seen) = (Arc::new(Vendor::refusing_first_send_of_every(5)), Arc::new(Seen::default()));
    let org = org();
    let keys: Vec<String> = (0..KEYS).map(|i| format!("failover-{i}")).collect();
    let mut probes = Vec::new();
    for i in 0..PROBES {
        probes.push(claimed(service.claim(org, SCOPE, &format!("probe-{i}"), &hash("probe"), LEASE).await));
    }
    let began = Instant::now();
    let run = async {
        let workers = run_attempts(WORKERS, &service, org, keys.clone(), &vendor, &seen);
        while seen.acks.load(Ordering::SeqCst) < PARTITION_AFTER_ACKS {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        replication_link.cut();
        // The partition is established once the primary's walsender for the
        // standby is gone: no flush confirmation can reach the primary after
        // that, so a commit that begins later waits for a standby that never
        // answers (synchronous) or is acknowledged unreplicated
        // (asynchronous). Until then a commit the standby flushed before the
        // cut may still be acknowledged, rightly: its WAL is on the standby.
        // The forwarder closes the walsender's socket, so it exits at once;
        // `wal_sender_timeout` (5 s) ends it even if it missed that.
        within(Duration::from_secs(30), "the primary seeing its standby gone", async {
            while standby_connected(stack.db()).await {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        let partitioned = Instant::now();
        let at_partition = seen.acks.load(Ordering::SeqCst);
        let probing: Vec<_> = probes
            .drain(..)
            .map(|probe| {
                let (service, seen) = (service.clone(), seen.clone());
                tokio::spawn(async move {
                    let began = seen.completion_begins();
                    let ended = service.complete(&probe, Completion::response(json!({ "probe": true }))).await;
                    seen.completion_ended(began, &ended);
                })
            })
            .collect();
        // Asynchronous: until the primary acknowledged ACKS_DURING_PARTITION
        // more (a loaded machine may take a while). Synchronous: a fixed
        // moment, in which no commit begun in it can end.
        let partitioned_for = match replication {
            Replication::Asynchronous => Duration::from_secs(30),
            Replication::Synchronous => PARTITIONED_FOR,
        };
        while seen.acks.load(Ordering::SeqCst) < at_partition + ACKS_DURING_PARTITION
            && partitioned.elapsed() < partitioned_for
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let during_partition = seen.acks.load(Ordering::SeqCst) - at_partition;
        // The primary's host goes away, then its server dies.
        address.cut();
        primary.kill();
        standby.promote();
        // What the promoted standby holds of every acknowledged completion,
        // before any worker reaches it.
        let acked: HashMap<String, Value> = seen.acked.lock().expect("seen").clone();
        let mut on_standby = PgConnection::connect(&standby.url(stack.database_name())).await.expect("the standby");
        let rows: Vec<(String, String, Option<Value>)> =
            sqlx::query_as("select key, status, response from agent.idempotency_keys where organization_id = $1")
                .bind(org)
                .fetch_all(&mut on_standby)
                .await
                .expect("the claims on the promoted standby");
        let kept: HashMap<String, (String, Option<Value>)> =
            rows.into_iter().map(|(key, status, response)| (key, (status, response))).collect();
        let mut lost: Vec<String> = acked
            .iter()
            .filter(|(key, response)| kept.get(*key) != Some(&("completed".to_owned(), Some((*response).clone()))))
            .map(|(key, _)| key.clone())
            .collect();
        lost.sort();
        // Every completion call that ended so far was answered by the old
        // primary (the new one is not reachable yet): of those begun after
        // the partition, how many were acknowledged. (A probe still waiting
        // fails when the address moves, and its retry may then be
        // acknowledged by the new primary: that one is not counted.)
        let after_partition = seen.completions_begun_after(partitioned);
        address.point_at(standby.port());
        for worker in workers.into_iter().chain(probing) {
            worker.await.expect("a worker panicked");
        }
        // Every key once more, as an orchestrator's next attempt: a key
        // whose acknowledged completion was lost is still processing there,
        // and is reclaimed once its lease passes.
        for worker in run_attempts(WORKERS, &service, org, keys.clone(), &vendor, &seen) {
            worker.await.expect("a worker panicked");
        }
        (acked.len(), lost, during_partition, after_partition)
    };
    let (acked_before, lost, acked_during_partition, (begun_after_partition, acked_begun_after_partition)) =
        within(BOUND, "the failover run", run).await;

    // Per key, on the new primary.
    let rows = claims_by_key(stack.db(), org).await;
    assert_each_key_completed_once(&keys, &rows, &seen, &vendor);
    if replication == Replication::Synchronous {
        assert_acknowledged_completions_kept(stack.db(), org, &seen).await;
    }
    let sent = vendor.by_key();
    let errors = seen.errors.lock().expect("seen").clone();
    // The same server, never restarted, serves a fresh claim on the new primary.
    let after = claimed(service.claim(org, SCOPE, "after-the-failover", &hash("after"), LEASE).await);
    assert_eq!(
        service.release(&after).await.expect("a release on the new primary"),
        idempotency_plane::Ending::Recorded
    );
    let failover = Failover {
        acked: acked_before,
        acked_during_partition,
        begun_after_partition,
        acked_begun_after_partition,
        sent_again: sent.values().filter(|(_, sends)| *sends > 1).count(),
        errors: errors.len(),
        lost,
    };
    eprintln!(
        "failover ({replication:?} replication): {KEYS} keys, {} completions acknowledged before the switch ({} \
         after the partition; of {} completion calls begun after it, {} acknowledged), {} of them lost on the promoted standby, {} keys sent to the vendor again (vendor-deduped), {} errors (all \
         transient), run {:.1} s",
        failover.acked,
        failover.acked_during_partition,
        failover.begun_after_partition,
        failover.acked_begun_after_partition,
        failover.lost.len(),
        failover.sent_again,
        failover.errors,
        began.elapsed().as_secs_f64()
    );
    stack.stop().await.expect("stop the stack");
    Some(failover)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn asynchronous_replication_loses_acknowledged_completions_at_failover_and_their_effects_are_sent_again() {
    let Some(failover) = fail_over(Replication::Asynchronous).await else { return };
    // The measurement the synchronous run relies on sees what it looks for:
    // here commits begun after the partition are acknowledged unreplicated.
    assert!(
        failover.acked_begun_after_partition > 0,
        "no completion begun after the partition was acknowledged ({} begun): the measurement cannot see one",
        failover.begun_after_partition
    );
    assert!(
        !failover.lost.is_empty(),
        "no acknowledged completion was lost, yet the standby was partitioned while the primary acknowledged \
         more: this run shows nothing"
    );
    // Each lost completion's key was claimed again on the new primary and
    // its effect sent again: only the vendor's key kept it one effect.
    assert!(failover.sent_again >= 1, "lost completions {:?}, yet no effect was sent again", failover.lost);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn synchronous_replication_loses_no_acknowledged_completion_at_failover() {
    let Some(failover) = fail_over(Replication::Synchronous).await else { return };
    // A commit begun after the partition waits for the standby, which never
    // answers: none is acknowledged. (Completions acknowledged between the cut
    // and the partition's being established are not counted: the standby had
    // flushed their WAL before the cut, and the promoted standby is checked
    // for every one of them below.)
    assert!(failover.begun_after_partition >= PROBES, "the probes' completions began after the partition");
    assert_eq!(
        failover.acked_begun_after_partition, 0,
        "completions begun after the partition and acknowledged ({} begun)",
        failover.begun_after_partition
    );
    assert_eq!(failover.lost, Vec::<String>::new(), "acknowledged completions missing on the promoted standby");
}

/// A standby (a read replica) answers from whatever it has replayed: here,
/// partitioned from the primary, nothing of a claim the primary holds. A
/// `read()` or a claim decision taken there would answer `absent` and run
/// the effect a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_replica_does_not_see_a_claim_the_primary_holds() {
    if server_binaries_missing("a_read_replica_does_not_see_a_claim_the_primary_holds") {
        return;
    }
    let primary = Cluster::start("replica-read", "");
    let replication_link = TcpForward::start(primary.port()).await;
    let config =
        LocalStackConfig { database_url: primary.url("postgres"), pool_size: 4, ..LocalStackConfig::default() };
    let stack = stack_with(config).await;
    let replica = Cluster::standby_streaming_from(replication_link.port(), STANDBY, "");
    within(Duration::from_secs(30), "the standby streaming", async {
        while !streaming(stack.db(), false).await {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let service = service(&stack);
    let org = org();
    let mut on_replica = PgConnection::connect(&replica.url(stack.database_name())).await.expect("the replica");
    // While streaming, the replica comes to see a claim: what it sees is
    // what it has replayed.
    let before = claimed(service.claim(org, SCOPE, "before-the-partition", &hash("before"), LEASE).await);
    within(Duration::from_secs(30), "the replica replaying a claim", async {
        loop {
            let seen: Vec<(Uuid,)> = sqlx::query_as("select id from agent.idempotency_get($1, $2, $3)")
                .bind(org)
                .bind(SCOPE)
                .bind("before-the-partition")
                .fetch_all(&mut on_replica)
                .await
                .expect("idempotency_get on the replica");
            if seen.first().map(|(id,)| *id) == Some(before.id()) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    replication_link.cut();
    let claim = claimed(service.claim(org, SCOPE, "replica-read", &hash("replica"), LEASE).await);

    let seen_there: Vec<(Uuid,)> = sqlx::query_as("select id from agent.idempotency_get($1, $2, $3)")
        .bind(org)
        .bind(SCOPE)
        .bind("replica-read")
        .fetch_all(&mut on_replica)
        .await
        .expect("idempotency_get on the replica");
    assert!(seen_there.is_empty(), "the partitioned replica saw the claim");
    // The primary holds it: a read there is not absent.
    let read = service.read(org, SCOPE, "replica-read", &hash("replica")).await.expect("read on the primary");
    assert!(!matches!(read, idempotency_plane::ReadOutcome::Absent), "the primary's read: {read:?}");
    // A claim cannot be made on a replica at all.
    let refused = sqlx::query("select * from agent.idempotency_try_claim($1, $2, $3, $4, $5, 60000, 60000)")
        .bind(org)
        .bind(SCOPE)
        .bind("replica-claim")
        .bind(hash("replica").as_str())
        .bind(Uuid::new_v4())
        .execute(&mut on_replica)
        .await
        .expect_err("a claim on a read replica");
    let code = refused.as_database_error().and_then(|error| error.code().map(|code| code.into_owned()));
    assert_eq!(code.as_deref(), Some("25006"), "read_only_sql_transaction: {refused}");
    assert_eq!(service.release(&claim).await.expect("release"), idempotency_plane::Ending::Recorded);
    stack.stop().await.expect("stop the stack");
}

/// Where `synchronous_commit` must be set for the wait to happen: a
/// function's own `SET` clause is undone when the function returns, before
/// its transaction commits, so it decides nothing; a setting the body makes
/// for the transaction (`set_config(..., true)`) holds at the commit. The
/// cluster names a synchronous standby that never connects and defaults to
/// `local`, so a commit that waits for a standby never ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_functions_set_clause_does_not_decide_whether_its_commit_waits_for_the_standby() {
    if server_binaries_missing("a_functions_set_clause_does_not_decide_whether_its_commit_waits_for_the_standby") {
        return;
    }
    let cluster = Cluster::start("sync-clause", "-c synchronous_standby_names=absent -c synchronous_commit=local");
    let mut setup = cluster.connect("postgres").await;
    for statement in [
        "create table written (n int)",
        "create function with_clause() returns void language sql set synchronous_commit = on
           as 'insert into written values (1)'",
        "create function in_body() returns void language plpgsql as $$
           begin perform set_config('synchronous_commit', 'on', true); insert into written values (2); end $$",
    ] {
        sqlx::query(statement).execute(&mut setup).await.expect(statement);
    }
    let mut first = cluster.connect("postgres").await;
    within(Duration::from_secs(10), "a commit after a function with a SET clause", async {
        sqlx::query("select with_clause()").execute(&mut first).await.expect("with_clause()");
    })
    .await;
    let mut second = cluster.connect("postgres").await;
    let waited =
        tokio::time::timeout(Duration::from_secs(2), sqlx::query("select in_body()").execute(&mut second)).await;
    assert!(
        waited.is_err(),
        "a transaction that set synchronous_commit = on committed without its standby: {waited:?}"
    );
}
