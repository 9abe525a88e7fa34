use idempotency_plane::{ClaimOutcome, Completion, Ending};
use serde_json::json;

use crate::harness::*;

#[tokio::test]
async fn first_claim_then_completed_duplicate_returns_stored_resource_and_result() {
    let stack = stack().await;
    let service = service(&stack);
    let org = org();
    let h = hash("send a@b.c");

    let ClaimOutcome::Claimed(claim) = service
        .claim(org, "tool.email.send", "run-1:step-1", &h, LEASE)
        .await
        .unwrap()
    else {
        panic!("the first claim owns the key");
    };
    let completion =
        Completion::response(json!({"message_id": "m-1"})).with_resource("nylas.message", "m-1");
    assert_eq!(
        service.complete(&claim, completion).await.unwrap(),
        Ending::Recorded
    );

    let replay = service
        .claim(org, "tool.email.send", "run-1:step-1", &h, LEASE)
        .await
        .unwrap();
    match replay {
        ClaimOutcome::Completed { response, resource } => {
            assert_eq!(response, Some(json!({"message_id": "m-1"})));
            let resource = resource.expect("resource stored");
            assert_eq!(resource.resource_type, "nylas.message");
            assert_eq!(resource.resource_id, "m-1");
        }
        other => panic!("expected the stored answer, got {other:?}"),
    }
    assert_eq!(count_rows(&stack).await, 1);
    stack.stop().await.unwrap();
}
