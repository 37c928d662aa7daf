//! Dynamic Resource Allocation: one backend served as a DRA driver (issue 12).
//!
//! - [`names`]: device names in a ResourceSlice (DNS labels) from backend ids, a pure function
//!   so every part agrees.
pub mod names;
pub mod slices;
