//! The saved-search start under faults: concurrent scheduler chains per
//! trigger, and the known gap the randomized run found, pinned on its own.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_plane::callers::runs::RunAdmission;
use idempotency_plane::callers::saved_search::{
    SavedSearchError, SavedSearchStart, SnapshotError, SnapshotSource, Started, StartedRun, SNAPSHOT_RESOURCE_TYPE,
};
use idempotency_plane::callers::tool::RetryHorizon;
use idempotency_plane::{IdempotencyService, PostgrestRepository};
use rand::rngs::StdRng;
use rand::Rng;
use serde_json::{json, Value};
use sqlx::PgPool;
use uuid::Uuid;

use crate::support::faults::{Call, Fault, Faulty, Op};
use crate::support::harness::{client, stack, WAIT};

use super::saved_search_fakes::{
    holder, search_id, start_id, start_key, LossyRuns, SnapshotSize, Story, Tables, TablesState, SEARCH_SCOPE, START,
};
use super::{digest, ms, pass_lease_of, rng, seed, KeyedFaults, Tally};

const TRIGGERS: usize = 8;
/// Concurrent starts of one trigger: scheduler chains, each retrying.
const STARTS: usize = 4;
/// How many times one chain starts its trigger at most.
const START_TRIES: usize = 40;
/// The preparation's lease: the freeze is cut at 1.5 s, the journal at
/// 2.5 s, both counted from before the claim; 1 s of margin (the floor).
const SEARCH_LEASE: Duration = ms(3500);

fn search_claim_fault(rng: &mut StdRng, _: &str) -> Option<Fault> {
    match rng.random_range(0..100) {
        0..10 => Some(Fault::LoseAnswer),
        10..20 => Some(Fault::DelayBefore(ms(rng.random_range(50..300)))),
        20..25 => Some(Fault::DelayAfter(ms(rng.random_range(50..300)))),
        _ => None,
    }
}

/// The journal's deadline is 2.5 s after the claim was asked for: 100–400
/// ms is within it (a freeze that answers takes at most 1.5 s), 3 s beyond
/// it, before the write (it never lands) or after it (it landed, unheard).
fn search_complete_fault(rng: &mut StdRng, _: &str) -> Option<Fault> {
    match rng.random_range(0..100) {
        0..20 => Some(Fault::LoseAnswer),
        20..35 => Some(Fault::DelayBefore(ms(rng.random_range(100..400)))),
        35..43 => Some(Fault::DelayBefore(ms(3000))),
        43..50 => Some(Fault::DelayAfter(ms(3000))),
        50..58 => Some(Fault::refuse_journal()),
        _ => None,
    }
}

fn search_release_fault(rng: &mut StdRng, _: &str) -> Option<Fault> {
    match rng.random_range(0..100) {
        0..15 => Some(Fault::LoseAnswer),
        15..25 => Some(Fault::DelayBefore(ms(rng.random_range(100..400)))),
        _ => None,
    }
}

type Starter = SavedSearchStart<Faulty<PostgrestRepository>, Tables, LossyRuns>;

/// What the starts of one trigger saw.
#[derive(Default)]
struct Starts {
    started: Vec<(u64, StartedRun)>,
    fence_lost: Vec<u64>,
}

/// Everything one scheduler chain needs, owned.
#[derive(Clone)]
struct Scheduler {
    starter: Arc<Starter>,
    db: PgPool,
    org: Uuid,
    seed: u64,
    tally: Tally,
    story: Story,
}

/// A start's ending, for the tally.
fn start_ending(error: &SavedSearchError) -> &'static str {
    match error {
        SavedSearchError::InProgress { .. } => "in_progress",
        SavedSearchError::Snapshot(_) => "snapshot_failed",
        SavedSearchError::NotJournaled { .. } => "not_journaled",
        SavedSearchError::Plane(_) => "plane",
        _ => "other",
    }
}

