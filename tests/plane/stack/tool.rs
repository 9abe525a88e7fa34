//! The tool guard where the real database answers what the in-memory
//! repository cannot: a number PostgreSQL's numeric refuses. Every other
//! decision of the guard is in `crate::callers::tool`, on both planes.

use std::sync::atomic::{AtomicUsize, Ordering};

use idempotency_plane::callers::tool::{ToolKey, ToolResult, ToolRun};
use idempotency_plane::service::Elided;
use serde_json::{json, Value};
use uuid::Uuid;

use crate::callers::tool::{allow, guard, spec};
use crate::support::harness::*;

#[tokio::test]
async fn an_output_the_database_refuses_is_journaled_as_a_stand_in_and_replays() {
    // The embedded stack's build keeps JSON numbers as written, so an output
    // can hold a number PostgreSQL's numeric cannot (22003): the service
    // passes it, the database refuses it.
    let Ok(huge) = serde_json::from_str::<Value>(r#"{"balance": 1e999999}"#) else {
        return; // a build that cannot even represent it cannot send it either
    };
    let stack = stack().await;
    let guard = guard(&stack);
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "balance"), json!({}));
    let calls = AtomicUsize::new(0);
    let tool = |_| {
        let huge = huge.clone();
        let calls = &calls;
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            ToolResult::success(huge)
        }
    };

    let first = guard.run(org, &spec(), &key, &args, allow, tool).await.unwrap();
    assert!(matches!(first, ToolRun::Executed(_)), "{first:?}");
    let again = guard.run(org, &spec(), &key, &args, allow, tool).await.unwrap();
    let ToolRun::Replayed(replayed) = again else { panic!("expected a replay, got {again:?}") };
    assert!(replayed.ok);
    assert_eq!(Elided::from_stored(&replayed.output).map(|e| e.reason), Some("refused".to_owned()));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    stack.stop().await.unwrap();
}
