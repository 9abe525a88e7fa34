//! Key, scope and lease validation: invalid keys, malformed scopes
//! and leases outside one second to one day are refused by claim and read
//! before any request; valid ones reach the transport.

use std::time::Duration;

use idempotency_plane::postgrest::{ClientConfig, ClientError, PostgrestClient, RetryConfig, TransportKind};
use idempotency_plane::{Error, IdempotencyService, InvalidInput, PostgrestRepository, RequestHash};
use proptest::prelude::*;
use proptest::test_runner::TestRunner;
use serde_json::json;
use uuid::Uuid;

use crate::hostile::{proptest_config, SCOPE};
use crate::support::transport::{RefusedPort, KEY};

/// A service whose client points at a port that refuses connections, without
/// retries: any request it sends fails with a connect error at once. The
/// port refuses for as long as the `RefusedPort` lives (see there why a
/// freed port would not do), so keep it for the whole test.
fn unreachable_service() -> (IdempotencyService<PostgrestRepository>, RefusedPort) {
    let port = RefusedPort::new();
    let config = ClientConfig::new(&port.url(), KEY)
        .expect("config")
        .with_retry(RetryConfig::disabled())
        .with_connect_timeout(Duration::from_millis(500));
    (IdempotencyService::new(PostgrestRepository::new(PostgrestClient::new(config).expect("client"))), port)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime")
}

fn sent(service: &IdempotencyService<PostgrestRepository>) -> u64 {
    service.repository().client().requests_sent()
}

/// Asserts one call's result against the input errors that apply to it (any
/// of them may be reported): none means the call went out and met the
/// refused port; some means no request at all.
fn check_validation<T: std::fmt::Debug>(
    result: Result<T, Error>,
    applicable: &[Error],
    requests: u64,
) -> Result<(), TestCaseError> {
    if applicable.is_empty() {
        prop_assert!(
            matches!(result, Err(Error::Store(ClientError::Transport { kind: TransportKind::Connect, .. }))),
            "valid input must reach the transport: {result:?}"
        );
        prop_assert_eq!(requests, 1);
    } else {
        let error = result.expect_err("invalid input is an error");
        prop_assert!(
            applicable.iter().any(|expected| same_error(expected, &error)),
            "expected one of {applicable:?}, got {error:?}"
        );
        prop_assert_eq!(requests, 0, "invalid input sent a request: {:?}", error);
    }
    Ok(())
}

fn same_error(expected: &Error, actual: &Error) -> bool {
    match (expected, actual) {
        (Error::Invalid(a), Error::Invalid(b)) => a == b,
        (Error::UnknownScope { scope: a }, Error::UnknownScope { scope: b }) => a == b,
        _ => false,
    }
}

/// Keys: mostly short unicode, some empty, some with NUL, some past 512 characters.
fn key_text() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::collection::vec(any::<char>(), 0..24).prop_map(String::from_iter),
        1 => Just(String::new()),
        1 => ("[a-z:0-9-]{0,8}", "[a-z:0-9-]{0,8}").prop_map(|(a, b)| format!("{a}\u{0}{b}")),
        1 => (500usize..530, prop::sample::select(vec!['k', 'é', '🦀', '\u{301}']))
            .prop_map(|(n, c)| std::iter::repeat_n(c, n).collect()),
        1 => (505usize..520).prop_map(|n| format!("{}\u{0}", "k".repeat(n))),
    ]
}

fn key_errors(key: &str) -> Vec<Error> {
    let mut errors = Vec::new();
    let chars = key.chars().count();
    if key.is_empty() {
        errors.push(Error::Invalid(InvalidInput::EmptyKey));
    }
    if chars > 512 {
        errors.push(Error::Invalid(InvalidInput::KeyTooLong { chars, max: 512 }));
    }
    if key.contains('\0') {
        errors.push(Error::Invalid(InvalidInput::KeyHasNul));
    }
    errors
}

