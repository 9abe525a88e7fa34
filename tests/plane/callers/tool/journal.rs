//! What the journal keeps of answers the store cannot hold as they are: a
//! resource it would refuse, an output above its limit or holding NUL, and
//! business failures that are large or hold NUL, each replayed as the same
//! answer.

use std::sync::atomic::{AtomicUsize, Ordering};

use idempotency_plane::callers::tool::{ToolGuard, ToolKey, ToolResult, ToolRun};
use idempotency_plane::repo::ClaimStatus;
use idempotency_plane::service::Elided;
use serde_json::json;
use uuid::Uuid;

use crate::callers::{row, service};
use crate::support::backends::Plane;
use crate::support::org;

use super::{allow, guard, spec, HORIZON};

async fn a_resource_the_store_would_refuse_still_journals_the_answer<P: Plane>(plane: &P) {
    let guard = guard(plane);
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "send"), json!({}));
    let first = guard
        .run(org, &spec(), &key, &args, allow, |_| async {
            // A vendor answered without an id: the effect happened all the same.
            ToolResult::success(json!({"status": "queued"})).with_resource("email.message", "")
        })
        .await
        .unwrap();
    assert!(matches!(first, ToolRun::Executed(_)));
    let replay =
        guard.run(org, &spec(), &key, &args, allow, |_| async { panic!("the effect must not repeat") }).await.unwrap();
    let ToolRun::Replayed(stored) = replay else { panic!("{replay:?}") };
    assert_eq!(stored.output, json!({"status": "queued"}));
    assert_eq!(stored.resource, None);
}

async fn a_tool_output_above_the_store_limit_with_no_resource_is_journaled_as_a_summary<P: Plane>(plane: &P) {
    let guard = ToolGuard::new(service(plane).with_response_limit(1024), HORIZON);
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "export"), json!({}));
    let big = json!({"rows": "x".repeat(4096)});
    let ran = guard.run(org, &spec(), &key, &args, allow, |_| async move { ToolResult::success(big) }).await.unwrap();
    assert!(matches!(ran, ToolRun::Executed(ref r) if r.ok));
    // The effect is journaled: a replay answers, it does not run the tool again.
    let replay = guard.run(org, &spec(), &key, &args, allow, |_| async { panic!("must not run twice") }).await.unwrap();
    let ToolRun::Replayed(stored) = replay else { panic!("{replay:?}") };
    assert!(stored.ok);
    let elided = Elided::from_stored(&stored.output).expect("the output is an elided summary");
    assert_eq!(elided.reason, "too_large");
    assert!(elided.size.is_some_and(|size| size > 4096), "{elided:?}");
}

async fn a_tool_output_holding_nul_is_journaled_whole_and_the_next_attempt_replays_it_without_a_second_vendor_call<
    P: Plane,
>(
    plane: &P,
) {
    let guard = guard(plane);
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "fetch"), json!({"url": "https://x"}));
    let vendor_calls = AtomicUsize::new(0);
    let tool = |_| async {
        vendor_calls.fetch_add(1, Ordering::SeqCst);
        // A vendor's body with a NUL byte in it: PostgreSQL jsonb cannot hold it.
        ToolResult::success(json!({"body": "PK\u{0}\u{3}\u{4}", "status": 200}))
    };

    let first = guard.run(org, &spec(), &key, &args, allow, tool).await.unwrap();
    assert!(matches!(first, ToolRun::Executed(ref r) if r.ok), "{first:?}");
    let status = row(plane, org, "tool.email.send", key.as_str()).await.status;
    assert_eq!(status, ClaimStatus::Completed, "the effect is journaled, not left processing");

    let again = guard.run(org, &spec(), &key, &args, allow, tool).await.unwrap();
    let ToolRun::Replayed(replayed) = again else { panic!("expected a replay, got {again:?}") };
    assert!(replayed.ok);
    assert_eq!(
        replayed.output,
        json!({"body": "PK\u{0}\u{3}\u{4}", "status": 200}),
        "replayed as it was, NUL included"
    );
    assert_eq!(vendor_calls.load(Ordering::SeqCst), 1, "no second vendor call");
}

async fn a_large_business_failure_with_a_resource_replays_as_the_same_business_failure<P: Plane>(plane: &P) {
    let guard = guard(plane);
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "import"), json!({"file": "f-1"}));
    let output = json!({"errors": "e".repeat(100 * 1024)});
    let made = ToolResult::business_failure("invalid_input", output).with_resource("crm.import", "imp-1");

    let first = guard.run(org, &spec(), &key, &args, allow, |_| async { made.clone() }).await.unwrap();

    let again = guard.run(org, &spec(), &key, &args, allow, |_| async { panic!("must replay") }).await.unwrap();
    let ToolRun::Replayed(replayed) = again else { panic!("expected a replay, got {again:?}") };
    assert_eq!(first, ToolRun::Executed(replayed.clone()), "the first answer is the replay's");
    assert!(!replayed.ok, "a business failure replays as a failure, not a success");
    assert!(!replayed.retryable);
    assert_eq!(replayed.error.as_deref(), Some("invalid_input"));
    assert_eq!(replayed.resource, made.resource);
    let reference: idempotency_plane::ResponseRef =
        serde_json::from_value(replayed.output["$response_ref"].clone()).expect("a reference");
    assert_eq!((reference.resource_type.as_str(), reference.resource_id.as_str()), ("crm.import", "imp-1"));
    assert!(reference.size > 100 * 1024);
}

async fn a_business_failure_with_an_error_of_64_kib_or_more_replays_as_that_failure_with_or_without_a_resource<
    P: Plane,
