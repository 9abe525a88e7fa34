//! Randomized endings on the real stack, one file per caller.

mod saved_search;
