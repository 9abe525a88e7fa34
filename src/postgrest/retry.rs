//! Retry policy: bounded, jittered exponential backoff.

use std::time::Duration;

/// How the client retries a failure [`ClientError::is_retryable`] allows.
///
/// Within the operation's deadline
/// ([`ClientConfig::with_deadline`](super::ClientConfig::with_deadline)),
/// which bounds every attempt and backoff together.
///
/// [`ClientError::is_retryable`]: super::ClientError::is_retryable
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryConfig {
    /// Retries after the first attempt. `0` disables retries. Default 4.
    pub max_retries: u32,
    /// First backoff. Default 50 ms.
    pub initial_backoff: Duration,
    /// Ceiling for one backoff, and for a server's `Retry-After`. Default 2 s.
    pub max_backoff: Duration,
    /// No retry starts once this much time has passed since the first
    /// attempt. Default 20 s.
    pub max_elapsed: Duration,
}

impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig {
            max_retries: 4,
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(2),
            max_elapsed: Duration::from_secs(20),
        }
    }
}

impl RetryConfig {
    /// No retries at all.
    pub fn disabled() -> Self {
        RetryConfig { max_retries: 0, ..RetryConfig::default() }
    }

    /// The wait before retry number `retry` (1-based): uniform between half
    /// and all of an exponential ceiling, never below the server's
    /// `Retry-After` in seconds (capped at `max_backoff`). PostgREST sends
    /// `Retry-After: 0` on every 503, which therefore leaves our own backoff
    /// in charge; an HTTP-date `Retry-After` is not read.
    pub(crate) fn backoff(&self, retry: u32, retry_after: Option<Duration>) -> Duration {
        let exponent = retry.saturating_sub(1).min(16);
        let ceiling = self.initial_backoff.saturating_mul(1u32 << exponent).min(self.max_backoff);
        let jittered = ceiling.mul_f64(0.5 + 0.5 * rand::random::<f64>());
        let floor = retry_after.unwrap_or(Duration::ZERO).min(self.max_backoff);
        jittered.max(floor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_is_capped_and_respects_retry_after() {
        let config = RetryConfig::default();
        for retry in 1..=10 {
            let wait = config.backoff(retry, None);
            assert!(wait <= config.max_backoff, "retry {retry}: {wait:?}");
            let ceiling = config.initial_backoff * (1 << (retry - 1).min(16));
            assert!(wait >= ceiling.min(config.max_backoff) / 2, "retry {retry}: {wait:?}");
        }
        // Retry-After: 0 leaves our own backoff in charge.
        assert!(config.backoff(1, Some(Duration::ZERO)) >= config.initial_backoff / 2);
        // A larger Retry-After is honoured, up to the ceiling.
        assert_eq!(config.backoff(1, Some(Duration::from_secs(1))), Duration::from_secs(1));
        assert_eq!(config.backoff(1, Some(Duration::from_secs(60))), config.max_backoff);
    }
}
