//! Scopes and their retention: a constant per scope, never a caller's choice.

use std::time::Duration;

use crate::error::{Error, InvalidInput};

/// Longest scope name the table accepts.
pub const MAX_SCOPE_CHARS: usize = 128;

/// One day.
pub const DAY: Duration = Duration::from_secs(24 * 60 * 60);

/// Retention of every tool scope: the ceiling of `max_run_duration`, because
/// a Run can wait on an approval for days and the claim is its replay journal.
pub const TOOL_RETENTION: Duration = Duration::from_secs(30 * 24 * 60 * 60);

/// Retention of webhook deliveries: vendors redeliver within hours.
pub const WEBHOOK_RETENTION: Duration = DAY;

/// Shortest retention the store accepts.
const MIN_RETENTION: Duration = Duration::from_secs(1);

/// Longest retention the store accepts.
const MAX_RETENTION: Duration = Duration::from_secs(366 * 24 * 60 * 60);

/// The scope of saved-search input preparation.
pub const SAVED_SEARCH_START_SCOPE: &str = "surface.saved_search.start";

/// Retention of the saved-search snapshot.
pub const SAVED_SEARCH_START_RETENTION: Duration = DAY;

/// Which scopes exist and how long each remembers its answers.
///
/// A scope matches an exact entry, or a family prefix such as `tool.` (which
/// then needs a non-empty name after it). An unknown scope is an error, never
/// a default: a default retention is exactly the bug the two clocks exist to
/// prevent.
#[derive(Debug, Clone)]
pub struct ScopeRegistry {
    exact: Vec<(String, Duration)>,
    families: Vec<(String, Duration)>,
}

impl Default for ScopeRegistry {
    /// `tool.*` 30 days, `webhook.*` 24 hours, `surface.saved_search.start` 24 hours.
    fn default() -> Self {
        ScopeRegistry {
            exact: vec![(SAVED_SEARCH_START_SCOPE.into(), SAVED_SEARCH_START_RETENTION)],
            families: vec![("tool.".into(), TOOL_RETENTION), ("webhook.".into(), WEBHOOK_RETENTION)],
        }
    }
}

impl ScopeRegistry {
    /// An empty registry: every scope is unknown until added.
    pub fn empty() -> Self {
        ScopeRegistry { exact: Vec::new(), families: Vec::new() }
    }

    /// Adds one scope with its retention. A tool scope (`tool.…`) under
    /// [`TOOL_RETENTION`] is refused: its claim is the replay journal of a
    /// Run that may wait on an approval for up to 30 days.
    pub fn with_scope(mut self, scope: impl Into<String>, retention: Duration) -> Result<Self, InvalidInput> {
        let scope = scope.into();
        check_tool_retention(&scope, retention)?;
        self.exact.push((scope, retention));
        Ok(self)
    }

    /// Adds every scope that starts with `prefix` (e.g. `tool.`). A family
    /// that covers tool scopes (`tool.`, `tool.crm.`, or a shorter prefix
    /// of `tool.`) with a retention under [`TOOL_RETENTION`] is refused.
    pub fn with_family(mut self, prefix: impl Into<String>, retention: Duration) -> Result<Self, InvalidInput> {
        let prefix = prefix.into();
        check_tool_retention(&prefix, retention)?;
        self.families.push((prefix, retention));
        Ok(self)
    }

    /// The retention of `scope`, after checking its shape and that its
    /// registered retention is one the store accepts.
    pub fn retention(&self, scope: &str) -> Result<Duration, Error> {
        validate_scope(scope)?;
        let registered = self.exact.iter().find(|(name, _)| name == scope).or_else(|| {
            self.families.iter().find(|(prefix, _)| scope.len() > prefix.len() && scope.starts_with(prefix.as_str()))
        });
        let Some((_, retention)) = registered else {
            return Err(Error::UnknownScope { scope: scope.to_owned() });
        };
        check_tool_retention(scope, *retention)?;
        if !(MIN_RETENTION..=MAX_RETENTION).contains(retention) {
            return Err(InvalidInput::RetentionOutOfRange { scope: scope.to_owned(), retention: *retention }.into());
        }
        Ok(*retention)
    }
}

