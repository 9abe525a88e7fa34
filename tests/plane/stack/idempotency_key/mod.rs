//! The `Idempotency-Key` layer on the real stack, by what each group shows.

mod plane_faults;
