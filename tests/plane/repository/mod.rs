//! The repository contract (`conformance`): each case written once over
//! [`Backend`](crate::support::backends::Backend) and run on the in-memory
//! repository (always, default features) and on PostgreSQL behind the
//! embedded PostgREST-compatible server (with feature `local`). A fake that
//! disagrees with the database fails here, next to the same case on the
//! real stack. `memory` holds what only the in-memory repository has (its
//! policy table).

mod conformance;
mod memory;
