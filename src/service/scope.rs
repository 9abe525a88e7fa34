//! Scopes: their shape, and the spec's retention constants.
//!
//! Each scope's retention and response limit live in the database
//! (`agent.idempotency_scopes`), which applies them to every client; the
//! constants here are the seeded values of the scope families, for callers
//! that reason about them (a tool's `max_run_duration` cap is the tool
//! retention). A caller's own scope lives with the caller.

use std::time::Duration;

use crate::error::InvalidInput;

/// Longest scope name the table accepts.
pub const MAX_SCOPE_CHARS: usize = 128;

/// One day.
pub const DAY: Duration = Duration::from_secs(24 * 60 * 60);

/// Retention of every tool scope (`tool.*`): the ceiling of
/// `max_run_duration` ([`MAX_RUN_DURATION`](crate::callers::runs::MAX_RUN_DURATION)
/// is this value, and the plane refuses a longer Run), because a Run can
/// wait on an approval for days and the claim is its replay journal. The
/// database refuses a shorter retention.
pub const TOOL_RETENTION: Duration = Duration::from_secs(30 * 24 * 60 * 60);

/// A scope is 1 to 128 characters of `a-z 0-9 . _ -`. Whether it has a
/// policy is the database's to say.
pub(crate) fn validate_scope(scope: &str) -> Result<(), InvalidInput> {
    if scope.is_empty() {
        return Err(InvalidInput::EmptyScope);
    }
    let chars = scope.chars().count();
    if chars > MAX_SCOPE_CHARS {
        return Err(InvalidInput::ScopeTooLong { chars, max: MAX_SCOPE_CHARS });
    }
    if !scope.bytes().all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'.' | b'_' | b'-')) {
        return Err(InvalidInput::MalformedScope { scope: scope.chars().take(MAX_SCOPE_CHARS).collect() });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_scopes_are_refused_before_any_request() {
        assert!(validate_scope("tool.email.send").is_ok());
        assert_eq!(validate_scope(""), Err(InvalidInput::EmptyScope));
        let long = format!("tool.{}", "x".repeat(200));
        assert!(matches!(validate_scope(&long), Err(InvalidInput::ScopeTooLong { .. })));
        assert!(matches!(validate_scope("tool.Email"), Err(InvalidInput::MalformedScope { .. })));
        assert_eq!(TOOL_RETENTION, DAY * 30);
    }
}