impl Scheduler {
    /// Chain `chain` of trigger `n`: starts it again after every retryable
    /// ending, until a Run is answered or `START_TRIES` ran out; a start
    /// superseded by another (its fence lost) ends the chain, as the caller
    /// then does nothing more. A start
    /// told the trigger is in progress sometimes takes its holder for
    /// stalled: its lease passes.
    async fn run(self, n: usize, chain: usize, seen: Arc<Mutex<Starts>>) {
        let mut waits = rng(self.seed, &[0x5C4E, n as u64, chain as u64]);
        for try_number in 0..START_TRIES {
            let id = start_id(n, chain, try_number);
            let started = START.scope(id, self.starter.start(self.org, &search_id(n), &format!("tick-{n}"))).await;
            match &started {
                Ok(Started::Run(run)) => self
                    .story
                    .tell_of(id, format!("answered v{} (replayed: {})", run.snapshot["version"], run.replayed)),
                Ok(Started::Superseded) => self.story.tell_of(id, "superseded: its fence was lost; does nothing more"),
                Err(error) => self.story.tell_of(id, format!("ended {error}")),
            }
            match started {
                Ok(Started::Run(started)) => {
                    self.tally.add(if started.replayed { "replayed" } else { "admitted" });
                    return seen.lock().unwrap().started.push((id, started));
                }
                Ok(Started::Superseded) => {
                    self.tally.add("fence_lost");
                    return seen.lock().unwrap().fence_lost.push(id);
                }
                Err(SavedSearchError::InProgress { .. }) if waits.random_bool(0.4) => {
                    self.tally.add("in_progress, lease passed");
                    self.story.tell_of(id, "passes the holder's lease");
                    pass_lease_of(&self.db, self.org, SEARCH_SCOPE, &start_key(n)).await;
                }
                Err(error) if error.is_retryable() => {
                    self.tally.add(start_ending(&error));
                    tokio::time::sleep(ms(waits.random_range(10..150))).await;
                }
                Err(error) => panic!("seed {}: trigger {n}: the start failed for good: {error:?}", self.seed),
            }
        }
    }
}