>(
    plane: &P,
) {
    let guard = guard(plane);
    let org = org();
    let long_error = format!("invalid_input: {}", "the field is wrong. ".repeat(4_000));
    assert!(long_error.len() >= 64 * 1024);
    for (step, resource) in [("with-resource", Some(("crm.note", "n-1"))), ("without-resource", None)] {
        let (key, args) = (ToolKey::for_step(Uuid::new_v4(), step), json!({"step": step}));
        let runs = AtomicUsize::new(0);
        let tool = |_| async {
            runs.fetch_add(1, Ordering::SeqCst);
            let failure = ToolResult::business_failure(long_error.clone(), json!({"field": "name"}));
            match resource {
                Some((kind, id)) => failure.with_resource(kind, id),
                None => failure,
            }
        };
        let first = guard.run(org, &spec(), &key, &args, allow, tool).await.unwrap();
        assert!(matches!(&first, ToolRun::Executed(r) if !r.ok), "{step}: {first:?}");
        let again = guard.run(org, &spec(), &key, &args, allow, tool).await.unwrap();
        let ToolRun::Replayed(replayed) = again else { panic!("{step}: a replay, got {again:?}") };
        assert!(!replayed.ok, "{step}: a business failure replays as a failure, never as ok: true");
        let kept = replayed.error.expect("the error is kept");
        assert!(long_error.starts_with(&kept) && !kept.is_empty(), "{step}: the error's start is kept");
        assert_eq!(replayed.output, json!({"field": "name"}), "{step}: the small output is kept whole");
        assert_eq!(replayed.resource.is_some(), resource.is_some(), "{step}");
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{step}: the tool ran once");
    }
}

async fn a_business_failure_whose_error_holds_nul_is_journaled_and_replays_equal<P: Plane>(plane: &P) {
    let guard = guard(plane);
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "nul-error"), json!({}));
    let failure = ToolResult::business_failure("bad byte \u{0} in name", json!(null));
    let first = guard.run(org, &spec(), &key, &args, allow, |_| async { failure.clone() }).await.unwrap();
    assert!(matches!(first, ToolRun::Executed(_)));
    let status = row(plane, org, "tool.email.send", key.as_str()).await.status;
    assert_eq!(status, ClaimStatus::Completed, "journaled, not left processing for a second run after the lease");
    let again = guard.run(org, &spec(), &key, &args, allow, |_| async { panic!("must not run twice") }).await.unwrap();
    assert_eq!(again, ToolRun::Replayed(failure));
}

/// Nested `levels` arrays deep: deeper than the store holds as JSON.
fn nested(levels: usize) -> serde_json::Value {
    (0..levels).fold(json!(1), |inner, _| json!([inner]))
}

/// The first caller gets exactly what every replay will say, whatever the
/// answer holds: a 70,000-character error (kept as its first 1 KiB), U+0000
/// in the error and the output, an output above the store limit (by
/// reference to the resource, or as a summary), and outputs the store keeps
/// through its lossless wrapper (nested deeper than `jsonb` holds, shaped
/// like a stand-in).
async fn the_first_answer_is_exactly_what_every_replay_says<P: Plane>(plane: &P) {
    let guard = guard(plane);
    let org = org();
    let answers = [
        ("long-error", ToolResult::business_failure("e".repeat(70_000), json!({"field": "to"}))),
        ("nul", ToolResult::business_failure("bad\u{0}byte", json!({"body": "PK\u{0}\u{3}"}))),
        ("oversized", ToolResult::success(json!({"rows": "x".repeat(100 * 1024)}))),
        (
            "oversized-with-resource",
            ToolResult::success(json!({"rows": "x".repeat(100 * 1024)})).with_resource("crm.export", "x-1"),
        ),
        ("deep", ToolResult::success(nested(100))),
        ("marker-shaped", ToolResult::success(json!({"$json": "{}"}))),
        // Numbers the database writes back in another form (1e18 as an
        // integer, 1e-7 in full).
        ("numbers", ToolResult::success(json!({"big": 1e18, "small": 1e-7, "whole": 100.0, "neg": -1e17}))),
    ];
    for (step, made) in answers {
        let (key, args) = (ToolKey::for_step(Uuid::new_v4(), step), json!({"step": step}));
        let first = guard.run(org, &spec(), &key, &args, allow, |_| async { made.clone() }).await.unwrap();
        let ToolRun::Executed(first) = first else { panic!("{step}: executed, got {first:?}") };
        let again = guard.run(org, &spec(), &key, &args, allow, |_| async { panic!("must replay") }).await.unwrap();
        let ToolRun::Replayed(replayed) = again else { panic!("{step}: a replay, got {again:?}") };
        assert_eq!(first, replayed, "{step}: the first answer differs from its replay");
        assert_eq!((first.ok, first.error.is_some()), (made.ok, made.error.is_some()), "{step}");
    }
}

crate::support::on_every_plane!(
    the_first_answer_is_exactly_what_every_replay_says,
    a_resource_the_store_would_refuse_still_journals_the_answer,
    a_tool_output_above_the_store_limit_with_no_resource_is_journaled_as_a_summary,
    a_tool_output_holding_nul_is_journaled_whole_and_the_next_attempt_replays_it_without_a_second_vendor_call,
    a_large_business_failure_with_a_resource_replays_as_the_same_business_failure,
    a_business_failure_with_an_error_of_64_kib_or_more_replays_as_that_failure_with_or_without_a_resource,
    a_business_failure_whose_error_holds_nul_is_journaled_and_replays_equal,
);
