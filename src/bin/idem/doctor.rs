//! `idem doctor`: can this deployment serve the plane? One line per check,
//! and a non-zero exit when any fails.

use std::process::ExitCode;
use std::time::Instant;

use idempotency_plane::postgrest::{codes, ClientError, PostgrestClient, Repeat};
use serde_json::{json, Value};

use crate::{remote, BoxError};

/// What a function probe must answer for the function to be there, as the
/// contract says.
enum Expect {
    /// A success: the probe is harmless and reads or writes nothing.
    Answer,
    /// A refusal with this SQLSTATE: the function exists, took these argument
    /// names, and validated them (the probe's arguments are deliberately bad,
    /// so nothing is written).
    Refusal(&'static str),
}

/// Every function of the SQL surface, called with its argument names.
fn probes() -> Vec<(&'static str, Value, Expect)> {
    let nil = "00000000-0000-0000-0000-000000000000";
    let claim = json!({
        "p_organization_id": nil, "p_scope": "tool.doctor", "p_key": "doctor", "p_request_hash": "0".repeat(64),
        "p_lease_token": nil, "p_lease_ms": 0, "p_retain_ms": 0
    });
    vec![
        (
            "idempotency_get",
            json!({"p_organization_id": nil, "p_scope": "tool.doctor", "p_key": "doctor"}),
            Expect::Answer,
        ),
        ("idempotency_try_claim", claim.clone(), Expect::Refusal(codes::INVALID_PARAMETER_VALUE)),
        ("idempotency_reclaim", claim, Expect::Refusal(codes::INVALID_PARAMETER_VALUE)),
        (
            "idempotency_complete",
            json!({"p_claim_id": nil, "p_lease_token": nil}),
            Expect::Refusal(codes::INVALID_PARAMETER_VALUE),
        ),
        ("idempotency_release", json!({"p_claim_id": nil, "p_lease_token": nil}), Expect::Answer),
        ("idempotency_expired", json!({"p_limit": 0}), Expect::Refusal(codes::INVALID_PARAMETER_VALUE)),
        ("idempotency_delete_expired", json!({"p_ids": []}), Expect::Answer),
        ("idempotency_cap_probe", json!({"p_rows": 0}), Expect::Refusal(codes::INVALID_PARAMETER_VALUE)),
        (
            "run_admit",
            json!({"p_organization_id": nil, "p_start_key": "", "p_input": null}),
            Expect::Refusal(codes::INVALID_PARAMETER_VALUE),
        ),
        ("provider_job_lookup", json!({"p_provider": "doctor", "p_job_id": "doctor"}), Expect::Answer),
        (
            "provider_job_register",
            json!({"p_organization_id": nil, "p_provider": "", "p_job_id": ""}),
            Expect::Refusal(codes::CHECK_VIOLATION),
        ),
    ]
}

struct Report {
    failures: usize,
}

impl Report {
    fn line(&mut self, ok: bool, check: &str, detail: impl std::fmt::Display) {
        if !ok {
            self.failures += 1;
        }
        println!("{}  {check}: {detail}", if ok { "ok  " } else { "FAIL" });
    }
}

pub(crate) async fn run() -> Result<ExitCode, BoxError> {
    let client = remote::client()?;
    let mut report = Report { failures: 0 };
    println!("idem doctor: {}", client.config().base_url());

    // Reachability, the key's role, the schema: one harmless read answers all three.
    let started = Instant::now();
    let reached = client.rpc::<Value>("idempotency_get", &probes()[0].1, Repeat::Safe).await;
    match reached {
        Ok(_) => report.line(true, "reachable", format!("answered in {} ms", started.elapsed().as_millis())),
        Err(error) => {
            report.line(false, "reachable", diagnose(&error));
            println!("      (the remaining checks need a reachable server with the right key; skipped)");
            return Ok(ExitCode::FAILURE);
        }
    }

    for (function, args, expect) in probes() {
        let answer = client.rpc::<Value>(function, &args, Repeat::Unsafe).await;
        match (answer, expect) {
            (Ok(_), Expect::Answer) => report.line(true, function, "present, executable"),
            (Err(ClientError::Api { error, .. }), Expect::Refusal(code)) if error.code == code => {
                report.line(true, function, "present, executable, validates its arguments")
            }
            (Err(error), _) => report.line(false, function, diagnose(&error)),
            (Ok(value), Expect::Refusal(code)) => {
                report.line(false, function, format!("expected a {code} refusal of a bad argument, got {value}"))
            }
        }
    }

    check_row_cap(&client, &mut report).await;

    if report.failures == 0 {
        println!("all checks passed");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("{} check(s) failed", report.failures);
        Ok(ExitCode::FAILURE)
    }
}

/// Asks the probe for one row more than the configured cap and reads what
/// the server did from Content-Range.
async fn check_row_cap(client: &PostgrestClient, report: &mut Report) {
    let cap = u64::from(client.config().max_rows());
    let probed = client.rpc_counted::<Value>("idempotency_cap_probe", &json!({"p_rows": cap + 1}), Some("id")).await;
    let (range, rows) = match probed {
        Ok(answer) => answer,
        Err(error) => return report.line(false, "row cap", diagnose(&error)),
    };
    let received = rows.len() as u64;
    let detail = match received.cmp(&cap) {
        std::cmp::Ordering::Equal => {
            return report.line(true, "row cap", format!("the server truncates at {cap} rows, as configured (Content-Range {range})"));
        }
        std::cmp::Ordering::Less => format!(
            "the server truncates at {received} rows, below the configured {cap}: every bounded read above \
             {received} fails with Truncated. Set IDEM_MAX_ROWS={received}, or raise db-max-rows / Supabase api.max_rows"
        ),
        std::cmp::Ordering::Greater => format!(
            "the server returned {received} rows for {} asked: its db-max-rows is above the configured {cap} or \
             unset. Set db-max-rows / Supabase api.max_rows to {cap}, or IDEM_MAX_ROWS to the server's",
            cap + 1
        ),
    };
    report.line(false, "row cap", detail);
}

/// What an error means for an operator.
fn diagnose(error: &ClientError) -> String {
    match error {
        ClientError::Transport { .. } => format!("cannot reach the server ({error})"),
        ClientError::Api { error: body, .. } => match body.code.as_str() {
            codes::PGRST106 => {
                "schema `agent` is not exposed: add it to db-schemas (Supabase: API settings → exposed schemas)".into()
            }
            codes::PGRST202 => format!("missing, or not with the contract's argument names: {}", body.message),
            codes::INSUFFICIENT_PRIVILEGE => "the key's role cannot execute it: use the service_role key".into(),
            codes::PGRST301 | codes::PGRST303 => format!("the key is not accepted: {}", body.message),
            _ => error.to_string(),
        },
        other => other.to_string(),
    }
}
