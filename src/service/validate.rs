//! Input checks the service runs before any request.

use std::time::Duration;

use crate::error::InvalidInput;

/// Longest key the table accepts, in characters.
pub const MAX_KEY_CHARS: usize = 512;

/// Shortest lease the store accepts. A lease is measured from the start of
/// the claiming transaction, so a shorter one could pass while that
/// transaction still waits on a lock.
pub const MIN_LEASE: Duration = Duration::from_secs(1);

/// Longest lease the store accepts.
pub const MAX_LEASE: Duration = Duration::from_secs(24 * 60 * 60);

pub(crate) fn key(key: &str) -> Result<(), InvalidInput> {
    if key.is_empty() {
        return Err(InvalidInput::EmptyKey);
    }
    let chars = key.chars().count();
    if chars > MAX_KEY_CHARS {
        return Err(InvalidInput::KeyTooLong { chars, max: MAX_KEY_CHARS });
    }
    // PostgreSQL text cannot hold NUL; refused here rather than by the server.
    if key.contains('\0') {
        return Err(InvalidInput::KeyHasNul);
    }
    Ok(())
}

pub(crate) fn lease(lease: Duration) -> Result<(), InvalidInput> {
    if lease < MIN_LEASE {
        return Err(InvalidInput::LeaseTooShort { lease, min: MIN_LEASE });
    }
    if lease > MAX_LEASE {
        return Err(InvalidInput::LeaseTooLong { lease, max: MAX_LEASE });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_non_empty_and_bounded_in_characters() {
        assert_eq!(key(""), Err(InvalidInput::EmptyKey));
        assert!(key("run:1:step:2").is_ok());
        assert_eq!(key("a\0b"), Err(InvalidInput::KeyHasNul));
        assert!(key(&"é".repeat(MAX_KEY_CHARS)).is_ok());
        assert_eq!(key(&"k".repeat(MAX_KEY_CHARS + 1)), Err(InvalidInput::KeyTooLong { chars: 513, max: 512 }));
    }

    #[test]
    fn leases_are_positive_and_bounded() {
        assert!(matches!(lease(Duration::ZERO), Err(InvalidInput::LeaseTooShort { .. })));
        assert!(matches!(lease(Duration::from_millis(999)), Err(InvalidInput::LeaseTooShort { .. })));
        assert!(lease(MIN_LEASE).is_ok());
        assert!(lease(MAX_LEASE).is_ok());
        assert!(matches!(lease(MAX_LEASE + Duration::from_millis(1)), Err(InvalidInput::LeaseTooLong { .. })));
    }
}