#[test]
fn invalid_keys_are_refused_by_claim_and_read_before_any_request_and_valid_ones_reach_the_transport() {
    let runtime = runtime();
    let (service, _refused) = unreachable_service();
    let hash = RequestHash::of_json(&json!({"to": "a@example.com"}));
    let mut runner = TestRunner::new(proptest_config());
    runner
        .run(&(key_text(), any::<u128>()), |(key, org)| {
            let org = Uuid::from_u128(org);
            let applicable = key_errors(&key);
            runtime.block_on(async {
                let before = sent(&service);
                let claimed = service.claim(org, SCOPE, &key, &hash, Duration::from_secs(60)).await;
                check_validation(claimed, &applicable, sent(&service) - before)?;
                let before = sent(&service);
                let read = service.read(org, SCOPE, &key, &hash).await;
                check_validation(read, &applicable, sent(&service) - before)
            })
        })
        .unwrap();
}

/// Scopes: the allowed alphabet and its neighbours, family prefixes, and
/// lengths around 128.
fn scope_text() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z0-9._-]{0,12}",
        "(tool|webhook|surface)[.]?[a-z0-9._-]{0,8}",
        "tool\\.[a-zA-Z0-9._/ \u{e9}\u{0}-]{0,8}",
        Just(String::from("surface.saved_search.start")),
        (120usize..136).prop_map(|n| format!("tool.{}", "x".repeat(n - 5))),
        prop::collection::vec(any::<char>(), 0..16).prop_map(String::from_iter),
    ]
}

fn scope_errors(scope: &str) -> Vec<Error> {
    let chars = scope.chars().count();
    let mut errors = Vec::new();
    if scope.is_empty() {
        errors.push(Error::Invalid(InvalidInput::EmptyScope));
    }
    if chars > 128 {
        errors.push(Error::Invalid(InvalidInput::ScopeTooLong { chars, max: 128 }));
    }
    if !scope.bytes().all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'.' | b'_' | b'-')) {
        errors.push(Error::Invalid(InvalidInput::MalformedScope { scope: scope.chars().take(128).collect() }));
    }
    // Whether a well-formed scope has a policy is the database's to say.
    errors
}

#[test]
fn malformed_scopes_are_refused_by_claim_and_read_before_any_request_and_well_formed_ones_reach_the_transport() {
    let runtime = runtime();
    let (service, _refused) = unreachable_service();
    let hash = RequestHash::of_json(&json!({"to": "a@example.com"}));
    let mut runner = TestRunner::new(proptest_config());
    runner
        .run(&scope_text(), |scope| {
            let org = Uuid::new_v4();
            let applicable = scope_errors(&scope);
            runtime.block_on(async {
                let before = sent(&service);
                let claimed = service.claim(org, &scope, "run-1:step-1", &hash, Duration::from_secs(60)).await;
                check_validation(claimed, &applicable, sent(&service) - before)?;
                let before = sent(&service);
                let read = service.read(org, &scope, "run-1:step-1", &hash).await;
                check_validation(read, &applicable, sent(&service) - before)
            })
        })
        .unwrap();
}

#[test]
fn leases_outside_one_second_to_one_day_are_refused_before_any_request() {
    let runtime = runtime();
    let (service, _refused) = unreachable_service();
    let hash = RequestHash::of_json(&json!({"to": "a@example.com"}));
    let day = Duration::from_secs(24 * 60 * 60);
    let lease = prop_oneof![
        (0u64..3_000_000_000).prop_map(Duration::from_nanos),
        (86_398_000u64..86_402_000).prop_map(Duration::from_millis),
        (0u64..=u64::MAX).prop_map(Duration::from_secs),
    ];
    let mut runner = TestRunner::new(proptest_config());
    runner
        .run(&lease, |lease| {
            let applicable = if lease < Duration::from_secs(1) {
                vec![Error::Invalid(InvalidInput::LeaseTooShort { lease, min: Duration::from_secs(1) })]
            } else if lease > day {
                vec![Error::Invalid(InvalidInput::LeaseTooLong { lease, max: day })]
            } else {
                Vec::new()
            };
            runtime.block_on(async {
                let before = sent(&service);
                let claimed = service.claim(Uuid::new_v4(), SCOPE, "run-1:step-1", &hash, lease).await;
                check_validation(claimed, &applicable, sent(&service) - before)
            })
        })
        .unwrap();
}
