//! An in-memory repository: the plane's SQL semantics in one process.
//!
//! For unit tests of services and callers that need no database, and for
//! trying the crate out. The same conformance suite runs against it and
//! against PostgreSQL behind a PostgREST server, so it cannot quietly
//! disagree with the real plane. Time is the process's clock plus an offset
//! a test can [`advance`](MemoryRepository::advance); one mutex makes every
//! call atomic, as one SQL statement is.
//!
//! The store and its clock live here; the functions over each table in a
//! file of their own: the claim table (`claims`), its journaled failures
//! (`failures`), Run admission and provider jobs (`runs`).

mod batch;
mod claims;
mod failures;
mod runs;

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use uuid::Uuid;

use crate::error::Error;
use crate::postgrest::{codes, ClientError, PostgrestError};
use crate::repo::{AdmittedRun, IdempotencyRecord, ProviderJob};
use crate::storable::MAX_POLICY_RESPONSE_BYTES;

/// Every repository trait, in memory. Cheap to share behind an `Arc`.
#[derive(Debug)]
pub struct MemoryRepository {
    state: Mutex<State>,
}

/// The row cap bounded reads may not exceed, as PostgREST's `db-max-rows`
/// (Supabase's default `api.max_rows`).
const MAX_BOUND: u64 = 1000;

#[derive(Debug, Default)]
struct State {
    offset: TimeDelta,
    policies: Vec<Policy>,
    claims: HashMap<(Uuid, String, String), Row>,
    runs: HashMap<(Uuid, String), (AdmittedRun, Uuid)>,
    jobs: HashMap<(String, String), ProviderJob>,
}

/// A row of the scope policy table: an exact scope or a family (`tool.*`).
#[derive(Debug, Clone)]
struct Policy {
    scope: String,
    retain: TimeDelta,
    max_response_bytes: u64,
    max_request_bytes: u64,
    max_attempts: u32,
}

/// The seeded `max_request_bytes` and `max_attempts` of every policy, as the
/// table's column defaults.
const DEFAULT_MAX_REQUEST_BYTES: u64 = 65_536;
const DEFAULT_MAX_ATTEMPTS: u32 = 5;

#[derive(Debug, Clone)]
struct Row {
    record: IdempotencyRecord,
    reclaims: u32,
    /// The work the claim carries.
    request: Option<serde_json::Value>,
    /// What sending it back to re-drive replaced, oldest first.
    replaced: Vec<serde_json::Value>,
}

impl Default for MemoryRepository {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryRepository {
    /// An empty plane with the seeded policies (`tool.*` 30 days,
    /// `webhook.*`, `surface.saved_search.start` and `http.*` 24 hours, `queue.*` 7 days,
    /// 64 KiB each, except the 384 KiB of work `webhook.*` keeps,
    /// [`WEBHOOK_SCOPE_MAX_REQUEST_BYTES`](crate::callers::webhook::WEBHOOK_SCOPE_MAX_REQUEST_BYTES))
    /// and a row cap of 1000 for bounded reads.
    pub fn new() -> Self {
        let policy = |scope: &str, days| Policy {
            scope: scope.to_owned(),
            retain: TimeDelta::days(days),
            max_response_bytes: 65_536,
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
        };
        let webhooks = Policy {
            max_request_bytes: crate::callers::webhook::WEBHOOK_SCOPE_MAX_REQUEST_BYTES,
            ..policy("webhook.*", 1)
        };
        let policies = vec![
            policy("tool.*", 30),
            webhooks,
            policy("surface.saved_search.start", 1),
            policy("http.*", 1),
            policy("queue.*", 7),
        ];
        MemoryRepository { state: Mutex::new(State { policies, ..State::default() }) }
    }

    /// Adds (or replaces) a scope's policy, as a migration would. Refuses a
    /// tool scope under 30 days and a limit outside 1 KiB to
    /// [`MAX_POLICY_RESPONSE_BYTES`], as
    /// the table's checks do.
    pub fn with_policy(self, scope: &str, retain: Duration, max_response_bytes: u64) -> Result<Self, Error> {
        let retain = TimeDelta::from_std(retain).map_err(|_| refused("idempotency_scopes", codes::CHECK_VIOLATION))?;
        let largest = 1024..=MAX_POLICY_RESPONSE_BYTES;
        if (scope.starts_with("tool.") && retain < TimeDelta::days(30)) || !largest.contains(&max_response_bytes) {
            return Err(refused("idempotency_scopes", codes::CHECK_VIOLATION));
        }
        {
            let mut state = self.lock();
            state.policies.retain(|p| p.scope != scope);
            state.policies.push(Policy {
                scope: scope.to_owned(),
                retain,
                max_response_bytes,
                max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
                max_attempts: DEFAULT_MAX_ATTEMPTS,
            });
        }
        Ok(self)
    }

    /// Sets how often a scope's stored work may be handed out before a
    /// re-drive journals it as a dead letter (the policy's `max_attempts`,
    /// 1 to 100, default 5). The scope must have a policy row of its own.
    pub fn with_max_attempts(self, scope: &str, max_attempts: u32) -> Result<Self, Error> {
        {
            let mut state = self.lock();
            let policy = state.policies.iter_mut().find(|p| p.scope == scope);
            match policy {
                Some(policy) if (1..=100).contains(&max_attempts) => policy.max_attempts = max_attempts,
                _ => return Err(refused("idempotency_scopes", codes::CHECK_VIOLATION)),
            }
        }
        Ok(self)
    }

    /// Moves this plane's clock forward, as waiting would.
    pub fn advance(&self, by: Duration) {
        let mut state = self.lock();
        state.offset += TimeDelta::from_std(by).unwrap_or(TimeDelta::MAX);
    }

    /// Moves a claim's lease into the past, as if it had passed (the
    /// in-memory twin of rewriting its timestamps in SQL).
    pub fn pass_lease(&self, claim_id: Uuid) {
        let mut state = self.lock();
        let now = state.now();
        if let Some(row) = state.claims.values_mut().find(|row| row.record.id == claim_id) {
            let moved = row.record.lease_expires_at - now + TimeDelta::seconds(1);
            row.record.lease_expires_at -= moved;
            row.record.claimed_at -= moved;
        }
    }

    /// Claims held now, completed or not.
    pub fn len(&self) -> usize {
        self.lock().claims.len()
    }

    /// True when no claim is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves whole rows (every change is
        // one assignment), so the state is still consistent.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
/// The error PostgREST answers when the database refuses a call with `code`.
fn refused(function: &'static str, code: &str) -> Error {
    let status = if code == codes::UNIQUE_VIOLATION { 409 } else { 400 };
    Error::Store(ClientError::Api {
        function,
        status,
        error: Box::new(PostgrestError {
            code: code.to_owned(),
            message: format!("refused by the in-memory plane ({code})"),
            details: None,
            hint: None,
        }),
        retry_after: None,
    })
}

impl State {
    fn now(&self) -> DateTime<Utc> {
        Utc::now() + self.offset
    }

    /// The scope's policy: its exact row, else the longest family it extends.
    fn policy(&self, scope: &str) -> Option<&Policy> {
        self.policies
            .iter()
            .filter(|p| {
                p.scope == scope
                    || p.scope
                        .strip_suffix('*')
                        .is_some_and(|prefix| scope.len() > prefix.len() && scope.starts_with(prefix))
            })
            .max_by_key(|p| (p.scope == scope, p.scope.len()))
    }
}
