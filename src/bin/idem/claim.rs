//! `idem claim`: would this call run? Claims a key the way a worker does.
//!
//! Reads the request as JSON from stdin, hashes it as every client does
//! (RFC 8785 canonical JSON, SHA-256), and makes the one-call claim. Prints
//! one JSON line: the outcome, the request hash, and what the outcome
//! carries. A key it takes is held until its lease passes (nothing runs in
//! its name), or released at once with `--release`.

use std::io::Read;
use std::process::ExitCode;
use std::time::Duration;

use idempotency_plane::{ClaimOutcome, IdempotencyService, PostgrestRepository, RequestHash};
use serde_json::{json, Value};
use uuid::Uuid;

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
    /// The idempotency key.
    #[arg(long)]
    key: String,
    /// The lease to claim for, in milliseconds (1,000 to 86,400,000).
    #[arg(long, default_value_t = 30_000)]
    lease_ms: u64,
    /// Release the key at once when this call takes it.
    #[arg(long)]
    release: bool,
}

pub(crate) async fn run(args: ClaimArgs) -> Result<ExitCode, BoxError> {
    let mut text = String::new();
    std::io::stdin().read_to_string(&mut text)?;
    let request: Value = serde_json::from_str(&text).map_err(|e| format!("stdin is not one JSON value: {e}"))?;
    let hash = RequestHash::of_json(&request);
    let service = IdempotencyService::new(PostgrestRepository::new(remote::client()?));
    let lease = Duration::from_millis(args.lease_ms);
    let outcome = service.claim(args.org, &args.scope, &args.key, &hash, lease).await?;
    let mut line = json!({"outcome": outcome.kind(), "request_hash": hash.as_str()});
    match &outcome {
        ClaimOutcome::Claimed(claim) => {
            line["claim_id"] = json!(claim.id());
            line["reclaimed"] = json!(claim.reclaimed());
            line["lease_expires_at"] = json!(claim.lease_expires_at());
            if args.release {
                line["released"] = json!(service.release(claim).await? == idempotency_plane::Ending::Recorded);
            }
        }
        ClaimOutcome::Completed { response, resource, response_ref } => {
            line["response"] = json!(response);
            line["resource"] = json!(resource);
            line["response_ref"] = json!(response_ref);
        }
        ClaimOutcome::Processing { lease_expires_at } => line["lease_expires_at"] = json!(lease_expires_at),
        ClaimOutcome::Conflict => {}
    }
    println!("{line}");
    Ok(crate::exit::ok())
}
