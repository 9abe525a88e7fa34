//! The demo's findings, its checks, and the table it prints.

use std::time::Duration;

use idempotency_plane::Ending;

use crate::vendor::Sent;
use crate::worker::{StaleEndings, SCOPE};

/// Counts over the whole run.
#[derive(Debug, Clone, Default)]
pub(crate) struct Totals {
    pub(crate) tool_calls: u64,
    pub(crate) attempts: u64,
    pub(crate) executions: u64,
    pub(crate) vendor_messages: u64,
    pub(crate) vendor_sends: u64,
    pub(crate) vendor_replayed_sends: u64,
    pub(crate) replays: u64,
    pub(crate) replay_mismatches: u64,
    pub(crate) processing: u64,
    pub(crate) conflicts: u64,
    pub(crate) reclaims: u64,
    pub(crate) fenced: u64,
}

/// What the per-key pass found.
#[derive(Debug, Clone, Default)]
pub(crate) struct KeyFindings {
    /// The most messages the vendor created for one effect.
    pub(crate) max_effects: u32,
    /// Effects the vendor never made.
    pub(crate) without_effect: usize,
    /// The most `Claimed` executions of one key.
    pub(crate) max_executions: u32,
    /// Keys whose executions are not one plus their reclaims.
    pub(crate) unexplained_executions: usize,
    /// Keys `read()` answers completed with the vendor's message.
    pub(crate) completed: usize,
}

/// Everything the demo prints.
#[derive(Debug)]
pub(crate) struct Report {
    pub(crate) organization_id: uuid::Uuid,
    pub(crate) workers: u16,
    pub(crate) keys: usize,
    pub(crate) calls_per_key: u32,
    pub(crate) stall_lease: Duration,
    pub(crate) stall: Duration,
    pub(crate) stalled_key: String,
    pub(crate) totals: Totals,
    pub(crate) findings: KeyFindings,
    pub(crate) stale: StaleEndings,
    pub(crate) takeover: Option<Sent>,
    pub(crate) changed: usize,
    pub(crate) changed_refused: usize,
    pub(crate) elapsed: Duration,
}

/// One pass/fail line.
struct Check {
    ok: bool,
    name: &'static str,
    value: String,
    note: &'static str,
}

impl Report {
    /// True when every check passed.
    pub(crate) fn passed(&self) -> bool {
        self.checks().iter().all(|check| check.ok)
    }

    fn checks(&self) -> Vec<Check> {
        let t = &self.totals;
        let f = &self.findings;
        let check = |ok, name, value: String, note| Check { ok, name, value, note };
        vec![
            check(f.max_effects <= 1, "max vendor effects per key", f.max_effects.to_string(), "must be 1"),
            check(f.without_effect == 0, "keys without a vendor effect", f.without_effect.to_string(), "must be 0"),
            check(
                f.unexplained_executions == 0,
                "max claimed executions per key",
                f.max_executions.to_string(),
                "1, or 2 where a passed lease was reclaimed (same vendor key)",
            ),
            check(
                f.completed == self.keys,
                "keys completed, read() = vendor's message",
                format!("{}/{}", f.completed, self.keys),
                "every key ends completed",
            ),
            check(
                t.replay_mismatches == 0,
                "replays carrying the vendor's message id",
                format!("{}/{}", t.replays - t.replay_mismatches, t.replays),
                "",
            ),
            check(
                t.reclaims >= 1,
                "reclaims of the stalled key",
                t.reclaims.to_string(),
                "a passed lease is taken over",
            ),
            check(
                self.stale.complete == Ending::LeaseMovedOn,
                "stale complete() fenced off",
                ending(self.stale.complete).into(),
                "",
            ),
            check(
                self.stale.release == Ending::LeaseMovedOn,
                "stale release() fenced off",
                ending(self.stale.release).into(),
                "",
            ),
            check(
                self.changed_refused == self.changed,
                "changed payloads refused (conflict)",
                format!("{}/{}", self.changed_refused, self.changed),
                "",
            ),
            check(
                t.conflicts == self.changed_refused as u64,
                "conflicts on unchanged payloads",
                (t.conflicts - (self.changed_refused as u64).min(t.conflicts)).to_string(),
                "must be 0",
            ),
        ]
    }

    /// Prints the table to stdout.
    pub(crate) fn print(&self) {
        let t = &self.totals;
        println!(
            "{} workers, {} effects x {} tool calls each under {SCOPE}, 1 worker stalls {:.1} s on a {:.1} s lease",
            self.workers,
            self.keys,
            self.calls_per_key,
            self.stall.as_secs_f64(),
            self.stall_lease.as_secs_f64()
        );
        println!("organization {} (its rows stay in the journal for the scope's retention)", self.organization_id);
        println!();
        let rows = [
            ("tool calls proposed", t.tool_calls.to_string()),
            ("claim() calls, orchestrator retries incl.", t.attempts.to_string()),
            ("claimed executions (worker called vendor)", t.executions.to_string()),
            ("vendor sends (every POST /messages)", t.vendor_sends.to_string()),
            ("  answered from the vendor's key cache", t.vendor_replayed_sends.to_string()),
            ("vendor effects (distinct messages)", t.vendor_messages.to_string()),
            ("replays (completed: stored answer)", t.replays.to_string()),
            ("processing answers (in flight, retried)", t.processing.to_string()),
            ("conflicts (changed payload, used key)", t.conflicts.to_string()),
            ("reclaims (passed lease taken over)", t.reclaims.to_string()),
            ("fenced-off stale endings", t.fenced.to_string()),
            ("elapsed", format!("{:.2} s", self.elapsed.as_secs_f64())),
        ];
        println!("  {:<44} {:>12}", "what happened", "count");
        println!("  {:-<44} {:->12}", "", "");
        for (name, value) in &rows {
            println!("  {name:<44} {value:>12}");
        }
        println!();
        self.print_stall();
        println!();
        println!("  {:<6}{:<44} {:>12}  note", "check", "", "value");
        println!("  {:-<6}{:-<44} {:->12}  {:-<4}", "", "", "", "");
        for check in self.checks() {
            let mark = if check.ok { "ok" } else { "FAIL" };
            let line = format!("  {mark:<6}{:<44} {:>12}  {}", check.name, check.value, check.note);
            println!("{}", line.trim_end());
        }
        println!();
        println!(
            "{}",
            if self.passed() { "every effect happened exactly once" } else { "FAILED: see the checks above" }
        );
    }

    /// The stalled worker's story, step by step.
    fn print_stall(&self) {
        println!("  the stalled worker ({})", self.stalled_key);
        println!(
            "    claimed with a {:.1} s lease, sent -> {}, stalled {:.1} s without completing",
            self.stall_lease.as_secs_f64(),
            self.stale.sent.id,
            self.stall.as_secs_f64()
        );
        match &self.takeover {
            Some(sent) => println!(
                "    another worker reclaimed it, re-sent under the same Idempotency-Key -> {} ({}), completed",
                sent.id,
                if sent.replayed { "vendor replay, no second effect" } else { "a NEW message" }
            ),
            None => println!("    nobody reclaimed it"),
        }
        println!(
            "    it woke: complete() -> {}, release() -> {}",
            ending(self.stale.complete),
            ending(self.stale.release)
        );
    }
}

fn ending(ending: Ending) -> &'static str {
    match ending {
        Ending::Recorded => "Recorded",
        Ending::LeaseMovedOn => "LeaseMovedOn",
    }
}
