//! Hostile keys on the real stack: keys with SQL metacharacters
//! and unicode are stored and found verbatim, lookups match exactly, and bad
//! keys, hashes, leases and responses are refused (by the service before any
//! request, by the database from any other client) and store nothing.

use std::time::Duration;

use idempotency_plane::postgrest::{ClientError, Repeat};
use idempotency_plane::repo::{ClaimRequest, CompletionArgs, IdempotencyRepository};
use idempotency_plane::service::Unstorable;
use idempotency_plane::{
    Completion, Ending, Error, InvalidInput, PostgrestRepository, ReadOutcome, RequestHash, ResourceRef,
};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::hostile::SCOPE;

/// Keys that break naive SQL, LIKE patterns, URLs, JSON or text handling.
fn hostile_keys() -> Vec<String> {
    let mut keys: Vec<String> = [
        "'; drop table agent.idempotency_keys; --",
        "%_\\",
        "%",
        "_",
        "\\",
        "\\\\",
        "\"double\" 'single' `back` ''",
        "a' OR '1'='1",
        "$$; select pg_sleep(10); $$",
        "back\\slash \\n \\t \\u0000 \\x00 \\'",
        "C:\\Windows\\System32\\",
        "?select=*&p_key=other#frag",
        "/rpc/idempotency_get",
        "{\"p_key\": \"injected\"}",
        "[1,2]",
        "null",
        "NULL",
        "true",
        "1e5",
        "  leading and trailing  ",
        "tab\there\r\nnewline\n",
        "\u{1}\u{1F}\u{7F}",
        "\u{2028}\u{2029}",
        "🦀🔥👩\u{200D}👩\u{200D}👧\u{200D}👦",
        "שלום عليكم \u{202E}txt.exe",
        "e\u{301} a\u{308}\u{323} Z\u{36B}\u{351}\u{30C}",
        "\u{FEFF}bom \u{FFFF} \u{10FFFF} \u{E000}",
        "ǅ ß ﬁ İ ı",
    ]
    .iter()
    .map(|k| k.to_string())
    .collect();
    keys.push("é".repeat(512));
    keys.push("🦀".repeat(512));
    keys.push("'".repeat(512));
    keys
}

/// `organization_id, key, status, resource_id, response ->> 'key'` of one row.
type StoredRow = (Uuid, String, String, Option<String>, Option<String>);

