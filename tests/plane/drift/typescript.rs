//! What the Rust crate and the TypeScript client for Edge Functions share
//! as data files beside the TypeScript module, held against the Rust
//! constants they stand for.

use idempotency_plane::callers::idempotency_key::{BODY_HEADERS, CREDENTIAL_HEADERS};

#[test]
fn the_credential_headers_are_the_ones_the_typescript_middleware_reads() {
    let file: serde_json::Value =
        serde_json::from_str(include_str!("../../../supabase/functions/_shared/idempotency/credential_headers.json"))
            .expect("credential_headers.json parses");
    let listed: Vec<&str> =
        file["headers"].as_array().expect("a headers array").iter().filter_map(|v| v.as_str()).collect();
    assert_eq!(listed, CREDENTIAL_HEADERS);
}

#[test]
fn the_body_headers_are_the_ones_the_typescript_middleware_reads() {
    let file: serde_json::Value =
        serde_json::from_str(include_str!("../../../supabase/functions/_shared/idempotency/body_headers.json"))
            .expect("body_headers.json parses");
    let listed: Vec<&str> =
        file["headers"].as_array().expect("a headers array").iter().filter_map(|v| v.as_str()).collect();
    assert_eq!(listed, BODY_HEADERS);
}

#[test]
fn the_webhook_body_limits_are_the_ones_the_typescript_gate_reads() {
    use idempotency_plane::callers::webhook::{
        stored_body_bound, DEFAULT_WEBHOOK_BODY_LIMIT, WEBHOOK_SCOPE_MAX_REQUEST_BYTES,
    };
    let file: serde_json::Value =
        serde_json::from_str(include_str!("../../../supabase/functions/_shared/idempotency/webhook_limits.json"))
            .expect("webhook_limits.json parses");
    assert_eq!(file["body_limit_bytes"].as_u64(), Some(DEFAULT_WEBHOOK_BODY_LIMIT as u64));
    assert_eq!(file["webhook_scope_max_request_bytes"].as_u64(), Some(WEBHOOK_SCOPE_MAX_REQUEST_BYTES));
    assert!(stored_body_bound(DEFAULT_WEBHOOK_BODY_LIMIT as u64) <= WEBHOOK_SCOPE_MAX_REQUEST_BYTES);
    // The seeded webhook.* row, as the declared schema writes it.
    let scopes = include_str!("../../../supabase/schemas/20_table_idempotency_scopes.sql");
    let row = scopes.lines().find(|line| line.contains("VALUES ('webhook.*'")).expect("the webhook.* row");
    assert!(row.ends_with(&format!("65536, {WEBHOOK_SCOPE_MAX_REQUEST_BYTES}, 5);")), "{row}");
}
