//! The plane hashes a JSON request as every client does: for each shared
//! vector (`tests/vectors/request_hash.json`, made with RFC 8785's reference
//! implementation), `agent.idempotency_canonical_json` writes the canonical
//! text and `agent.idempotency_request_hash` its SHA-256, exactly as the
//! Rust crate and the TypeScript client do, from the vector's JSON text as
//! written (numbers spelled `1.0`, `1e+21`, `100.0` included). The queue
//! functions hash each message's payload with it, so a claim made in the
//! database and one a client made agree.

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::support::harness::*;

#[derive(Deserialize)]
struct Vector<'a> {
    #[serde(borrow)]
    input: &'a RawValue,
    canonical: String,
    sha256: String,
}

#[tokio::test]
async fn the_plane_canonicalizes_and_hashes_every_vector_as_the_clients_do() {
    let stack = stack().await;
    let vectors: Vec<Vector<'_>> =
        serde_json::from_str(include_str!("../../vectors/request_hash.json")).expect("the vectors");
    let mut hashed = 0;
    for vector in &vectors {
        let answer: Result<(String, String), sqlx::Error> = sqlx::query_as(
            "select agent.idempotency_canonical_json($1::jsonb), agent.idempotency_request_hash($1::jsonb)",
        )
        .bind(vector.input.get())
        .fetch_one(stack.db())
        .await;
        match answer {
            Ok((canonical, hash)) => {
                assert_eq!(canonical, vector.canonical, "input {}", vector.input);
                assert_eq!(hash, vector.sha256, "input {}", vector.input);
                hashed += 1;
            }
            // PostgreSQL text holds no NUL: jsonb refuses \u0000 outright,
            // so no such request ever reaches the plane's hash.
            Err(error) if vector.input.get().contains("\\u0000") => {
                let code = error.as_database_error().and_then(|db| db.code().map(|code| code.into_owned()));
                assert_eq!(code.as_deref(), Some("22P05"), "{error}");
            }
            Err(error) => panic!("input {}: {error}", vector.input),
        }
    }
    assert!(hashed >= vectors.len() - 1, "{hashed} of {} vectors hashed", vectors.len());
    stack.stop().await.unwrap();
}

/// A number no IEEE 754 double holds is refused (a JavaScript client reads
/// it as infinity, and no hash of it can agree); one below the least
/// double is zero to every client, and to the plane.
#[tokio::test]
async fn a_number_beyond_every_double_is_refused_and_one_below_the_least_is_zero() {
    let stack = stack().await;
    for beyond in ["1e400", "-1e400", "1.7976931348623159e308"] {
        let refused = sqlx::query_scalar::<_, String>("select agent.idempotency_canonical_json($1::jsonb)")
            .bind(format!("[{beyond}]"))
            .fetch_one(stack.db())
            .await
            .expect_err("beyond every double");
        let code = refused.as_database_error().and_then(|db| db.code().map(|code| code.into_owned()));
        assert_eq!(code.as_deref(), Some("22003"), "{beyond}: {refused}");
    }
    for (number, canonical) in [
        ("1e-400", "[0]"),
        ("1.7976931348623157e308", "[1.7976931348623157e+308]"),
        ("5e-324", "[5e-324]"),
        ("0.000001", "[0.000001]"),
        ("0.0000001", "[1e-7]"),
        ("123456789012345678901234", "[1.2345678901234569e+23]"),
        ("100.0", "[100]"),
        ("-0.0", "[0]"),
        ("12.50", "[12.5]"),
    ] {
        let written: String = sqlx::query_scalar("select agent.idempotency_canonical_json($1::jsonb)")
            .bind(format!("[{number}]"))
            .fetch_one(stack.db())
            .await
            .expect("a canonical form");
        assert_eq!(written, canonical, "{number}");
    }
    stack.stop().await.unwrap();
}
