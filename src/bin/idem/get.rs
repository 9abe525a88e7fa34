//! `idem get`: why did this call not run? One claim, as the database sees it.

use std::process::ExitCode;

use idempotency_plane::repo::{ClaimStatus, FailuresCall, JournaledFailures, Redrivability, RedrivableRow};
use idempotency_plane::{IdempotencyRecord, IdempotencyService, PostgrestRepository};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::{exit, remote, BoxError};

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
    /// The idempotency key, as the caller sent it.
    #[arg(long)]
    key: String,
    /// The caller an `Idempotency-Key` front door (the axum layer, the
    /// TypeScript middleware) scoped the key to, e.g. the token's `sub`: a
    /// per-caller key is stored as SHA-256(principal) § key (a key shared
    /// across callers is stored as sent: leave this out).
    #[arg(long)]
    principal: Option<String>,
    /// Print the claim as one JSON object (`{"state": "absent"}` when there
    /// is none).
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    target: remote::Target,
}

pub(crate) async fn run(args: GetArgs) -> Result<ExitCode, BoxError> {
    let repo = PostgrestRepository::new(remote::client(&args.target)?);
    let service = IdempotencyService::new(repo.clone());
    if args.principal.is_some() && args.key.contains('\u{a7}') {
        return Err(exit::usage_error(
            "--key already holds a stored key (it contains §): give it without --principal, or give the key as the caller sent it",
        ));
    }
    let key = stored_key(&args.key, args.principal.as_deref());
    let record = service.record(args.org, &args.scope, &key).await.map_err(exit::refused_input)?;
    // A failure: can it be sent back after a fix, and if not, why not.
    let failure = match &record {
        Some(record) if record.journaled_failure() => {
            let ids = [record.id];
            let call = FailuresCall {
                scope: &args.scope,
                bound: 1,
                organization_id: Some(args.org),
                since: None,
                claim_ids: Some(&ids),
            };
            repo.redrivable(&call).await.map_err(exit::refused_input)?.into_iter().next()
        }
        _ => None,
    };
    if args.json {
        println!("{}", serde_json::to_string(&as_json(record.as_ref(), failure.as_ref()))?);
        return Ok(exit::ok());
    }
    let Some(record) = record else {
        let hint = if args.principal.is_none() && args.scope.starts_with("http.") && !args.key.contains('\u{a7}') {
            " (a key of the Idempotency-Key middleware is stored per caller: give --principal)"
        } else {
            ""
        };
        println!(
            "absent: no claim for {}/{} in {} (never claimed, released, or swept){hint}",
            args.scope,
            printable(&key),
            args.org
        );
        return Ok(exit::ok());
    };
    let status = match record.status {
        ClaimStatus::Processing if record.lease_live => {
            "processing — a worker holds a live lease: the call is in flight"
        }
        ClaimStatus::Processing => "processing — the lease passed: its worker is gone; the next claim reclaims it",
        ClaimStatus::Completed if record.journaled_failure() => "failed — every repeat replays this failure",
        ClaimStatus::Completed => "completed — every repeat replays the stored answer",
    };
    println!("claim        {}", record.id);
    if args.principal.is_some() {
        println!("stored key   {}", printable(&key));
    }
    println!("status       {status}");
    if let Some(failure) = &failure {
        println!("error        {}", printable(failure.error.as_deref().unwrap_or("—")));
        if let Some(attempts) = failure.attempts {
            println!("attempts     {attempts}");
        }
        match failure.reason {
            Redrivability::Redrivable => println!(
                "send back    yes, once the cause is fixed: idem redrive --failed --scope {} --id {} \
                 (the next re-drive runs it once more)",
                printable(&args.scope),
                record.id
            ),
            reason => println!("send back    no: {}", reason.explain()),
        }
    }
    match record.status {
        ClaimStatus::Completed => println!("lease        — (completed: no lease is held)"),
        _ => {
            let lease = if record.lease_live { "live" } else { "passed" };
            println!("lease        {lease} (by the database clock), until {}", record.lease_expires_at);
        }
    }
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
    Ok(exit::ok())
}

/// The key as a front door stores it: scoped to `principal` when given.
pub(crate) fn stored_key(key: &str, principal: Option<&str>) -> String {
    match principal {
        Some(principal) => idempotency_plane::service::caller_scoped_key(principal, key),
        None => key.to_owned(),
    }
}

/// The claim for `--json`: every field a script needs; the response whole
/// (it is JSON already). No lease token: the plane answers a read without
/// it, since whoever holds it can record an ending; `lease_live` says
/// whether a worker holds the claim.
fn as_json(record: Option<&IdempotencyRecord>, failure: Option<&RedrivableRow>) -> Value {
    let Some(record) = record else { return json!({"state": "absent"}) };
    let state = match record.status {
        ClaimStatus::Processing if record.lease_live => "processing",
        ClaimStatus::Processing => "lease_passed",
        ClaimStatus::Completed if record.journaled_failure() => "failed",
        ClaimStatus::Completed => "completed",
    };
    let mut claim = json!({
        "state": state,
        "id": record.id,
        "organization_id": record.organization_id,
        "scope": record.scope,
        "key": record.key,
        "lease_live": record.lease_live,
        "claimed_at": record.claimed_at,
        "lease_expires_at": record.lease_expires_at,
        "retain_until": record.retain_until,
        "request_hash": record.request_hash,
        "resource_type": record.resource_type,
        "resource_id": record.resource_id,
        "response": record.response,
    });
    if let (Some(failure), Some(fields)) = (failure, claim.as_object_mut()) {
        fields.insert("error".into(), json!(failure.error));
        fields.insert("attempts".into(), json!(failure.attempts));
        fields.insert("redrivable".into(), json!(failure.reason == Redrivability::Redrivable));
        fields.insert("redrive_verdict".into(), json!(failure.reason));
    }
    claim
}

/// `text` without control characters, so a stored value cannot drive the
/// operator's terminal.
/// `text` with control characters shown as U+FFFD: a key or an answer is
/// data from a caller or a vendor, never a terminal command.
pub(crate) fn printable(text: &str) -> String {
    text.chars().map(|c| if c.is_control() { '\u{FFFD}' } else { c }).collect()
}