/// Refuses a retention under [`TOOL_RETENTION`] for a scope, or a family
/// prefix, that names or covers tool scopes. Taking the ceiling is the
/// point: a shorter tool retention forgets an effect a waiting Run already
/// made, and its restarted segment repeats it.
fn check_tool_retention(scope_or_prefix: &str, retention: Duration) -> Result<(), InvalidInput> {
    let covers_tools = scope_or_prefix.starts_with("tool.") || "tool.".starts_with(scope_or_prefix);
    if covers_tools && retention < TOOL_RETENTION {
        return Err(InvalidInput::ToolRetentionTooShort {
            scope: scope_or_prefix.to_owned(),
            retention,
            min: TOOL_RETENTION,
        });
    }
    Ok(())
}

/// A scope is 1 to 128 characters of `a-z 0-9 . _ -`.
fn validate_scope(scope: &str) -> Result<(), InvalidInput> {
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
    fn a_tool_retention_under_thirty_days_is_refused() {
        let short = ScopeRegistry::empty().with_scope("tool.email.send", DAY);
        assert!(matches!(short, Err(InvalidInput::ToolRetentionTooShort { .. })), "{short:?}");
        for prefix in ["tool.", "tool.crm.", "to", ""] {
            let family = ScopeRegistry::empty().with_family(prefix, DAY * 29);
            assert!(matches!(family, Err(InvalidInput::ToolRetentionTooShort { .. })), "{prefix:?}: {family:?}");
        }
        assert!(ScopeRegistry::empty().with_scope("tool.email.send", TOOL_RETENTION).is_ok());
        assert!(ScopeRegistry::empty().with_family("tool.", DAY * 31).is_ok());
        assert!(ScopeRegistry::empty().with_scope("webhook.slack", DAY).is_ok());
        assert!(ScopeRegistry::empty().with_family("tools.", DAY).is_ok(), "not a tool scope");
    }

    #[test]
    fn spec_retentions() {
        let registry = ScopeRegistry::default();
        assert_eq!(registry.retention("tool.email.send").unwrap(), TOOL_RETENTION);
        assert_eq!(registry.retention("tool.crm.company.create").unwrap(), TOOL_RETENTION);
        assert_eq!(registry.retention("webhook.nylas").unwrap(), DAY);
        assert_eq!(registry.retention("surface.saved_search.start").unwrap(), DAY);
        assert_eq!(TOOL_RETENTION, DAY * 30);
    }

    #[test]
    fn unknown_and_malformed_scopes_are_errors() {
        let registry = ScopeRegistry::default();
        for unknown in ["tool.", "tools.x", "webhook", "surface.saved_search", "payments.charge"] {
            assert!(matches!(registry.retention(unknown), Err(Error::UnknownScope { .. })), "{unknown}");
        }
        assert!(matches!(registry.retention(""), Err(Error::Invalid(InvalidInput::EmptyScope))));
        let long = format!("tool.{}", "x".repeat(200));
        assert!(matches!(registry.retention(&long), Err(Error::Invalid(InvalidInput::ScopeTooLong { .. }))));
        let odd = ScopeRegistry::empty()
            .with_scope("forever.x", DAY * 400)
            .and_then(|r| r.with_family("never.", Duration::ZERO))
            .unwrap();
        for scope in ["forever.x", "never.x"] {
            assert!(matches!(odd.retention(scope), Err(Error::Invalid(InvalidInput::RetentionOutOfRange { .. }))));
        }
        assert!(matches!(registry.retention("tool.Email"), Err(Error::Invalid(InvalidInput::MalformedScope { .. }))));
    }
}
