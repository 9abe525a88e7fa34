//! The crate's error: bad input, an unknown scope, or a store we could not
//! reach or understand. Outcomes such as a conflict are values
//! ([`ClaimOutcome`](crate::ClaimOutcome)), never errors.

use std::time::Duration;

use crate::postgrest::ClientError;

/// Everything a call into the plane can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The input was refused before any request was sent.
    #[error(transparent)]
    Invalid(#[from] InvalidInput),

    /// The scope is not in the registry, so it has no retention.
    #[error("unknown scope {scope:?}: register it with a retention before using it")]
    UnknownScope {
        /// The scope asked for.
        scope: String,
    },

    /// The store could not be reached, refused the call, or answered
    /// something undecodable. See [`ClientError`] for the cases.
    #[error(transparent)]
    Store(#[from] ClientError),

    /// The key changed hands more often than one claim will follow (claimed,
    /// released and claimed again while we read it). Transient: retry later.
    #[error("the key kept changing hands; gave up after {steps} steps")]
    Contended {
        /// Repository steps taken.
        steps: u32,
    },

    /// The store answered something the contract rules out, e.g. two rows for
    /// one key. A deployment with a mismatched SQL surface, most likely.
    #[error("the store answered inconsistently: {0}")]
    Inconsistent(String),
}

impl Error {
    /// True when retrying the same call later may succeed (a transient store
    /// failure); false for bad input or a refusal that will repeat.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Store(e) => e.is_retryable(true),
            Error::Contended { .. } => true,
            _ => false,
        }
    }
}

/// Input refused before any request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidInput {
    /// The key is empty.
    #[error("the idempotency key is empty")]
    EmptyKey,
    /// The key is longer than the table accepts.
    #[error("the idempotency key has {chars} characters, at most {max} are accepted")]
    KeyTooLong {
        /// Its length in characters.
        chars: usize,
        /// The limit.
        max: usize,
    },
    /// The scope is empty.
    #[error("the scope is empty")]
    EmptyScope,
    /// The scope is longer than the table accepts.
    #[error("the scope has {chars} characters, at most {max} are accepted")]
    ScopeTooLong {
        /// Its length in characters.
        chars: usize,
        /// The limit.
        max: usize,
    },
    /// The scope holds characters outside `a-z 0-9 . _ -`.
    #[error("the scope {scope:?} may hold only a-z, 0-9, '.', '_' and '-'")]
    MalformedScope {
        /// The scope (cut to 128 characters).
        scope: String,
    },
    /// The request hash is not 64 lowercase hex digits.
    #[error("the request hash {value:?} is not a lowercase hex SHA-256")]
    MalformedHash {
        /// The value (cut to 80 characters).
        value: String,
    },
    /// The key holds a NUL character, which PostgreSQL text cannot store.
    #[error("the idempotency key holds a NUL character")]
    KeyHasNul,
    /// The lease is shorter than the store accepts.
    #[error("the lease {lease:?} is shorter than the {min:?} the store accepts")]
    LeaseTooShort {
        /// The lease asked for.
        lease: Duration,
        /// The limit.
        min: Duration,
    },
    /// The lease is longer than the store accepts.
    #[error("the lease {lease:?} is longer than the {max:?} the store accepts")]
    LeaseTooLong {
        /// The lease asked for.
        lease: Duration,
        /// The limit.
        max: Duration,
    },
    /// A completion with no response and no resource would replay an empty success.
    #[error("a completion must carry a response or a resource")]
    EmptyCompletion,
    /// A response above the store limit, with no resource to point at
    /// instead. Nothing was sent: the claim is still ours to retry or release.
    #[error("the response is {size} bytes, above the {limit}-byte store limit, and names no resource to point at")]
    ResponseTooLarge {
        /// Its size as compact JSON.
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// A response shaped like a stored `ResponseRef` (`{"$response_ref": …}`
    /// alone), which a replay would mistake for a reference.
    #[error("a response may not be an object whose only key is \"$response_ref\"")]
    ReservedResponseShape,
    /// A Run needs an input to be admitted with.
    #[error("a Run needs a non-null input")]
    MissingRunInput,
    /// A resource reference with an empty type or id.
    #[error("a resource needs a non-empty type and id")]
    EmptyResource,
    /// A resource type or id longer than the table accepts.
    #[error("the resource {field} has {chars} characters, at most {max} are accepted")]
    ResourceTooLong {
        /// `type` or `id`.
        field: &'static str,
        /// Its length in characters.
        chars: usize,
        /// The limit.
        max: usize,
    },
    /// A scope registered with a retention the store does not accept.
    #[error("scope {scope:?} is registered with retention {retention:?}; it must be between 1 s and 366 days")]
    RetentionOutOfRange {
        /// The scope.
        scope: String,
        /// Its registered retention.
        retention: Duration,
    },
}
