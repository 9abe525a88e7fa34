//! Error codes this crate reacts to, named so callers need no string literals:
//! PostgREST's own (`PGRSTnnn`), the SQLSTATEs it passes on, and the plane's
//! (`IDEMn`).

/// 503: PostgREST cannot connect to the database. The request never ran.
pub const PGRST000: &str = "PGRST000";
/// 503: database client error, e.g. the connection dropped mid-request.
pub const PGRST001: &str = "PGRST001";
/// 503: the schema cache is not loaded yet. The request never ran.
pub const PGRST002: &str = "PGRST002";
/// 504: timed out waiting for a pool connection. The request never ran.
pub const PGRST003: &str = "PGRST003";
/// 406: the requested schema is not exposed (`db-schemas`).
pub const PGRST106: &str = "PGRST106";
/// postrust-server's answer (HTTP 500) when its database connection could
/// not be made or broke during the call; PostgREST answers 503 for both.
pub const PGRST500: &str = "PGRST500";
/// 404: no function with these argument names.
pub const PGRST202: &str = "PGRST202";
/// 401: JWT malformed or badly signed.
pub const PGRST301: &str = "PGRST301";
/// 401: JWT claims invalid, e.g. expired.
pub const PGRST303: &str = "PGRST303";
/// SQLSTATE insufficient_privilege: 401 as the anonymous role, 403 otherwise.
pub const INSUFFICIENT_PRIVILEGE: &str = "42501";
/// SQLSTATE unique_violation (409).
pub const UNIQUE_VIOLATION: &str = "23505";
/// SQLSTATE check_violation (400).
pub const CHECK_VIOLATION: &str = "23514";
/// SQLSTATE invalid_parameter_value (400): what the plane's functions raise
/// for bad arguments.
pub const INVALID_PARAMETER_VALUE: &str = "22023";
/// SQLSTATE serialization_failure (500): rolled back, safe to retry.
pub const SERIALIZATION_FAILURE: &str = "40001";
/// SQLSTATE deadlock_detected (500): rolled back, safe to retry.
pub const DEADLOCK_DETECTED: &str = "40P01";
/// The plane's own (400): the scope has no row in
/// `agent.idempotency_scopes`, so it has no retention. Nothing written.
pub const UNKNOWN_SCOPE: &str = "IDEM1";
/// The plane's own (400): the response is above its scope's
/// `max_response_bytes`. Nothing written; the claim stays processing.
pub const RESPONSE_TOO_LARGE: &str = "IDEM2";
/// The plane's own (400): the response nests arrays and objects deeper
/// than 64 levels, more than every client reads back. Nothing written;
/// the claim stays processing.
pub const RESPONSE_TOO_DEEP: &str = "IDEM3";
/// The plane's own (400): a fenced Run admission whose claim is not
/// held by its lease token (completed, released, another
/// organization's, or its lease passed). No Run admitted.
pub const FENCE_LOST: &str = "IDEM4";
/// The plane's own (400): the request a claim carries is above its
/// scope's `max_request_bytes` (as compact JSON). Nothing written.
pub const REQUEST_TOO_LARGE: &str = "IDEM5";
/// The plane's own (400): the request a claim carries nests arrays and
/// objects deeper than 64 levels. Nothing written.
pub const REQUEST_TOO_DEEP: &str = "IDEM6";
/// SQLSTATE lock_not_available (500): the call waited longer than the
/// plane's `lock_timeout` for a row another transaction holds; rolled
/// back, nothing written.
pub const LOCK_NOT_AVAILABLE: &str = "55P03";
