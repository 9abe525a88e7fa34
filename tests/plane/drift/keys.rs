//! The keys both clients derive, against `tests/vectors/keys.json`, which
//! the TypeScript client's tests check too: the vendor key a tenant hands
//! its vendor, the plane's key of a Run's step, and the key an
//! `Idempotency-Key` front door stores for one caller. A call guarded in
//! Rust and retried from TypeScript (or the other way round) must meet the
//! same claim and reach the vendor with the same key. The vectors were made
//! with Python's `hashlib`, independently of both clients.

use idempotency_plane::callers::tool::{vendor_key, ToolKey};
use idempotency_plane::service::caller_scoped_key;
use serde::Deserialize;
use uuid::Uuid;

#[derive(Deserialize)]
struct Vectors {
    vendor_key: Vec<VendorKey>,
    tool_key: Vec<StepKey>,
    caller_key: Vec<CallerKey>,
}

#[derive(Deserialize)]
struct CallerKey {
    principal: String,
    key: String,
    caller_key: String,
}

#[derive(Deserialize)]
struct VendorKey {
    organization_id: Uuid,
    scope: String,
    key: String,
    vendor_key: String,
}

#[derive(Deserialize)]
struct StepKey {
    run_id: Uuid,
    step_id: String,
    call_index: Option<u32>,
    key: String,
}

fn vectors() -> Vectors {
    serde_json::from_str(include_str!("../../vectors/keys.json"))
        .expect("tests/vectors/keys.json holds vendor_key, tool_key and caller_key vectors")
}

#[test]
fn every_vendor_key_vector_is_derived_alike() {
    let vectors = vectors().vendor_key;
    assert!(vectors.len() >= 5, "{} vectors", vectors.len());
    for v in &vectors {
        assert_eq!(
            vendor_key(v.organization_id, &v.scope, &v.key),
            v.vendor_key,
            "{} {} {}",
            v.organization_id,
            v.scope,
            v.key
        );
    }
}

#[test]
fn every_tool_key_vector_is_built_alike() {
    let vectors = vectors().tool_key;
    assert!(vectors.len() >= 5, "{} vectors", vectors.len());
    for v in &vectors {
        let key = match v.call_index {
            None => ToolKey::for_step(v.run_id, &v.step_id),
            Some(index) => ToolKey::for_step_call(v.run_id, &v.step_id, index),
        };
        assert_eq!(key.as_str(), v.key, "run {} step {:?} index {:?}", v.run_id, v.step_id, v.call_index);
    }
}

#[test]
fn every_caller_key_vector_is_derived_alike() {
    let vectors = vectors().caller_key;
    assert!(vectors.len() >= 5, "{} vectors", vectors.len());
    for v in &vectors {
        assert_eq!(caller_scoped_key(&v.principal, &v.key), v.caller_key, "{:?} {:?}", v.principal, v.key);
    }
}
