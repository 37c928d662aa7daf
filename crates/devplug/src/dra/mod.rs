//! Dynamic Resource Allocation, as a backend sees it: what a device says about itself
//! (attributes for the scheduler's CEL selectors, capacities that claims share
//! ([`CapacityRequestPolicy`]), the counters that partitions of one device consume, Kubernetes
//! quantities as the API server writes them), and [`ClaimBackend`], what a backend does for
//! claims beyond what [`crate::Backend`] does for the device plugin. A backend sets the first on
//! its [`crate::Device`]s and implements the second; the `devplug-dra` crate publishes the
//! devices as ResourceSlices and serves the claims through the kubelet.
//!
//! Nothing here needs the Kubernetes API: a backend crate implements [`ClaimBackend`] with this
//! crate alone.

mod attributes;
mod claim_backend;
mod quantity;

pub use attributes::*;
pub use claim_backend::{ClaimBackend, ReleaseError};
pub use quantity::*;
