//! The crate's error: bad input, an unknown scope, or a store we could not
//! reach or understand. Outcomes such as a conflict are values
//! ([`ClaimOutcome`](crate::ClaimOutcome)), never errors.

use std::time::Duration;

use uuid::Uuid;

use crate::postgrest::ClientError;

/// Everything a call into the plane can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The input was refused before any request was sent.
    #[error(transparent)]
    Invalid(#[from] InvalidInput),

    /// The scope has no policy (`agent.idempotency_scopes`), so it has no
    /// retention; the database refused the claim (`IDEM1`) and wrote nothing.
    #[error("unknown scope {scope:?}: add it (or its family, e.g. tool.*) to agent.idempotency_scopes")]
    UnknownScope {
        /// The scope asked for.
        scope: String,
    },

    /// A [`TenantRouter`](crate::repo::TenantRouter) has no plane for the
    /// organization: it is assigned to none, and the router has no default.
    /// Nothing was sent to any plane. Not transient: the router's
    /// configuration must assign the organization (or name a default).
    #[error("organization {organization_id} is assigned to no plane, and the tenant router has no default plane")]
    UnroutedOrganization {
        /// The organization asked for.
        organization_id: Uuid,
    },

    /// The store could not be reached, refused the call, or answered
    /// something undecodable. See [`ClientError`] for the cases.
    #[error(transparent)]
    Store(#[from] ClientError),

    /// The store answered a claim whose lease had already passed by its own
    /// clock (a database whose functions stamp the lease before a lock wait).
    /// Not handed out: another worker could reclaim it while this one ran
    /// the effect. Transient: a retry reclaims it.
    #[error("the store answered a claim whose lease had already passed at {lease_expires_at}")]
    LeaseLapsed {
        /// When the lease passed, by the database clock.
        lease_expires_at: chrono::DateTime<chrono::Utc>,
    },

    /// The store answered something the contract rules out, e.g. two rows for
    /// one key. A deployment with a mismatched SQL surface, most likely.
    #[error("the store answered inconsistently: {0}")]
    Inconsistent(String),
}

impl Error {
    /// A short name of the error's kind, as spans record it (`error.type`):
    /// `invalid`, `unknown_scope`, `unrouted_organization`,
    /// `lease_lapsed`, `inconsistent`, or the store's
    /// [`ClientError::kind`] (`timeout`, `connect`, `api`, …).
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Invalid(_) => "invalid",
            Error::UnknownScope { .. } => "unknown_scope",
            Error::UnroutedOrganization { .. } => "unrouted_organization",
            Error::Store(store) => store.kind(),
            Error::LeaseLapsed { .. } => "lease_lapsed",
            Error::Inconsistent(_) => "inconsistent",
        }
    }

    /// True when a completion failed because of the answer itself, data the
    /// store cannot hold, rather than the plane's availability.
    ///
    /// The one place that tells the two apart. After an effect happened:
    ///
    /// | completion failed with | it is | the caller |
    /// |---|---|---|
    /// | an answer refused before sending ([`InvalidInput`]: NUL, nesting, size, an empty or bad resource, an empty completion) | the caller's data | journals a stand-in (the [`EffectDriver`](crate::service::EffectDriver) does) |
    /// | a refusal by the database of the data (SQLSTATE class `22` data exception, `23` check, `54` program limit; `IDEM2` above the scope's response limit, `IDEM3` nested too deep) | the caller's data | journals a stand-in |
    /// | anything else: unreachable, timed out, a lock timeout, a 5xx | the plane's availability | releases if no effect happened; otherwise leaves the claim to its lease, whose passing makes it reclaimable |
    pub fn is_unstorable_answer(&self) -> bool {
        match self {
            Error::Invalid(input) => matches!(
                input,
                InvalidInput::EmptyCompletion
                    | InvalidInput::ResponseTooLarge { .. }
                    | InvalidInput::ReservedResponseShape
                    | InvalidInput::UnstorableResponse(_)
                    | InvalidInput::EmptyResource
                    | InvalidInput::ResourceTooLong { .. }
                    | InvalidInput::ResourceHasNul { .. }
            ),
            Error::Store(ClientError::Api { error, .. }) => {
                [crate::postgrest::codes::RESPONSE_TOO_LARGE, crate::postgrest::codes::RESPONSE_TOO_DEEP]
                    .contains(&error.code.as_str())
                    || ["22", "23", "54"].iter().any(|class| error.code.starts_with(class))
            }
            _ => false,
        }
    }

    /// True when the request provably never reached the plane: the connection
    /// was refused, or the server answered that it could not reach the
    /// database. Nothing was claimed, so a caller may bypass the plane (the
    /// `Idempotency-Key` layer's fail-open does) without risking a key that
    /// someone now holds. After any other failure the claim may have been made.
    pub fn never_reached_the_plane(&self) -> bool {
        matches!(self, Error::Store(store) if store.never_reached_the_plane())
    }

    /// True when retrying the same call later may succeed (a transient store
    /// failure); false for bad input or a refusal that will repeat.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Store(e) => e.is_transient(),
            Error::LeaseLapsed { .. } => true,
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
    /// A duration that must be above zero (an effect's timeout, its
    /// journal's deadline) is zero.
    #[error("the {what} must be above zero")]
    ZeroDuration {
        /// Which duration.
        what: &'static str,
    },
    /// A lease margin below [`MIN_LEASE_MARGIN`](crate::service::MIN_LEASE_MARGIN):
    /// the last journal attempt, sent just before its deadline, could land
    /// after the lease, where a reclaim has fenced it off and a second
    /// worker runs the effect again.
    #[error("the lease margin {margin:?} is below the floor of {floor:?}: the journal's last attempt could land after the lease")]
    MarginBelowFloor {
        /// The margin asked for.
        margin: std::time::Duration,
        /// The least margin accepted.
        floor: std::time::Duration,
    },
    /// A Run's `max_run_duration` that is zero or above the 30-day cap
    /// ([`MAX_RUN_DURATION`](crate::callers::runs::MAX_RUN_DURATION)): a
    /// tool claim, the Run's replay journal, is kept 30 days, so no Run may
    /// run longer.
    #[error("max_run_duration {duration:?} must be above zero and at most {cap:?} (the tool retention)")]
    RunDurationOutOfRange {
        /// The duration asked for.
        duration: Duration,
        /// The cap.
        cap: Duration,
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
    /// A response the store cannot hold: a NUL character in a string or a
    /// key, or arrays and objects nested deeper than
    /// [`MAX_RESPONSE_DEPTH`](crate::storable::MAX_RESPONSE_DEPTH).
    #[error("the response cannot be stored ({}): PostgreSQL cannot hold U+0000, and a replay cannot read back more than {} levels of nesting", .0.as_str(), crate::storable::MAX_RESPONSE_DEPTH)]
    UnstorableResponse(crate::storable::Unstorable),
    /// A resource type or id holding a NUL character, which PostgreSQL text cannot store.
    #[error("the resource {field} holds a NUL character")]
    ResourceHasNul {
        /// `type` or `id`.
        field: &'static str,
    },
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(status: u16, code: &str) -> Error {
        Error::Store(ClientError::answered("idempotency_complete", status, code))
    }

    #[test]
    fn the_callers_data_is_told_from_the_planes_availability() {
        let data = [
            Error::from(InvalidInput::EmptyCompletion),
            InvalidInput::UnstorableResponse(crate::storable::Unstorable::Nul).into(),
            InvalidInput::ResponseTooLarge { size: 2, limit: 1 }.into(),
            InvalidInput::ResourceHasNul { field: "id" }.into(),
            refused(400, "22P05"),
            refused(400, "22003"),
            refused(400, "23514"),
            refused(500, "54001"),
            refused(400, "IDEM2"),
            refused(400, "IDEM3"),
        ];
        for error in &data {
            assert!(error.is_unstorable_answer(), "{error}");
        }
        let availability = [
            refused(503, "PGRST001"),
            refused(500, "40001"),
            refused(500, "57014"),
            Error::LeaseLapsed { lease_expires_at: chrono::Utc::now() },
            InvalidInput::EmptyKey.into(),
        ];
        for error in &availability {
            assert!(!error.is_unstorable_answer(), "{error}");
        }
    }
}
