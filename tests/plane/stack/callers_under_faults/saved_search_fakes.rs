//! What the saved-search start runs against under faults: product tables
//! that change from one freeze to the next, Run admission whose answers are
//! lost, and the story of each start for the message of a failed check.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_plane::callers::saved_search::{SnapshotError, SnapshotSource, SAVED_SEARCH_START_SCOPE};
use idempotency_plane::repo::{AdmittedRun, ClaimFence, RunRepository};
use idempotency_plane::{ClientError, Error, PostgrestRepository};
use rand::rngs::StdRng;
use rand::Rng;
use serde_json::{json, Value};
use sqlx::PgPool;
use uuid::Uuid;

use super::{ms, pass_lease_of, rng};

pub(super) const SEARCH_SCOPE: &str = SAVED_SEARCH_START_SCOPE;
/// The freeze's timeout.
const FREEZE_TIMEOUT: Duration = ms(1500);

tokio::task_local! {
    /// The start (one call of `SavedSearchStart::start`) this task runs:
    /// the freeze and the admissions it makes are counted as its own.
    pub(super) static START: u64;
}

/// One start's identity: its trigger, its chain and its try.
pub(super) fn start_id(trigger: usize, chain: usize, try_number: usize) -> u64 {
    (trigger as u64) << 32 | (chain as u64) << 16 | try_number as u64
}

/// The claim key `SavedSearchStart::start` derives for trigger `n`.
pub(super) fn start_key(n: usize) -> String {
    let search = search_id(n);
    format!("{}:{search}:tick-{n}", search.len())
}

pub(super) fn search_id(n: usize) -> String {
    format!("search-{n}")
}

/// How large a trigger's snapshots are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SnapshotSize {
    /// Within the 64 KiB a claim keeps: journaled inline.
    Small,
    /// Above it: kept as the Run's input, referenced from the claim.
    Large,
    /// Either, from one freeze to the next.
    Mixed,
}

/// What one freeze does, drawn per start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FreezeTry {
    /// Reads the tables and answers.
    Normal,
    /// The tables cannot be read: the claim is released.
    Fails,
    /// Stalls past the freeze's timeout: cut, the claim released.
    Stalls,
    /// Stalls past the lease, by the database's clock (moved in SQL): the
    /// freeze answers after another start reclaimed, or after 800 ms.
    LeasePasses,
}

fn freeze_try(rng: &mut StdRng) -> FreezeTry {
    match rng.random_range(0..100) {
        0..10 => FreezeTry::Fails,
        10..16 => FreezeTry::Stalls,
        16..30 => FreezeTry::LeasePasses,
        _ => FreezeTry::Normal,
    }
}

/// Mutable product tables: every freeze reads a newer version (numbered
/// across all triggers), so the freeze whose snapshot was stored can be
/// told, and which start froze it.
#[derive(Clone)]
pub(super) struct Tables(pub(super) Arc<TablesState>);

pub(super) struct TablesState {
    pub(super) seed: u64,
    pub(super) db: PgPool,
    pub(super) sizes: Vec<SnapshotSize>,
    pub(super) chaos: std::sync::atomic::AtomicBool,
    pub(super) versions: AtomicUsize,
    /// Which start froze each version.
    pub(super) frozen: Mutex<HashMap<u64, u64>>,
    pub(super) story: Story,
}

impl Tables {
    /// The start that froze `snapshot`.
    pub(super) fn frozen_by(&self, snapshot: &Value) -> Option<u64> {
        let version = snapshot["version"].as_u64()?;
        self.0.frozen.lock().unwrap().get(&version).copied()
    }

    pub(super) fn freezes(&self) -> usize {
        self.0.versions.load(Ordering::SeqCst)
    }
}

impl SnapshotSource for Tables {
    async fn freeze(&self, organization_id: Uuid, saved_search_id: &str) -> Result<Value, SnapshotError> {
        let tables = &self.0;
        let start = START.try_with(|start| *start).expect("a freeze inside a start");
        let n: usize = saved_search_id.strip_prefix("search-").and_then(|n| n.parse().ok()).expect("a search id");
        let mut draw = rng(tables.seed, &[0xF2EE, start]);
        let behaviour = if tables.chaos.load(Ordering::SeqCst) { freeze_try(&mut draw) } else { FreezeTry::Normal };
        let version = tables.versions.fetch_add(1, Ordering::SeqCst) as u64 + 1;
        match behaviour {
            FreezeTry::Normal => tokio::time::sleep(ms(draw.random_range(5..60))).await,
            FreezeTry::Fails => {
                tables.story.tell("freeze failed");
                return Err(SnapshotError(format!("the tables of {saved_search_id} are locked")));
            }
            FreezeTry::Stalls => {
                tables.story.tell("freeze stalls past its timeout");
                tokio::time::sleep(FREEZE_TIMEOUT * 2).await;
            }
            FreezeTry::LeasePasses => {
                let key = start_key(n);
                let held = holder(&tables.db, organization_id, &key).await;
                pass_lease_of(&tables.db, organization_id, SEARCH_SCOPE, &key).await;
                let reclaimed = async {
                    while holder(&tables.db, organization_id, &key).await == held {
                        tokio::time::sleep(ms(20)).await;
                    }
                };
                let _ = tokio::time::timeout(ms(800), reclaimed).await;
            }
        }
        let large = match tables.sizes[n] {
            SnapshotSize::Small => false,
            SnapshotSize::Large => true,
            SnapshotSize::Mixed => draw.random_bool(0.5),
        };
        let mut snapshot = json!({
            "organization_id": organization_id,
            "saved_search_id": saved_search_id,
            "version": version,
            "brief": format!("brief v{version}"),
            "baseline": [version, n],
        });
        if large {
            snapshot["rows"] = json!("r".repeat(draw.random_range(70..140) * 1024));
        }
        tables.frozen.lock().unwrap().insert(version, start);
        tables.story.tell(format!("froze v{version} ({behaviour:?}{})", if large { ", large" } else { "" }));
        Ok(snapshot)
    }
}

