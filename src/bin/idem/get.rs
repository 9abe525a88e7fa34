//! `idem get`: why did this call not run? One claim, as the database sees it.

use std::process::ExitCode;

use idempotency_plane::repo::ClaimStatus;
use idempotency_plane::{IdempotencyRepository, PostgrestRepository};
use uuid::Uuid;

use crate::{remote, BoxError};

/// Longest response shown; the rest is cut with a note.
const SHOWN_RESPONSE_CHARS: usize = 400;

/// Options of `idem get`.
#[derive(Debug, clap::Args)]
pub(crate) struct GetArgs {
    /// The organization id.
    #[arg(long)]
    org: Uuid,
    /// The scope, e.g. tool.email.send.
    #[arg(long)]
    scope: String,
    /// The idempotency key.
    #[arg(long)]
    key: String,
}

pub(crate) async fn run(args: GetArgs) -> Result<ExitCode, BoxError> {
    let repo = PostgrestRepository::new(remote::client()?);
    let Some(record) = repo.get(args.org, &args.scope, &args.key).await? else {
        println!(
            "absent: no claim for {}/{} in {} (never claimed, released, or swept)",
            args.scope, args.key, args.org
        );
        return Ok(ExitCode::SUCCESS);
    };
    let status = match record.status {
        ClaimStatus::Processing if record.lease_live => {
            "processing — a worker holds a live lease: the call is in flight"
        }
        ClaimStatus::Processing => "processing — the lease passed: its worker is gone; the next claim reclaims it",
        ClaimStatus::Completed => "completed — every repeat replays the stored answer",
    };
    println!("claim        {}", record.id);
    println!("status       {status}");
    match record.status {
        ClaimStatus::Completed => println!("lease        — (completed: no lease is held)"),
        _ => {
            let lease = if record.lease_live { "live" } else { "passed" };
            println!("lease        {lease} (by the database clock), until {}", record.lease_expires_at);
        }
    }
    println!("lease token  {}", record.lease_token);
    println!("claimed at   {}", record.claimed_at);
    println!("retained to  {}", record.retain_until);
    println!("request hash {}", record.request_hash);
    match (&record.resource_type, &record.resource_id) {
        (Some(kind), Some(id)) => println!("resource     {} {}", printable(kind), printable(id)),
        _ => println!("resource     —"),
    }
    match &record.response {
        Some(response) => {
            let text = printable(&response.to_string());
            let shown: String = text.chars().take(SHOWN_RESPONSE_CHARS).collect();
            let cut = text.chars().count().saturating_sub(SHOWN_RESPONSE_CHARS);
            if cut > 0 {
                println!("response     {shown}… ({cut} more characters)");
            } else {
                println!("response     {shown}");
            }
        }
        None => println!("response     —"),
    }
    Ok(ExitCode::SUCCESS)
}

/// `text` without control characters, so a stored value cannot drive the
/// operator's terminal.
fn printable(text: &str) -> String {
    text.chars().map(|c| if c.is_control() { '\u{FFFD}' } else { c }).collect()
}