/// Several concurrent starts of each of several triggers, over a store
/// whose answers are lost, slow or refused, Run admissions whose answers
/// are lost, and freezes that fail, stall past their timeout or past the
/// lease, with small and large snapshots that change from one freeze to
/// the next. Per trigger: one Run under its key; every start answered
/// carries that Run and its input, replays included; a start answered
/// `replayed = false` froze that input itself; a start whose fence was lost
/// neither froze that input nor was answered a Run by an admission; and
/// the completed claim journals that input, inline or by reference to the
/// Run. A trigger whose claim journals another freeze is reported instead
/// of failed only where its story shows the known gap (a claim released
/// after a fenced admission answered a Run; see
/// `a_reclaimed_preparation_whose_freeze_fails_releases_a_claim_whose_run_exists`):
/// once `src` closes it, drop that arm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomized_saved_search_starts_admit_one_run_per_trigger_from_one_frozen_snapshot() {
    let seed = seed("saved-search starts");
    let stack = stack().await;
    let org = Uuid::new_v4();
    let faulty = Faulty::new(PostgrestRepository::new(client(&stack)));
    let story = Story::default();
    let sizes: Vec<SnapshotSize> = (0..TRIGGERS)
        .map(|n| match rng(seed, &[0x517E, n as u64]).random_range(0..3) {
            0 => SnapshotSize::Small,
            1 => SnapshotSize::Large,
            _ => SnapshotSize::Mixed,
        })
        .collect();
    let tables = Tables(Arc::new(TablesState {
        seed,
        db: stack.db().clone(),
        sizes: sizes.clone(),
        chaos: true.into(),
        versions: AtomicUsize::new(0),
        frozen: Mutex::default(),
        story: story.clone(),
    }));
    let keys: Vec<String> = (0..TRIGGERS).map(start_key).collect();
    let runs = LossyRuns {
        inner: PostgrestRepository::new(client(&stack)),
        seed,
        chaos: Arc::new(true.into()),
        lost: Arc::default(),
        answered: Arc::default(),
        story: story.clone(),
    };
    let horizon = RetryHorizon::until_last_attempt(Duration::from_secs(60));
    let starter = SavedSearchStart::new(
        IdempotencyService::new(faulty.clone()),
        RunAdmission::new(runs.clone()),
        tables.clone(),
        horizon,
    )
    .and_then(|starter| starter.with_lease(SEARCH_LEASE))
    .expect("a starter");
    let aimed = KeyedFaults::new(seed, &keys);
    for (op, choose) in [
        (Op::Claim, search_claim_fault as fn(&mut StdRng, &str) -> Option<Fault>),
        (Op::Complete, search_complete_fault),
        (Op::Release, search_release_fault),
    ] {
        let (generators, story) = (aimed.generators.clone(), story.clone());
        faulty.choose_with(op, move |call: &Call<'_>| {
            let key = call.key?;
            let fault = choose(generators.lock().unwrap().get_mut(key)?, key);
            story.tell(format!("{} meets {fault:?}", op.function()));
            fault
        });
    }
    let scheduler = Scheduler {
        starter: Arc::new(starter),
        db: stack.db().clone(),
        org,
        seed,
        tally: Tally::default(),
        story: story.clone(),
    };

    let seen: Vec<Arc<Mutex<Starts>>> = (0..TRIGGERS).map(|_| Arc::default()).collect();
    let mut chains = Vec::new();
    for (n, seen) in seen.iter().enumerate() {
        for chain in 0..STARTS {
            let start = ms(rng(seed, &[0x57A7, n as u64, chain as u64]).random_range(0..600));
            let (scheduler, seen) = (scheduler.clone(), seen.clone());
            chains.push(tokio::spawn(async move {
                tokio::time::sleep(start).await;
                scheduler.run(n, chain, seen).await;
            }));
        }
    }
    for chain in chains {
        chain.await.expect("a start panicked");
    }

    // The faults stop; one more chain per trigger, until it has a Run.
    faulty.clear_all();
    tables.0.chaos.store(false, Ordering::SeqCst);
    runs.chaos.store(false, Ordering::SeqCst);
    for (n, seen) in seen.iter().enumerate() {
        scheduler.clone().run(n, STARTS, seen.clone()).await;
    }
    println!(
        "saved-search starts: {} freezes; starts {}; faults injected: claim {}, complete {}, release {}, admission answers lost {}",
        tables.freezes(),
        scheduler.tally,
        faulty.injected(Op::Claim),
        faulty.injected(Op::Complete),
        faulty.injected(Op::Release),
        runs.lost.load(Ordering::SeqCst),
    );

    let rows: Vec<(Uuid, String, Value)> =
        sqlx::query_as("select id, start_key, input from agent.runs where organization_id = $1")
            .bind(org)
            .fetch_all(stack.db())
            .await
            .expect("read the Runs");
    assert_eq!(rows.len(), TRIGGERS, "seed {seed}: one Run per trigger, none under another key: {rows:?}");
    let answered = runs.answered.lock().unwrap().clone();
    for (n, seen) in seen.iter().enumerate() {
        let context = format!("seed {seed}, trigger {n} ({:?}); its starts:\n{}\n", sizes[n], story.of(n));
        let seen = std::mem::take(&mut *seen.lock().unwrap());
        let (_, last) = seen.started.last().unwrap_or_else(|| panic!("{context}: no start was answered a Run"));
        let run_key = last.run.start_key.clone();
        let under_key: Vec<_> = rows.iter().filter(|(_, key, _)| *key == run_key).collect();
        assert_eq!(under_key.len(), 1, "{context}: Runs under {run_key}: {under_key:?}");
        let (run_id, _, input) = under_key[0].clone();
        let froze_it = tables.frozen_by(&input).unwrap_or_else(|| panic!("{context}: no freeze made {input}"));
        assert_eq!(input["saved_search_id"], json!(search_id(n)), "{context}: another trigger's snapshot");
        for (start, started) in &seen.started {
            let what = format!("{context}, start {start:#x}");
            assert_eq!((started.run.id, &started.run.start_key), (run_id, &run_key), "{what}");
            assert_eq!(started.snapshot, input, "{what}: answered another snapshot than the Run's input");
            assert_eq!(started.run.input, input, "{what}");
            assert!(started.run.admitted, "{what}: a start of the trigger is its Run's admitter");
            if !started.replayed {
                assert_eq!(
                    *start, froze_it,
                    "{what}: answered replayed = false, yet the Run holds the freeze of start {froze_it:#x}"
                );
            }
        }
        for start in &seen.fence_lost {
            let what = format!("{context}, start {start:#x}, whose fence was lost");
            assert_ne!(*start, froze_it, "{what}: its snapshot is the Run's input");
            let admitted: Vec<_> = answered.iter().filter(|(by, _)| by == start).collect();
            assert!(admitted.is_empty(), "{what}: an admission answered it a Run: {admitted:?}");
        }

        let (status, response, resource_type, resource_id): (String, Option<Value>, Option<String>, Option<String>) =
            sqlx::query_as(
                "select status, response, resource_type, resource_id from agent.idempotency_keys
                  where organization_id = $1 and scope = $2 and key = $3",
            )
            .bind(org)
            .bind(SEARCH_SCOPE)
            .bind(start_key(n))
            .fetch_one(stack.db())
            .await
            .unwrap_or_else(|error| panic!("{context}: the claim: {error}"));
        assert_eq!(status, "completed", "{context}");
        let response = response.unwrap_or_else(|| panic!("{context}: a completed claim without a response"));
        let prepared = json!({"run_key": run_key, "snapshot": input});
        let output = &response["output"];
        match output.get("$response_ref") {
            Some(reference) => {
                let (size, sha256) = digest(&prepared);
                let expected = json!({"resource_type": SNAPSHOT_RESOURCE_TYPE, "resource_id": run_id, "size": size, "sha256": sha256});
                assert_eq!(reference, &expected, "{context}: the claim references another snapshot or Run");
                let resource = (resource_type.as_deref(), resource_id);
                assert_eq!(resource, (Some(SNAPSHOT_RESOURCE_TYPE), Some(run_id.to_string())), "{context}");
            }
            None => {
                let journaled = output["snapshot"]["version"].clone();
                assert!(
                    output == &prepared,
                    "{context}: the claim journals snapshot version {journaled}, the Run holds version {} (frozen by start {froze_it:#x})",
                    input["version"]
                );
            }
        }
    }
    stack.stop().await.unwrap();
}