/// One hostile key: claimed, completed with itself as answer and resource,
/// then found verbatim by `read`. Answers the organization it used.
async fn store_and_read(service: &crate::support::harness::Service, key: &str) -> Uuid {
    let org = crate::support::harness::org();
    let hash = RequestHash::of_json(&json!({ "key": key }));
    let claim =
        crate::support::harness::claimed(service.claim(org, SCOPE, key, &hash, crate::support::harness::LEASE).await);
    assert_eq!(claim.key(), key);
    let completion = Completion::response(json!({ "key": key })).with_resource("hostile.echo", key);
    assert_eq!(service.complete(&claim, completion).await.expect("complete"), Ending::Recorded, "{key:?}");
    let expected = ReadOutcome::Completed {
        response: Some(json!({ "key": key })),
        resource: Some(ResourceRef { resource_type: "hostile.echo".into(), resource_id: key.to_owned() }),
        response_ref: None,
    };
    assert_eq!(service.read(org, SCOPE, key, &hash).await.expect("read"), expected, "{key:?}");
    org
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_with_sql_metacharacters_and_unicode_are_stored_and_found_verbatim() {
    // Arrange
    let stack = crate::support::harness::stack().await;
    let service = crate::support::harness::service(&stack);
    let keys = hostile_keys();
    // Act: every key claimed, completed and read back through the service.
    let orgs = futures::future::join_all(keys.iter().map(|key| store_and_read(&service, key))).await;
    // Assert: the database holds each one byte for byte, once.
    let rows: Vec<StoredRow> = sqlx::query_as(
        "select organization_id, key, status, resource_id, response ->> 'key' from agent.idempotency_keys",
    )
    .fetch_all(stack.db())
    .await
    .expect("read the rows back");
    assert_eq!(rows.len(), keys.len());
    for (org, key) in orgs.into_iter().zip(&keys) {
        let stored: Vec<_> = rows.iter().filter(|row| row.0 == org).collect();
        let expected = (org, key.clone(), "completed".to_owned(), Some(key.clone()), Some(key.clone()));
        assert_eq!(stored, vec![&expected], "{key:?}");
    }
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn lookups_match_keys_exactly_with_no_wildcards_case_folding_trimming_or_normalization() {
    // Arrange
    let stack = crate::support::harness::stack().await;
    let service = crate::support::harness::service(&stack);
    let org = crate::support::harness::org();
    let hash = crate::support::harness::hash("exact");
    for key in ["abc", "caf\u{e9}"] {
        let claim = crate::support::harness::claimed(
            service.claim(org, SCOPE, key, &hash, crate::support::harness::LEASE).await,
        );
        let ending = service.complete(&claim, Completion::response(json!(key))).await.expect("complete");
        assert_eq!(ending, Ending::Recorded);
    }
    // Act / Assert: none of these is either stored key.
    for near in ["%", "_", "a%", "a_c", "_bc", "ABC", "Abc", "abc ", " abc", "ab", "abcd", "abc\u{200B}", "cafe\u{301}"]
    {
        assert_eq!(service.read(org, SCOPE, near, &hash).await.expect("read"), ReadOutcome::Absent, "{near:?}");
    }
    assert!(matches!(service.read(org, SCOPE, "caf\u{e9}", &hash).await, Ok(ReadOutcome::Completed { .. })));
    assert_eq!(crate::support::harness::count_rows(&stack).await, 2);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn oversized_empty_and_nul_keys_and_short_leases_are_refused_by_the_service_and_store_nothing() {
    // Arrange
    let stack = crate::support::harness::stack().await;
    let service = crate::support::harness::service(&stack);
    let hash = crate::support::harness::hash("refused");
    let huge = "k".repeat(100 * 1024);
    let cases: Vec<(&str, Duration, InvalidInput)> = vec![
        (&huge, crate::support::harness::LEASE, InvalidInput::KeyTooLong { chars: 100 * 1024, max: 512 }),
        ("", crate::support::harness::LEASE, InvalidInput::EmptyKey),
        ("a\u{0}b", crate::support::harness::LEASE, InvalidInput::KeyHasNul),
        ("run-1", Duration::ZERO, InvalidInput::LeaseTooShort { lease: Duration::ZERO, min: Duration::from_secs(1) }),
        (
            "run-1",
            Duration::from_millis(999),
            InvalidInput::LeaseTooShort { lease: Duration::from_millis(999), min: Duration::from_secs(1) },
        ),
    ];
    for (key, lease, expected) in cases {
        // Act
        let before = service.repository().client().requests_sent();
        let result = service.claim(crate::support::harness::org(), SCOPE, key, &hash, lease).await;
        // Assert
        match result {
            Err(Error::Invalid(actual)) => assert_eq!(actual, expected),
            other => panic!("expected Invalid({expected:?}), got {other:?}"),
        }
        assert_eq!(service.repository().client().requests_sent(), before, "{expected:?} sent a request");
    }
    assert_eq!(
        "A".repeat(64).parse::<RequestHash>(),
        Err(InvalidInput::MalformedHash { value: "A".repeat(64) }),
        "a malformed hash never becomes a RequestHash"
    );
    assert_eq!(crate::support::harness::count_rows(&stack).await, 0);
    stack.stop().await.unwrap();
}

/// A claim as the repository sends it, bypassing the service's checks.
fn raw_claim<'a>(key: &'a str, request_hash: &'a str, lease: Duration) -> ClaimRequest<'a> {
    ClaimRequest {
        organization_id: Uuid::new_v4(),
        scope: SCOPE,
        key,
        request_hash,
        lease_token: Uuid::new_v4(),
        lease,
        retain: Duration::from_secs(3600),
    }
}

fn assert_api_400(result: Result<impl std::fmt::Debug, Error>, codes: &[&str], what: &str) {
    match result {
        Err(Error::Store(ClientError::Api { status: 400, error, .. })) => {
            assert!(codes.contains(&error.code.as_str()), "{what}: code {} ({})", error.code, error.message)
        }
        other => panic!("{what}: expected Store(Api 400 {codes:?}), got {other:?}"),
    }
}

#[tokio::test]
async fn bad_keys_hashes_and_leases_that_bypass_the_service_are_refused_by_the_database_and_store_nothing() {
    // Arrange
    let stack = crate::support::harness::stack().await;
    let repository = PostgrestRepository::new(crate::support::harness::client(&stack));
    let good_hash = crate::support::harness::hash("bypass");
    let huge = "k".repeat(100 * 1024);
    let lease = crate::support::harness::LEASE;
    // Act / Assert: the functions' own checks (22023), before anything is read or written.
    let key_cases: [(&str, &str); 2] = [(&huge, "a 100 kB key"), ("", "an empty key")];
    for (key, what) in key_cases {
        assert_api_400(repository.try_claim(&raw_claim(key, good_hash.as_str(), lease)).await, &["22023"], what);
    }
    let nul = repository.try_claim(&raw_claim("a\u{0}b", good_hash.as_str(), lease)).await;
    assert_api_400(nul, &["22021"], "a key holding NUL");
    let upper = "A".repeat(64);
    let short = "a".repeat(63);
    for hash in ["", "not-a-hash", &upper, &short, "'; drop table agent.idempotency_keys; --"] {
        assert_api_400(repository.try_claim(&raw_claim("run-1", hash, lease)).await, &["22023"], hash);
    }
    for lease in [Duration::ZERO, Duration::from_millis(999), Duration::from_secs(86_401)] {
        let result = repository.try_claim(&raw_claim("run-1", good_hash.as_str(), lease)).await;
        assert_api_400(result, &["22023"], &format!("lease {lease:?}"));
    }
    let negative = crate::support::harness::client(&stack)
        .rpc::<Vec<Value>>(
            "idempotency_try_claim",
            &json!({
                "p_organization_id": Uuid::new_v4(), "p_scope": SCOPE, "p_key": "run-1",
                "p_request_hash": good_hash.as_str(), "p_lease_token": Uuid::new_v4(),
                "p_lease_ms": -1, "p_retain_ms": 3_600_000
            }),
            Repeat::Safe,
        )
        .await
        .map_err(Error::Store);
    assert_api_400(negative, &["22023"], "a negative lease");
    assert_eq!(crate::support::harness::count_rows(&stack).await, 0);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_response_holding_nul_is_refused_before_any_request_and_by_the_database_and_the_claim_stays_ours() {
    // Arrange
    let stack = crate::support::harness::stack().await;
    let service = crate::support::harness::service(&stack);
    let org = crate::support::harness::org();
    let hash = crate::support::harness::hash("nul response");
    let claim = crate::support::harness::claimed(
        service.claim(org, SCOPE, "run-1", &hash, crate::support::harness::LEASE).await,
    );
    let sent = service.repository().client().requests_sent();
    // Act
    let result = service.complete(&claim, Completion::response(json!({"text": "a\u{0}b"}))).await;
    let bypass = service
        .repository()
        .complete(
            claim.organization_id(),
            claim.id(),
            claim.lease_token(),
            CompletionArgs { response: Some(&json!({"text": "a\u{0}b"})), ..CompletionArgs::default() },
        )
        .await;
    // Assert: the service refuses it with a typed error before sending; the
    // database (jsonb cannot hold \u0000) refuses it from any other client.
    assert!(matches!(result, Err(Error::Invalid(InvalidInput::UnstorableResponse(Unstorable::Nul)))), "{result:?}");
    assert_eq!(service.repository().client().requests_sent(), sent + 1, "only the bypass was sent");
    assert_api_400(bypass, &["22P05"], "a response holding NUL");
    let status: String = sqlx::query_scalar("select status from agent.idempotency_keys where organization_id = $1")
        .bind(org)
        .fetch_one(stack.db())
        .await
        .expect("the claim row");
    assert_eq!(status, "processing");
    assert_eq!(service.release(&claim).await.expect("release"), Ending::Recorded);
    assert_eq!(crate::support::harness::count_rows(&stack).await, 0);
    stack.stop().await.unwrap();
}
