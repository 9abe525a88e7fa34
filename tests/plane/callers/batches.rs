//! The batch driver: many effects claimed in one round trip, each ended
//! journaled, released or left to its lease exactly as a single effect is,
//! with the journals and the releases written one round trip per kind; and
//! when a batch call fails, each item falls back to its own ending's rules.
//! Every case runs on the in-memory repository and on the real stack, both
//! wrapped in [`Faulty`].

use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_plane::repo::{BatchClaims, ClaimStatus};
use idempotency_plane::service::{Answer, Batch, BatchItem, Begun, Effect, EffectDriver, Settle, Settled, Timing};
use idempotency_plane::{IdempotencyRepository, IdempotencyService, RequestHash};
use serde_json::json;
use uuid::Uuid;

use crate::support::backends::TimeTravel;
use crate::support::faults::{Fault, Faulty, Op};

/// What a case needs of the repository under the wrapper.
pub(crate) trait Repo: IdempotencyRepository + BatchClaims + Debug + 'static {}
impl<T: IdempotencyRepository + BatchClaims + Debug + 'static> Repo for T {}

const SCOPE: &str = "tool.batch";

/// Effect 2 s, journal 3 s, margin 1 s.
fn timing() -> Timing {
    Timing::new(Duration::from_secs(2), Duration::from_secs(3), Duration::from_secs(1)).expect("a valid timing")
}

/// How often each key's effect ran.
#[derive(Clone, Default)]
struct Runs(Arc<Mutex<HashMap<String, u32>>>);

impl Runs {
    fn ran(&self, key: &str) {
        *self.0.lock().expect("runs").entry(key.to_owned()).or_default() += 1;
    }

    fn of(&self, key: &str) -> u32 {
        self.0.lock().expect("runs").get(key).copied().unwrap_or(0)
    }
}

struct Fixture<R> {
    faulty: Faulty<R>,
    driver: EffectDriver<Faulty<R>>,
    org: Uuid,
    hash: RequestHash,
    runs: Runs,
}

fn fixture<R: Repo>(faulty: Faulty<R>) -> Fixture<R> {
    let driver = EffectDriver::new(IdempotencyService::new(faulty.clone()));
    Fixture {
        faulty,
        driver,
        org: Uuid::new_v4(),
        hash: RequestHash::of_json(&json!({"batch": 1})),
        runs: Runs::default(),
    }
}

impl<R: Repo> Fixture<R> {
    fn items<'a>(&'a self, keys: &'a [&'a str]) -> Vec<BatchItem<'a>> {
        keys.iter().map(|key| BatchItem { key, request_hash: &self.hash, request: None }).collect()
    }

    fn batch<'a>(&self, items: &'a [BatchItem<'a>]) -> Batch<'a> {
        Batch { organization_id: self.org, scope: SCOPE, timing: timing(), items }
    }

    /// Drives `keys`, each effect ending as `ending` says for its key.
    async fn drive(&self, keys: &[&str], ending: impl Fn(&str) -> Settle) -> Vec<&'static str> {
        let items = self.items(keys);
        let report = self
            .driver
            .drive_many(&self.batch(&items), 4, |index, claim| {
                let key = keys[index];
                assert_eq!(claim.key(), key, "the effect gets its own item's claim");
                self.runs.ran(key);
                let settle = ending(key);
                async move {
                    if key.starts_with("panic") {
                        panic!("the effect of {key} panicked");
                    }
                    settle
                }
            })
            .await
            .expect("the batch is claimed");
        report.items.iter().map(|item| item.as_str()).collect()
    }

    async fn status(&self, key: &str) -> Option<ClaimStatus> {
        self.faulty.inner().get(self.org, SCOPE, key).await.expect("a read").map(|row| row.status)
    }

    /// A single effect's claim of `key` under `hash`, journaled or left held.
    async fn single(&self, key: &str, hash: &RequestHash, journal: bool) {
        let effect = Effect {
            organization_id: self.org,
            scope: SCOPE,
            key,
            request_hash: hash,
            timing: timing(),
            request: None,
        };
        let Begun::Held(held) = self.driver.begin(&effect).await.expect("a claim") else { panic!("{key} is free") };
        if journal {
            let settled = held.settle(Settle::Journal(Answer::success(json!({"single": key})))).await;
            assert!(settled.is_journaled(), "{settled:?}");
        } else {
            std::mem::forget(held);
        }
    }
}

