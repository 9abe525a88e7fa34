//! Saved-search start and Run admission on the real stack, by job.

mod preparation;
