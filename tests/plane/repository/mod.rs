//! The repository contract (`conformance`): each case written once over
//! its `Backend` trait and run on the in-memory
//! repository (always, default features) and on PostgreSQL behind the
//! embedded PostgREST-compatible server (with feature `local`). A fake that
//! disagrees with the database fails here, next to the same case on the
//! real stack.

pub(crate) mod conformance;
mod memory;