/// What happened to each start, in order, for the message of a failed
/// check: its freeze, the faults its calls met, its admissions, its ending.
#[derive(Clone, Default)]
pub(super) struct Story(Arc<Mutex<Vec<(u64, String)>>>);

impl Story {
    /// Tells `what` of the start running in this task, if any.
    pub(super) fn tell(&self, what: impl Into<String>) {
        if let Ok(start) = START.try_with(|start| *start) {
            self.tell_of(start, what);
        }
    }

    pub(super) fn tell_of(&self, start: u64, what: impl Into<String>) {
        self.0.lock().unwrap().push((start, what.into()));
    }

    /// Trigger `n`'s story, one line per event.
    pub(super) fn of(&self, n: usize) -> String {
        let events = self.0.lock().unwrap();
        let lines = events.iter().filter(|(start, _)| (start >> 32) as usize == n);
        lines.map(|(start, what)| format!("  start {start:#x}: {what}")).collect::<Vec<_>>().join("\n")
    }
}

/// The lease token and status of `key`'s claim, if there is one.
pub(super) async fn holder(db: &PgPool, org: Uuid, key: &str) -> Option<(Uuid, String)> {
    sqlx::query_as(
        "select lease_token, status from agent.idempotency_keys
          where organization_id = $1 and scope = $2 and key = $3",
    )
    .bind(org)
    .bind(SEARCH_SCOPE)
    .bind(key)
    .fetch_optional(db)
    .await
    .expect("read the claim")
}

/// Run admission whose answers are sometimes lost after the Run was
/// admitted (or the fence refused), drawn per start (a start admits once at
/// most); records, per start, the admissions that answered a Run.
#[derive(Clone)]
pub(super) struct LossyRuns {
    pub(super) inner: PostgrestRepository,
    pub(super) seed: u64,
    pub(super) chaos: Arc<std::sync::atomic::AtomicBool>,
    pub(super) lost: Arc<AtomicUsize>,
    pub(super) answered: Arc<Mutex<Vec<(u64, Uuid)>>>,
    pub(super) story: Story,
}

impl LossyRuns {
    /// Whether this admission's answer is lost: 12% while the chaos lasts.
    fn loses(&self) -> bool {
        let start = START.try_with(|start| *start).expect("an admission inside a start");
        self.chaos.load(Ordering::SeqCst) && rng(self.seed, &[0xAD17, start]).random_range(0..100) < 12
    }

    fn answer<T>(
        &self,
        call: &str,
        answered: Result<T, Error>,
        lose: bool,
        run: impl Fn(&T) -> Option<(Uuid, Value)>,
    ) -> Result<T, Error> {
        let answered = answered.inspect_err(|error| self.story.tell(format!("{call} failed: {error}")))?;
        let version = |answered: &T| run(answered).map(|(_, input)| input["version"].clone());
        self.story.tell(format!(
            "{call} answered Run v{:?}{}",
            version(&answered),
            if lose { ", answer lost" } else { "" }
        ));
        if lose {
            self.lost.fetch_add(1, Ordering::SeqCst);
            return Err(Error::Store(ClientError::DeadlineExceeded {
                function: "run_admit",
                deadline: ms(0),
                elapsed: ms(0),
                attempts: 1,
                in_flight: true,
                last_error: None,
            }));
        }
        if let (Some((id, _)), Ok(start)) = (run(&answered), START.try_with(|start| *start)) {
            self.answered.lock().unwrap().push((start, id));
        }
        Ok(answered)
    }
}

impl RunRepository for LossyRuns {
    async fn admit(
        &self,
        organization_id: Uuid,
        start_key: &str,
        input: &Value,
        admission_token: Uuid,
        max_run_duration: Option<std::time::Duration>,
    ) -> Result<AdmittedRun, Error> {
        let lose = self.loses();
        let admitted = self.inner.admit(organization_id, start_key, input, admission_token, max_run_duration).await;
        self.answer("admit", admitted, lose, |run| Some((run.id, run.input.clone())))
    }

    async fn admit_fenced(
        &self,
        organization_id: Uuid,
        start_key: &str,
        input: &Value,
        admission_token: Uuid,
        fence: ClaimFence,
    ) -> Result<Option<AdmittedRun>, Error> {
        let lose = self.loses();
        let admitted = self.inner.admit_fenced(organization_id, start_key, input, admission_token, fence).await;
        self.answer("admit_fenced", admitted, lose, |run| run.as_ref().map(|run| (run.id, run.input.clone())))
    }

    async fn find(
        &self,
        organization_id: Uuid,
        start_key: &str,
        admission_token: Option<Uuid>,
    ) -> Result<Option<AdmittedRun>, Error> {
        self.inner.find(organization_id, start_key, admission_token).await
    }
}