/// A source for the known gap's test: answers `version` (padded above the
/// claim's limit when `large`), or fails.
struct Version {
    version: u64,
    large: bool,
    fails: bool,
}

impl SnapshotSource for Version {
    async fn freeze(&self, _: Uuid, saved_search_id: &str) -> Result<Value, SnapshotError> {
        if self.fails {
            return Err(SnapshotError(format!("the tables of {saved_search_id} are locked")));
        }
        let mut snapshot = json!({"saved_search_id": saved_search_id, "version": self.version});
        if self.large {
            snapshot["rows"] = json!("r".repeat(100 * 1024));
        }
        Ok(snapshot)
    }
}

/// Found by the randomized start test: a reclaimed preparation whose
/// earlier holder admitted a Run under the claim and died before its
/// journal landed journals that Run's input, and freezes nothing (here its
/// source would fail). Before, it froze, failed, released the claim, and
/// the next start journaled a snapshot no Run was started from.
#[tokio::test]
async fn a_reclaimed_preparation_journals_the_run_an_earlier_holder_admitted_instead_of_freezing_again() {
    let stack = stack().await;
    let org = Uuid::new_v4();
    let faulty = Faulty::new(PostgrestRepository::new(client(&stack)));
    let horizon = RetryHorizon::until_last_attempt(Duration::from_secs(60));
    let starter = |source: Version| {
        SavedSearchStart::new(
            IdempotencyService::new(faulty.clone()),
            RunAdmission::new(PostgrestRepository::new(client(&stack))),
            source,
            horizon,
        )
        .and_then(|starter| starter.with_lease(SEARCH_LEASE))
        .expect("a starter")
    };
    // A freezes a large snapshot, admits its Run under the claim's fence,
    // and dies before its journal lands.
    faulty.once(Op::Complete, Fault::DelayBefore(Duration::from_secs(60)));
    let a = {
        let starter = starter(Version { version: 1, large: true, fails: false });
        tokio::spawn(async move { starter.start(org, "search-gap", "tick-1").await })
    };
    let admitted = async {
        while crate::support::harness::count_runs(&stack).await == 0 {
            tokio::time::sleep(ms(10)).await;
        }
    };
    crate::support::harness::within(WAIT, "A admits its Run", admitted).await;
    a.abort();
    let _ = a.await;
    faulty.clear_all();
    let key = "10:search-gap:tick-1";
    assert_eq!(holder(stack.db(), org, key).await.map(|(_, status)| status).as_deref(), Some("processing"));

    // Its lease passes; B reclaims: it finds A's Run and journals it, and
    // never calls its source (which would fail).
    pass_lease_of(stack.db(), org, SEARCH_SCOPE, key).await;
    let b = starter(Version { version: 2, large: false, fails: true }).start(org, "search-gap", "tick-1").await;
    let b = b.expect("B answers A's Run").into_run().expect("a Run");
    assert_eq!(b.snapshot["version"], json!(1), "the Run A admitted wins");

    // C starts the trigger: it answers A's Run, and its claim must say so.
    let c = starter(Version { version: 3, large: false, fails: false }).start(org, "search-gap", "tick-1").await;
    let c = c.expect("C answers the Run").into_run().expect("a Run");
    assert_eq!(c.snapshot["version"], json!(1), "the Run A admitted wins");
    let (response,): (Value,) = sqlx::query_as(
        "select response from agent.idempotency_keys where organization_id = $1 and scope = $2 and key = $3",
    )
    .bind(org)
    .bind(SEARCH_SCOPE)
    .bind(key)
    .fetch_one(stack.db())
    .await
    .expect("C's claim");
    let output = &response["output"];
    let journaled = match output.get("$response_ref") {
        Some(reference) if reference["resource_id"] == json!(c.run.id) => json!(1),
        Some(reference) => panic!("the claim references another Run: {reference}"),
        None => output["snapshot"]["version"].clone(),
    };
    assert_eq!(journaled, json!(1), "the claim journals snapshot v{journaled}, the Run holds v1: {output}");
    stack.stop().await.unwrap();
}
