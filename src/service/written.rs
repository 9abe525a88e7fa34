//! Whether a call that failed may have written all the same: what decides
//! between asking again with the same token and giving up, for every
//! caller that ends or begins an effect.

use crate::error::Error;

/// Whether a call that failed with `error` (a claim, an admission) may have
/// written all the same: anything but a refusal sent back before the
/// database wrote (input the plane refuses, a scope without policy, an
/// organization a tenant router has no plane for, a 4xx answer, a client
/// that could not be configured). A lost or garbled
/// answer, a gateway's 5xx or a cut request may each follow the commit.
pub fn may_have_written(error: &Error) -> bool {
    use crate::postgrest::ClientError;
    !matches!(
        error,
        Error::Invalid(_)
            | Error::UnknownScope { .. }
            | Error::UnroutedOrganization { .. }
            | Error::Store(ClientError::Api { status: 400..=499, .. })
            | Error::Store(ClientError::Config(_) | ClientError::Key(_))
    )
}
