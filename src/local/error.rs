//! Why the local stack could not start or stop.

use super::database_name::DatabaseNameError;
use crate::postgrest::ClientError;

/// Why the local stack could not start or stop.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LocalError {
    /// PostgreSQL refused or failed.
    #[error("local PostgreSQL at {url} failed")]
    Database {
        /// The URL, without its password.
        url: String,
        /// sqlx's error.
        #[source]
        source: sqlx::Error,
    },
    /// A migration failed to apply.
    #[error("applying migration {file} failed")]
    Migration {
        /// The file.
        file: &'static str,
        /// sqlx's error.
        #[source]
        source: sqlx::Error,
    },
    /// Supabase Queues (pgmq and its `pgmq_public` wrappers) could not be
    /// installed, or a queue created.
    #[error("local stack queues: {0}")]
    Queues(String),
    /// The server cannot log in as `authenticator`, or `authenticator` is
    /// (or may switch to) a superuser: the message names the fix.
    #[error("local stack: {0}")]
    Authenticator(String),
    /// The PostgREST-compatible server could not be built or bound.
    #[error("starting the local PostgREST-compatible server: {0}")]
    Server(String),
    /// The configuration is unusable (a `DATABASE_URL` that is not a URL, a
    /// JWT secret too short): found before anything is created.
    #[error("local stack configuration: {0}")]
    Config(String),
    /// Other starts kept creating or dropping the same named database while
    /// this one tried to create it; trying again later may succeed.
    #[error("database {name} kept being created or dropped by another start meanwhile; try again")]
    Contended {
        /// The database.
        name: String,
    },
    /// Building the client against the stack failed.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// A name given for a kept database is not one the stack may use.
    #[error(transparent)]
    DatabaseName(#[from] DatabaseNameError),
    /// The named database exists but was built from another migration set
    /// than the one this build embeds: reusing it would serve stale
    /// functions. Reset it (`idem up --database NAME --reset`, or
    /// [`LocalStackConfig::with_reset`](super::LocalStackConfig::with_reset)) to drop and recreate it.
    #[error(
        "database {name} was built from another migration set ({found}, this build has {expected}); \
         reset it to drop and recreate it, losing its rows (idem up --database {name} --reset), or pick another name"
    )]
    DatabaseOutdated {
        /// The database.
        name: String,
        /// The template it records it was copied from.
        found: String,
        /// The template of this build's migrations.
        expected: String,
    },
    /// The named database exists but was not created by a local stack (it
    /// carries no comment of ours): it is neither reused nor reset.
    #[error(
        "database {name} exists but was not created by idem up (it carries no idempotency-plane comment); \
         it is left alone, even with --reset: pick another name, or drop it yourself"
    )]
    DatabaseNotOurs {
        /// The database.
        name: String,
    },
}
