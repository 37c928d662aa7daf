//! What a device says about itself for Dynamic Resource Allocation: attributes for the
//! scheduler's CEL selectors, capacities that claims share ([`CapacityRequestPolicy`]), the counters that
//! partitions of one device consume, and Kubernetes quantities as the API server writes them.
//! A backend sets these on its [`crate::Device`]s; the `devplug-dra` crate publishes them as
//! ResourceSlices and serves the claims.

pub use crate::attributes::*;
pub use crate::quantity::*;