fn ending(key: &str) -> Settle {
    match key {
        k if k.starts_with("release") => Settle::Release,
        k if k.starts_with("unknown") => Settle::Unknown("the vendor did not answer"),
        k => Settle::Journal(Answer::success(json!({"sent": k}))),
    }
}

/// Every outcome and every ending in one batch: one round trip to claim,
/// one to journal, one to release; each item ends as a single effect would.
async fn each_item_ends_as_a_single_effect_would_with_one_round_trip_per_kind<R: Repo>(
    faulty: Faulty<R>,
    _: &impl TimeTravel,
) {
    let f = fixture(faulty);
    f.single("done", &f.hash, true).await;
    f.single("held", &f.hash, false).await;
    f.single("conflict", &RequestHash::of_json(&json!({"another": 1})), true).await;
    let keys = ["done", "held", "conflict", "j-1", "j-2", "release-1", "unknown-1", "panic-1"];
    let singles = |f: &Fixture<R>| [Op::Complete, Op::Release, Op::Claim].map(|op| f.faulty.calls(op));
    let before = singles(&f);

    let endings = f.drive(&keys, ending).await;

    assert_eq!(
        endings,
        ["replayed", "in_flight", "conflict", "journaled", "journaled", "released", "left_to_lease", "left_to_lease"]
    );
    assert_eq!(
        [f.faulty.calls(Op::ClaimMany), f.faulty.calls(Op::CompleteMany), f.faulty.calls(Op::ReleaseMany)],
        [1, 1, 1],
        "one round trip per kind"
    );
    assert_eq!(singles(&f), before, "no item was claimed or ended on its own");
    assert_eq!(f.status("j-1").await, Some(ClaimStatus::Completed));
    assert_eq!(f.status("release-1").await, None, "released: the next attempt runs");
    assert_eq!(f.status("unknown-1").await, Some(ClaimStatus::Processing), "left to its lease");
    assert_eq!(f.status("panic-1").await, Some(ClaimStatus::Processing), "a panic leaves it to its lease");
    for key in ["done", "held", "conflict"] {
        assert_eq!(f.runs.of(key), 0, "{key} never ran");
    }

    // The same batch again: the journaled replay, the released one runs
    // again, the ones left to their lease are in flight.
    let again = f.drive(&keys, ending).await;
    assert_eq!(
        again,
        ["replayed", "in_flight", "conflict", "replayed", "replayed", "released", "in_flight", "in_flight"]
    );
    assert_eq!([f.runs.of("j-1"), f.runs.of("release-1"), f.runs.of("unknown-1")], [1, 2, 1]);
}

/// The batch journal is refused (as the store refuses a batch for one
/// item's answer): every item is then journaled on its own.
async fn a_batch_journal_refused_for_one_item_journals_each_item_alone<R: Repo>(
    faulty: Faulty<R>,
    _: &impl TimeTravel,
) {
    let f = fixture(faulty);
    f.faulty.once(Op::CompleteMany, Fault::refuse_journal());
    let keys = ["a", "b", "c"];
    let endings = f.drive(&keys, ending).await;
    assert_eq!(endings, ["journaled", "journaled", "journaled"]);
    assert_eq!((f.faulty.calls(Op::CompleteMany), f.faulty.calls(Op::Complete)), (1, 3));
    for key in keys {
        assert_eq!((f.status(key).await, f.runs.of(key)), (Some(ClaimStatus::Completed), 1));
    }
}

