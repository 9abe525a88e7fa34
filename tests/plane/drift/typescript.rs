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
