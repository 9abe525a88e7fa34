//! The request hash is RFC 8785 (JCS) canonical JSON, SHA-256, lowercase
//! hex, so a JavaScript or Python caller hashing the same request gets the
//! same hash. `tests/vectors/request_hash.json` was produced with the npm
//! `canonicalize` package (the RFC's reference implementation) and Node's
//! SHA-256; the postgrest-js interop check verifies every vector with that
//! package too. These run with every feature set, since the embedded
//! stack's build keeps JSON numbers as written and a library user's does not.

use idempotency_plane::{canonical_json, RequestHash};
use serde::Deserialize;
use serde_json::Value;

#[derive(Deserialize)]
struct Vector {
    input: Value,
    canonical: String,
    sha256: String,
}

fn vectors() -> Vec<Vector> {
    let text = include_str!("../../vectors/request_hash.json");
    serde_json::from_str(text).expect("tests/vectors/request_hash.json is an array of vectors")
}

#[test]
fn every_request_hash_vector_canonicalizes_and_hashes_as_the_reference_implementation_does() {
    let vectors = vectors();
    assert!(vectors.len() >= 25, "{} vectors", vectors.len());
    for vector in &vectors {
        assert_eq!(canonical_json(&vector.input), vector.canonical, "input {}", vector.input);
        assert_eq!(RequestHash::of_json(&vector.input).as_str(), vector.sha256, "input {}", vector.input);
    }
}

#[test]
fn the_vectors_cover_key_order_escapes_nesting_and_numbers() {
    let canonical: Vec<String> = vectors().into_iter().map(|v| v.canonical).collect();
    let covers = |needle: &str| canonical.iter().any(|c| c.contains(needle));
    // UTF-16 order: U+1F600 (a surrogate pair, 0xD83D...) sorts before U+FF61.
    assert!(covers("\"😀\":\"grinning\",\"｡\""), "key order by UTF-16 code units");
    assert!(covers("\\u0000\\u0001\\u001f"), "control escapes");
    assert!(covers("[[[[[["), "nesting");
    for number in ["1e+21", "1e-7", "0.1", "9007199254740992", "18446744073709552000", "0.000001"] {
        assert!(covers(number), "number {number}");
    }
}