/// The batch journal commits and its answer is lost: each item's own
/// journal finds its answer stored (a repeat with the same token).
async fn a_lost_batch_journal_ends_journaled_item_by_item<R: Repo>(faulty: Faulty<R>, _: &impl TimeTravel) {
    let f = fixture(faulty);
    f.faulty.once(Op::CompleteMany, Fault::LoseAnswer);
    let endings = f.drive(&["a", "b"], ending).await;
    assert_eq!(endings, ["journaled", "journaled"]);
    assert_eq!(f.faulty.reached(Op::CompleteMany), 1, "the batch landed");
    let replays = f.drive(&["a", "b"], ending).await;
    assert_eq!(replays, ["replayed", "replayed"]);
    assert_eq!([f.runs.of("a"), f.runs.of("b")], [1, 1]);
}

/// The batch release commits and its answer is lost: each item's release
/// deletes nothing, and the row, gone, says the first one landed.
async fn a_lost_batch_release_is_checked_against_the_rows_and_ends_released<R: Repo>(
    faulty: Faulty<R>,
    _: &impl TimeTravel,
) {
    let f = fixture(faulty);
    f.faulty.once(Op::ReleaseMany, Fault::LoseAnswer);
    let endings = f.drive(&["release-a", "release-b"], ending).await;
    assert_eq!(endings, ["released", "released"]);
    assert_eq!((f.status("release-a").await, f.status("release-b").await), (None, None));
}

/// The batch claim commits and its answer is lost: asked again with the
/// same tokens, each claim is this batch's own, and each effect runs once.
async fn a_lost_batch_claim_is_asked_again_as_the_same_claims<R: Repo>(faulty: Faulty<R>, _: &impl TimeTravel) {
    let f = fixture(faulty);
    f.faulty.once(Op::ClaimMany, Fault::LoseAnswer);
    let endings = f.drive(&["a", "b", "c"], ending).await;
    assert_eq!(endings, ["journaled", "journaled", "journaled"]);
    assert_eq!(f.faulty.calls(Op::ClaimMany), 2);
    assert_eq!([f.runs.of("a"), f.runs.of("b"), f.runs.of("c")], [1, 1, 1]);
}

/// A batch whose items all end their own way reports the failures a queue
/// must deliver again, never the whole batch.
async fn the_report_lists_exactly_the_items_that_are_not_done<R: Repo>(faulty: Faulty<R>, _: &impl TimeTravel) {
    let f = fixture(faulty);
    f.single("held", &f.hash, false).await;
    let keys = ["ok-1", "held", "release-1", "ok-2", "unknown-1"];
    let items = f.items(&keys);
    let report = f
        .driver
        .drive_many(&f.batch(&items), 2, |index, _| {
            let settle = ending(keys[index]);
            async move { settle }
        })
        .await
        .expect("a batch");
    assert_eq!(report.failures(), [1, 2, 4]);
    assert_eq!((report.ran(), report.replayed()), (4, 0));
    let answer = report.items[0].answer().expect("done");
    assert_eq!(answer.output, json!({"sent": "ok-1"}));
    let _: &Settled = match &report.items[3] {
        idempotency_plane::service::ItemEnding::Ran(settled) => settled,
        other => panic!("{other:?}"),
    };
}

macro_rules! batches {
    ($($case:ident),* $(,)?) => {
        mod in_memory {
            $(
                #[tokio::test]
                async fn $case() {
                    let faulty = crate::support::faults::Faulty::new(idempotency_plane::MemoryRepository::new());
                    super::$case(faulty.clone(), faulty.inner()).await;
                }
            )*
        }

        #[cfg(feature = "local")]
        mod on_the_stack {
            $(
                #[tokio::test]
                async fn $case() {
                    let stack = crate::support::harness::stack().await;
                    let repo = idempotency_plane::PostgrestRepository::new(crate::support::harness::client(&stack));
                    super::$case(crate::support::faults::Faulty::new(repo), &stack).await;
                    stack.stop().await.unwrap();
                }
            )*
        }
    };
}

batches!(
    each_item_ends_as_a_single_effect_would_with_one_round_trip_per_kind,
    a_batch_journal_refused_for_one_item_journals_each_item_alone,
    a_lost_batch_journal_ends_journaled_item_by_item,
    a_lost_batch_release_is_checked_against_the_rows_and_ends_released,
    a_lost_batch_claim_is_asked_again_as_the_same_claims,
    the_report_lists_exactly_the_items_that_are_not_done,
);
