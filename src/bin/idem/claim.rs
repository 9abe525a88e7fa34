//! `idem claim`: would this call run?
//!
//! Reads the request from stdin and hashes it as the front door that made
//! the claim does: as JSON (RFC 8785 canonical form, SHA-256) for the tool
//! guard, `idempotent()`, the queue consumers and direct calls; as the raw
//! bytes (`--raw-body`, SHA-256) for the webhook gate, which hashes a body
//! exactly as delivered. The `Idempotency-Key` middleware hashes a
//! fingerprint of the whole HTTP request (method, target, content type,
//! body, chosen headers), which a body alone cannot rebuild, so `idem claim`
//! takes no principal (it would read a conflict, and `--hold` would block the
//! caller's key with a hash no request matches): look its claims up with
//! `idem get --principal`. By default it only reads the journal
//! (`read`: nothing is written) and says what a worker's claim would meet:
//! `absent` (it would run), `completed` (it would replay), `processing`
//! (another worker holds it), `conflict`. With `--hold` it makes the claim
//! a worker makes: a key it takes is held until its lease passes (nothing
//! runs in its name), or released at once with `--release`. Prints one JSON
//! line: the outcome, the request hash, and what the outcome carries.

use std::io::Read;
use std::process::ExitCode;
use std::time::Duration;

use idempotency_plane::{ClaimOutcome, IdempotencyService, PostgrestRepository, ReadOutcome, RequestHash};
use serde::Serialize;
use serde_json::{json, Value};
use uuid::Uuid;

use crate::exit::usage_error;
use crate::{remote, BoxError};

/// Options of `idem claim`.
#[derive(Debug, clap::Args)]
pub(crate) struct ClaimArgs {
    /// The organization id.
    #[arg(long)]
    org: Uuid,
    /// The scope, e.g. tool.email.send.
    #[arg(long)]
    scope: String,
    /// The idempotency key, as the caller sent it.
    #[arg(long)]
    key: String,
    /// Hash stdin's bytes exactly as read, as the webhook gate hashes a
    /// delivery's body, instead of as a JSON value.
    #[arg(long)]
    raw_body: bool,
    /// Claim the key as a worker does, holding it for its lease, instead of
    /// only reading what a claim would meet.
    #[arg(long)]
    hold: bool,
    /// With --hold: the lease to claim for, in milliseconds (1,000 to 86,400,000).
    #[arg(long, default_value_t = 30_000, requires = "hold")]
    lease_ms: u64,
    /// With --hold: release the key at once when this call takes it.
    #[arg(long, requires = "hold")]
    release: bool,
    #[command(flatten)]
    target: remote::Target,
}

pub(crate) async fn run(args: ClaimArgs) -> Result<ExitCode, BoxError> {
    let mut bytes = Vec::new();
    std::io::stdin().read_to_end(&mut bytes).map_err(|e| usage_error(format!("reading stdin: {e}")))?;
    let hash = if args.raw_body {
        RequestHash::of_bytes(&bytes)
    } else {
        let request: Value = serde_json::from_slice(&bytes)
            .map_err(|e| usage_error(format!("stdin is not one JSON value (a webhook body? give --raw-body): {e}")))?;
        RequestHash::of_json(&request)
    };
    let service = IdempotencyService::new(PostgrestRepository::new(remote::client(&args.target)?));
    let line = if args.hold { hold(&service, &args, &hash).await? } else { read(&service, &args, &hash).await? };
    println!("{line}");
    Ok(crate::exit::ok())
}

/// What a claim would meet, read without writing.
async fn read(
    service: &IdempotencyService<PostgrestRepository>,
    args: &ClaimArgs,
    hash: &RequestHash,
) -> Result<Value, BoxError> {
    let outcome = service.read(args.org, &args.scope, &args.key, hash).await.map_err(crate::exit::refused_input)?;
    let mut line = json!({"outcome": outcome.kind(), "request_hash": hash.as_str(), "held": false});
    match &outcome {
        ReadOutcome::Absent => line["would_run"] = json!(true),
        ReadOutcome::Completed { response, resource, response_ref } => {
            replay_fields(&mut line, response, resource, response_ref)
        }
        ReadOutcome::Processing { lease_expires_at } => line["lease_expires_at"] = json!(lease_expires_at),
        ReadOutcome::Conflict => {}
    }
    Ok(line)
}

/// The claim a worker makes, held for its lease (or released with --release).
async fn hold(
    service: &IdempotencyService<PostgrestRepository>,
    args: &ClaimArgs,
    hash: &RequestHash,
) -> Result<Value, BoxError> {
    let lease = Duration::from_millis(args.lease_ms);
    let outcome =
        service.claim(args.org, &args.scope, &args.key, hash, lease).await.map_err(crate::exit::refused_input)?;
    let mut line = json!({"outcome": outcome.kind(), "request_hash": hash.as_str(), "held": false});
    match &outcome {
        ClaimOutcome::Claimed(claim) => {
            line["claim_id"] = json!(claim.id());
            line["reclaimed"] = json!(claim.reclaimed());
            line["lease_expires_at"] = json!(claim.lease_expires_at());
            let released = args.release && service.release(claim).await? == idempotency_plane::Ending::Recorded;
            line["held"] = json!(!released);
            if args.release {
                line["released"] = json!(released);
            }
        }
        ClaimOutcome::Completed { response, resource, response_ref } => {
            replay_fields(&mut line, response, resource, response_ref)
        }
        ClaimOutcome::Processing { lease_expires_at } => line["lease_expires_at"] = json!(lease_expires_at),
        ClaimOutcome::Conflict => {}
    }
    Ok(line)
}

/// What a completed claim would replay: its stored response, resource and
/// reference, as the line's fields.
fn replay_fields(
    line: &mut Value,
    response: &impl Serialize,
    resource: &impl Serialize,
    response_ref: &impl Serialize,
) {
    line["response"] = json!(response);
    line["resource"] = json!(resource);
    line["response_ref"] = json!(response_ref);
}
