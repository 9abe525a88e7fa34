//! The webhook gate: the edge adapter at an HTTP boundary.
//!
//! A webhook handler is the outermost frame, and a 5xx tells the vendor that
//! a delivery which succeeded failed (Slack disables a subscription that
//! answers 5xx often enough). So every duplicate ending is an ACK with a
//! counted, logged drop reason; none is silent.
//!
//! **The invariant.** Once any delivery of an event has been answered 2xx
//! (processed, or dropped as a duplicate of a claim that is in flight or
//! done), the event is processed to completion exactly once, or its failure
//! is journaled and counted as a drop reason ([`DropReason::ProcessingAborted`],
//! [`DropReason::DeadLettered`]); it is never silently lost. A
//! redelivery that meets a live claim is ACKed as a duplicate, as the spec
//! says, so the gate never gives up a claim it holds: it never releases one.
//! It carries the event to a journaled ending itself:
//!
//! - processing runs to its own timeout (default
//!   [`DEFAULT_PROCESSING_TIMEOUT`]), never cut by the answer's deadline; a
//!   retryable failure is retried in process, with backoff, within that
//!   timeout; what still fails at the end is not journaled (a stored
//!   failure would answer every later delivery, even once the downstream
//!   is back) but left to its lease with its body, for a re-drive: the
//!   lease is its backoff, and the scope's `max_attempts` makes it a dead
//!   letter at last. A permanent failure is journaled as the event's answer;
//! - the answer leaves within the gate's deadline (default
//!   [`DEFAULT_GATE_DEADLINE`], 2.5 s, inside Slack's 3 s window): processing
//!   still running then is answered [`Ack::Accepted`] (200) and finished in
//!   the background, so slow-but-successful processing runs once and is not
//!   restarted on every redelivery;
//! - a claim that does not answer within the deadline is answered 503 (the
//!   plane could not decide), and the gate keeps asking with the same lease
//!   token in the background (after any failure that may have followed the
//!   claim's commit, while an answer could still be journaled): if the
//!   database did make the claim, the gate processes the event (or journals
//!   it as aborted when confirmed too late to process), so the vendor's
//!   redelivery, which meets that claim and is ACKed as a duplicate, is not
//!   a loss. A plane silent for that whole time leaves it to its lease.
//!
//! The only non-2xx answers are [`Ack::Retry`]: the gate holds no claim (the
//! plane could not be reached, or did not answer in time: 503), or the
//! delivery is too large to store with its claim (413, see below).
//!
//! **The work outlives the worker.** Every delivery is claimed together
//! with its body, in the same statement, losslessly (`body_text`, or
//! `body_base64` for bytes that are not UTF-8 text or whose JSON text would
//! be longer), bounded by the scope's `max_request_bytes`. A delivery above that limit is never acknowledged
//! unstored: it is answered 413 and not claimed, so the vendor records the
//! failure and keeps the event for a resend once the limit is raised. A
//! worker that dies holding a claim (killed, out of memory, at a platform's
//! wall-clock limit) leaves the event and its body in the plane:
//! [`WebhookGate::redrive`], run from anything on a schedule, takes such
//! orphans over once their lease passes, with a fresh fence (the old holder,
//! if it was only slow, is fenced off), and runs them through the same
//! `process` with the same endings; an event handed out as often as its
//! scope's `max_attempts` allows is journaled as a dead letter
//! ([`DropReason::DeadLettered`]). With [`WebhookGate::with_heartbeats`] the
//! claim is made for a short lease that heartbeats keep alive while
//! processing runs, so a dead worker's event is re-driven within seconds.
//! The invariant then holds whatever happens to the worker, as long as
//! something re-drives.
//!
//! **One body limit.** So that the store never refuses a delivery the gate
//! took, the gate takes bodies up to its body limit
//! ([`DEFAULT_WEBHOOK_BODY_LIMIT`], 256 KiB; [`WebhookGate::with_body_limit`])
//! and answers a larger one 413 before anything else (the axum route before
//! it checks the signature). A body of `n` bytes is stored in at most
//! [`stored_body_bound`]`(n)` = `4 × ⌈n / 3⌉ + 18` bytes whatever its bytes,
//! and `webhook.*` keeps [`WEBHOOK_SCOPE_MAX_REQUEST_BYTES`] (384 KiB), which
//! holds every body up to the default limit; `idem doctor` checks a
//! deployment's scopes against its handler's limit.
//!
//! The lease is the processing timeout plus the journal's deadline plus
//! [`LEASE_MARGIN`]: 15 + 10 + 5 = the spec's 30 s for `webhook.nylas`.
//!
//! Against the vendors' retry rules: Slack waits 3 s for an answer and
//! retries an event three times (at once, after 1 minute, after 5 minutes)
//! when the answer is late or not 2xx; Nylas expects a 200 within 10 s and
//! retries failed deliveries with backoff. Both are served by an answer
//! within 2.5 s, 200 for everything the gate holds a claim on.
//!
//! The module by job: the gate and its answer by the deadline (`gate`), the
//! road a delivery takes in its own task (`carry`), what reaches the gate
//! (`delivery`), what it answers (`ack`), the provider jobs a callback
//! resolves its tenant by (`jobs`), the body a claim stores (`stored`), and
//! the re-drive of orphaned events (`redrive`).

mod ack;
mod carry;
mod delivery;
mod gate;
mod jobs;
mod redrive;
mod stored;

pub use ack::{Ack, DropCounters, DropReason, RetryReason, FAILED_ACK_ERROR_CHARS};
pub use delivery::{Delivery, ProcessingError, ProviderCallback};
pub use gate::{
    GateConfigError, WebhookGate, DEFAULT_GATE_DEADLINE, DEFAULT_PROCESSING_TIMEOUT, DEFAULT_VENDOR_HORIZON,
    LEASE_MARGIN,
};
pub use jobs::{ProviderJob, ProviderJobs};
pub use redrive::{Redelivery, RedriveReport};
pub use stored::{
    largest_storable_body, stored_body_bound, DEFAULT_WEBHOOK_BODY_LIMIT, WEBHOOK_BODY_LIMIT_VAR,
    WEBHOOK_SCOPE_MAX_REQUEST_BYTES, WEBHOOK_SCOPE_VAR,
};
