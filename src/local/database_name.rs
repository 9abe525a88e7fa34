//! The names of databases: the prefixes of the stack's own (its throwaway
//! databases and its templates), and the names a kept database may take,
//! which are none of those nor the cluster's own.

use std::str::FromStr;

/// Names of the databases the stack creates start with this.
pub(super) const DB_PREFIX: &str = "idem_local_";

/// Names of the template databases, one per migration set, start with this.
pub(super) const TEMPLATE_PREFIX: &str = "idem_tpl_";

/// The longest database name PostgreSQL keeps whole (NAMEDATALEN - 1).
const MAX_DATABASE_NAME_BYTES: usize = 63;

/// Names a named database may not take: the cluster's own databases.
const RESERVED_DATABASE_NAMES: &[&str] = &["postgres", "template0", "template1"];

/// Why a name cannot be a kept database's ([`DatabaseName::new`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DatabaseNameError {
    /// The name is empty.
    #[error("a database name cannot be empty")]
    Empty,
    /// The name is longer than PostgreSQL keeps.
    #[error("database name {name:?} is {len} bytes; at most 63")]
    TooLong {
        /// The name.
        name: String,
        /// Its length in bytes.
        len: usize,
    },
    /// The name has a character other than a lowercase ASCII letter, a digit
    /// or `_`.
    #[error("database name {name:?} may hold only lowercase letters a-z, digits and _")]
    Invalid {
        /// The name.
        name: String,
    },
    /// The name starts with a prefix the stack's own databases use: the
    /// clean-up of stale throwaway databases, or of old templates, would
    /// take it for one of them.
    #[error("database name {name:?} starts with {prefix}, which the local stack's own databases use")]
    ReservedPrefix {
        /// The name.
        name: String,
        /// The prefix.
        prefix: &'static str,
    },
    /// The name is one of the cluster's own databases.
    #[error("database name {name:?} is one of the cluster's own databases")]
    Reserved {
        /// The name.
        name: String,
    },
}

/// The name of a database a stack keeps across starts
/// ([`LocalStackConfig::with_database`](super::LocalStackConfig::with_database)): 1 to 63 bytes of lowercase ASCII
/// letters, digits and `_`, not starting with `idem_local_` (the stack's
/// throwaway databases, which a start drops when no session uses them) or
/// `idem_tpl_` (its templates), and not `postgres`, `template0` or
/// `template1`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DatabaseName(String);

impl DatabaseName {
    /// Checks `name`.
    pub fn new(name: &str) -> Result<DatabaseName, DatabaseNameError> {
        let owned = || name.to_owned();
        if name.is_empty() {
            return Err(DatabaseNameError::Empty);
        }
        if name.len() > MAX_DATABASE_NAME_BYTES {
            return Err(DatabaseNameError::TooLong { name: owned(), len: name.len() });
        }
        if !name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_') {
            return Err(DatabaseNameError::Invalid { name: owned() });
        }
        if let Some(prefix) = [DB_PREFIX, TEMPLATE_PREFIX].into_iter().find(|prefix| name.starts_with(prefix)) {
            return Err(DatabaseNameError::ReservedPrefix { name: owned(), prefix });
        }
        if RESERVED_DATABASE_NAMES.contains(&name) {
            return Err(DatabaseNameError::Reserved { name: owned() });
        }
        Ok(DatabaseName(owned()))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for DatabaseName {
    type Err = DatabaseNameError;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        DatabaseName::new(name)
    }
}

impl std::fmt::Display for DatabaseName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::local::cluster::{quote_ident, quote_literal};

    #[test]
    fn a_kept_database_name_is_plain_short_and_never_one_the_clean_ups_take() {
        for good in ["idem_dev", "a", "x1_2", &"n".repeat(63), "idem_localx", "idem_tplx"] {
            assert_eq!(DatabaseName::new(good).map(|n| n.as_str().to_owned()), Ok(good.to_owned()));
        }
        let refused = |name: &str| DatabaseName::new(name).expect_err(name);
        assert_eq!(refused(""), DatabaseNameError::Empty);
        assert!(matches!(refused(&"n".repeat(64)), DatabaseNameError::TooLong { len: 64, .. }));
        for bad in ["Idem", "idem-dev", "idem dev", "idem\"; drop database postgres; --", "é", "a.b"] {
            assert!(matches!(refused(bad), DatabaseNameError::Invalid { .. }), "{bad}");
        }
        for (bad, prefix) in [(format!("{DB_PREFIX}x"), DB_PREFIX), (format!("{TEMPLATE_PREFIX}x"), TEMPLATE_PREFIX)] {
            assert_eq!(refused(&bad), DatabaseNameError::ReservedPrefix { name: bad.clone(), prefix });
        }
        for bad in ["postgres", "template0", "template1"] {
            assert!(matches!(refused(bad), DatabaseNameError::Reserved { .. }), "{bad}");
        }
        // Quoting holds whatever a name holds.
        assert_eq!(quote_ident(r#"a"b"#), r#""a""b""#);
        assert_eq!(quote_literal("it's"), "'it''s'");
    }
}
