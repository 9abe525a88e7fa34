//! Claims, completions and reads through the repository and the service
//! against PostgREST's exact answers (wiremock, §1 and §2): absent optional
//! arguments are omitted, never sent as null; a row that is not the one
//! asked for, or a lease already passed, is never acted on.

use idempotency_plane::repo::{CompletionArgs, IdempotencyRepository};
use idempotency_plane::{ClaimOutcome, Completion, Ending, Error};
use serde_json::{json, Value};
use uuid::Uuid;
use wiremock::matchers::{body_partial_json, method, path};
use wiremock::{Mock, MockServer, Request, ResponseTemplate};

use crate::support::transport::claim_row;
use crate::support::LEASE;
use crate::wire::{email_hash, repository, requests, service, SCOPE};

// ---------------------------------------------------------------------------
// Absent optional arguments
// ---------------------------------------------------------------------------

#[tokio::test]
async fn the_repository_omits_absent_optional_arguments_instead_of_sending_null() {
    // §1: only supplied keys are passed, so omitted defaulted params take the SQL default;
    // postrust-server binds a JSON null as '', PostgREST as SQL NULL.
    // Arrange
    let server = MockServer::start().await;
    let (organization_id, claim_id, token) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_complete"))
        .and(body_partial_json(json!({
            "p_claim_id": claim_id,
            "p_lease_token": token,
            "p_organization_id": organization_id,
            "p_response": {"message_id": "m-1"}
        })))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!([claim_row(
            claim_id,
            token,
            SCOPE,
            &email_hash(),
            "completed"
        )])))
        .expect(1)
        .mount(&server)
        .await;
    let response = json!({"message_id": "m-1"});
    // Act
    let completed = repository(&server)
        .complete(
            organization_id,
            claim_id,
            token,
            CompletionArgs { response: Some(&response), ..CompletionArgs::default() },
        )
        .await
        .expect("a completion");
    // Assert
    assert_eq!(completed.map(|r| r.id), Some(claim_id));
    let sent = requests(&server).await;
    assert_eq!(sent.len(), 1);
    let body: Value = sent[0].body_json().unwrap();
    let mut keys: Vec<&str> = body.as_object().expect("a JSON object").keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["p_claim_id", "p_lease_token", "p_organization_id", "p_response"]);
    server.verify().await;
}

#[tokio::test]
async fn the_service_completes_a_resource_only_claim_without_a_response_key() {
    // §1: only supplied keys are passed; absent values are omitted, never sent as null.
    // Arrange
    let server = MockServer::start().await;
    let (claim_id, org) = (Uuid::new_v4(), Uuid::new_v4());
    // The store answers the row asked for, holding the token the service minted.
    let answer = move |request: &Request, status: &str| {
        let body: Value = request.body_json().expect("a JSON body");
        let token: Uuid = serde_json::from_value(body["p_lease_token"].clone()).expect("a token");
        let mut row = claim_row(claim_id, token, SCOPE, &email_hash(), status);
        row["organization_id"] = json!(org);
        row["outcome"] = json!("claimed"); // what the one-call claim adds
        ResponseTemplate::new(200).set_body_json(json!([row]))
    };
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_claim"))
        .respond_with(move |request: &Request| answer(request, "processing"))
        .expect(1)
        .mount(&server)
        .await;
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_complete"))
        .and(body_partial_json(json!({
            "p_claim_id": claim_id,
            "p_resource_type": "nylas.message",
            "p_resource_id": "m-1"
        })))
        .respond_with(move |request: &Request| answer(request, "completed"))
        .expect(1)
        .mount(&server)
        .await;
    let service = service(&server);
    let ClaimOutcome::Claimed(claim) =
        service.claim(org, SCOPE, "run-1:step-1", &email_hash(), LEASE).await.expect("a claim")
    else {
        panic!("try_claim answered a row, so the key is ours");
    };
    // Act
    let ending = service.complete(&claim, Completion::resource("nylas.message", "m-1")).await.expect("a completion");
    // Assert
    assert_eq!(ending, Ending::Recorded);
    let complete = requests(&server)
        .await
        .into_iter()
        .find(|r| r.url.path() == "/rpc/idempotency_complete")
        .expect("complete was called");
    let body: Value = complete.body_json().unwrap();
    let object = body.as_object().expect("a JSON object");
    assert!(!object.contains_key("p_response"), "{body}");
    assert_eq!(object.len(), 5, "{body}");
    assert_eq!(object.get("p_organization_id"), Some(&json!(org)), "the claim is addressed by its organization too");
    server.verify().await;
}

// ---------------------------------------------------------------------------
// Rows that are not the caller's
// ---------------------------------------------------------------------------

#[tokio::test]
async fn a_row_for_another_tenant_key_or_token_is_never_acted_on() {
    // The store must answer the row asked for; anything else is a deployment
    // to distrust, never a replay or an ownership to act on.
    let server = MockServer::start().await;
    let mut stored = claim_row(Uuid::new_v4(), Uuid::new_v4(), SCOPE, &email_hash(), "completed");
    stored["response"] = json!({"secret": "of another tenant"});
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_get"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!([stored])))
        .mount(&server)
        .await;
    // The claim answers "claimed" with a row of another tenant, holding
    // someone else's token.
    let mut foreign = claim_row(Uuid::new_v4(), Uuid::new_v4(), SCOPE, &email_hash(), "processing");
    foreign["outcome"] = json!("claimed");
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_claim"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!([foreign])))
        .mount(&server)
        .await;
    let service = service(&server);
    let read = service.read(Uuid::new_v4(), SCOPE, "run-1:step-1", &email_hash()).await;
    assert!(matches!(read, Err(Error::Inconsistent(_))), "{read:?}");
    let claimed = service.claim(Uuid::new_v4(), SCOPE, "run-1:step-1", &email_hash(), LEASE).await;
    assert!(matches!(claimed, Err(Error::Inconsistent(_))), "{claimed:?}");
}

/// A claim that answers the caller's own row, under its own token, but
/// with a lease already passed: what a store that stamped the lease before
/// a lock wait would answer.
struct LapsedClaim;

impl wiremock::Respond for LapsedClaim {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let args: Value = serde_json::from_slice(&request.body).expect("JSON arguments");
        let token: Uuid = serde_json::from_value(args["p_lease_token"].clone()).expect("a lease token");
        let mut row = claim_row(Uuid::new_v4(), token, SCOPE, &email_hash(), "processing");
        for (column, argument) in [("organization_id", "p_organization_id"), ("scope", "p_scope"), ("key", "p_key")] {
            row[column] = args[argument].clone();
        }
        row["lease_live"] = json!(false);
        row["outcome"] = json!("claimed");
        ResponseTemplate::new(200).set_body_json(json!([row]))
    }
}

#[tokio::test]
async fn a_claim_answered_with_a_lease_already_passed_is_not_handed_out() {
    // Arrange
    let server = MockServer::start().await;
    Mock::given(method("POST")).and(path("/rpc/idempotency_claim")).respond_with(LapsedClaim).mount(&server).await;
    // Act
    let outcome = service(&server).claim(Uuid::new_v4(), SCOPE, "run-1:step-1", &email_hash(), LEASE).await;
    // Assert: not Claimed, and transient, so the caller's retry reclaims it.
    match outcome {
        Err(error @ Error::LeaseLapsed { .. }) => assert!(error.is_transient()),
        other => panic!("expected LeaseLapsed, got {other:?}"),
    }
}
