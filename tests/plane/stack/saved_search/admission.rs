//! Run admission on its own and under a start: a direct capability start
//! writes no claim, an admission whose answer was lost is still its
//! token's, and `run_admit` refuses a fence that names only half its claim
//! or a lost one.

use idempotency_plane::callers::runs::{AdmissionToken, RunAdmission};
use idempotency_plane::callers::saved_search::{SavedSearchError, SavedSearchStart};
use idempotency_plane::postgrest::{ClientError, Repeat};
use idempotency_plane::{PostgrestRepository, RetryConfig};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::support::harness::*;
use crate::support::transport::FaultServer;

use super::{ProductTables, HORIZON};

#[tokio::test]
async fn a_direct_capability_start_writes_no_row_in_the_idempotency_table() {
    let stack = stack().await;
    let runs = RunAdmission::new(PostgrestRepository::new(client(&stack)));
    let org = org();
    let first = runs.admit(org, "capability:summarize:req-1", &json!({"doc": 1})).await.unwrap();
    let again = runs.admit(org, "capability:summarize:req-1", &json!({"doc": 1})).await.unwrap();
    assert!(first.admitted && !again.admitted);
    assert_eq!(first.id, again.id);
    assert_eq!(count_runs(&stack).await, 1);
    assert_eq!(count_rows(&stack).await, 0, "Run admission never writes a claim");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn an_admission_whose_answer_was_lost_beyond_the_clients_retries_is_admitted_to_a_rerun_with_its_token() {
    let stack = stack().await;
    let proxy = FaultServer::lossy_proxy(stack.url()).await;
    let runs = RunAdmission::new(PostgrestRepository::new(proxy.client(stack.service_key(), RetryConfig::disabled())));
    let (org, input) = (org(), json!({"capability": "summarize", "request": "req-9"}));
    // The orchestrator step's own token, the same on every re-run.
    let step = AdmissionToken::derived(org, "run-7:step-admit");

    proxy.lose_answer(1);
    let lost = runs.admit_as(org, "capability:summarize:req-9", &input, step).await;
    assert!(lost.is_err(), "the answer is lost and the client does not retry: {lost:?}");
    assert_eq!(count_runs(&stack).await, 1, "the Run was admitted all the same");

    let rerun = runs.admit_as(org, "capability:summarize:req-9", &input, step).await.unwrap();
    assert!(rerun.admitted, "the step that admitted the Run, re-run: still its admitter");
    let other = runs.admit_as(org, "capability:summarize:req-9", &input, AdmissionToken::random()).await.unwrap();
    assert!(!other.admitted, "another token is a replay");
    let default = runs.admit(org, "capability:summarize:req-9", &input).await.unwrap();
    assert!(!default.admitted, "so is the default's fresh token");
    assert_eq!((other.id, default.id), (rerun.id, rerun.id));
    assert_eq!(count_runs(&stack).await, 1);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_start_rerun_after_its_admission_answer_was_lost_beyond_the_clients_retries_is_still_its_admitter() {
    let stack = stack().await;
    let proxy = FaultServer::lossy_proxy(stack.url()).await;
    let lossy = RunAdmission::new(PostgrestRepository::new(proxy.client(stack.service_key(), RetryConfig::disabled())));
    let starter = SavedSearchStart::new(service(&stack), lossy, ProductTables::open(), HORIZON).unwrap();
    let org = org();

    // The snapshot is completed, the Run admitted, and the admission's answer lost.
    proxy.lose_answer(1);
    let lost = starter.start(org, "search-lost", "tick-1").await;
    assert!(matches!(lost, Err(SavedSearchError::Plane(_))), "{lost:?}");
    assert_eq!(count_runs(&stack).await, 1);

    // The scheduler runs the start again: the same trigger admitted that Run.
    let again = starter.start(org, "search-lost", "tick-1").await.unwrap().into_run().expect("a Run");
    assert!(again.run.admitted, "every start of the trigger carries its admission token: {again:?}");
    assert!(again.replayed, "the snapshot was frozen by the first start");
    assert_eq!(again.snapshot["brief"], "brief v1");
    let other = RunAdmission::new(PostgrestRepository::new(client(&stack)))
        .admit(org, &again.run.start_key, &json!({"x": 1}))
        .await
        .unwrap();
    assert!(!other.admitted && other.id == again.run.id, "anyone else admitting under its key is not its admitter");
    assert_eq!(count_runs(&stack).await, 1);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_fence_names_its_claim_and_its_token_together_and_a_lost_one_is_refused_with_idem4() {
    let stack = stack().await;
    let client = client(&stack);
    let base = json!({"p_organization_id": org(), "p_start_key": "start:fenced", "p_input": {"q": 1},
                      "p_admission_token": Uuid::new_v4()});
    let with = |fields: Value| {
        let mut args = base.clone();
        args.as_object_mut().unwrap().extend(fields.as_object().unwrap().clone());
        args
    };
    for (args, code, named) in [
        (with(json!({"p_claim_id": Uuid::new_v4()})), "22023", "p_lease_token"),
        (with(json!({"p_lease_token": Uuid::new_v4()})), "22023", "p_claim_id"),
        (with(json!({"p_claim_id": Uuid::new_v4(), "p_lease_token": Uuid::new_v4()})), "IDEM4", "no Run admitted"),
    ] {
        match client.rpc::<Value>("run_admit", &args, Repeat::Safe).await {
            Err(ClientError::Api { status: 400, error, .. }) => {
                assert_eq!(error.code, code, "{args}");
                assert!(error.message.contains(named), "{}", error.message);
            }
            other => panic!("{args}: expected 400 {code}, got {other:?}"),
        }
    }
    assert_eq!(idempotency_plane::repo::FENCE_LOST, "IDEM4");
    assert_eq!(count_runs(&stack).await, 0);
    stack.stop().await.unwrap();
}
