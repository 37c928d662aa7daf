//! Dynamic Resource Allocation: one backend served as a DRA driver, beside or
//! instead of its device plugin.
//!
//! - [`ClaimBackend`] (defined in `devplug::dra`, which needs no Kubernetes API, and re-exported
//!   here): what a backend does for claims beyond [`devplug::Backend`] (shares, what prepare
//!   makes and unprepare removes, restore after a restart).
//! - [`hold`]: how a claim holds a device (whole, a share, admin access).
//! - [`names`]: device names in a ResourceSlice (DNS labels) from backend ids, a pure function
//!   so every part agrees.
//! - [`claims`]: a claim's allocation, read from the API server and checked against its UID.
//! - [`checkpoint`]: the prepared claims, on disk, so a restart neither loses nor repeats one.
//! - [`claim_metrics`]: counters and durations of the prepare and unprepare calls, for metrics.
//! - [`prepare`]: `NodePrepareResources` / `NodeUnprepareResources` claim by claim: planning,
//!   conflicts, the backend's edits (off the runtime), one CDI spec per claim, the checkpoint.
//! - `service.rs`: the `DRAPlugin` gRPC service, v1 and v1beta1, over [`prepare::Preparer`].
//! - [`device_health`]: the kubelet's device health stream (`DRAResourceHealth`), so pods'
//!   status shows their devices' health.
//! - [`device_status`]: each prepared device in its claim's `status.devices`, with a `Ready`
//!   condition that follows its health and the data an operator needs (UUID, PCI address...).
//! - `driver.rs`: all of it for one backend, started and stopped as one ([`DraDriver`]).
//! - [`kubelet`]: the driver's sockets and its plugin-watcher registration.
//! - [`slices`]: the node's devices as ResourceSlices, event-driven, kept across a
//!   restart (the kubelet wipes those of a driver gone for good), removed by `DraDriver::remove`.
//! - [`runtime`]: whether the node's container runtime applies CDI specs at all.
//! - [`health`]: a running driver's readiness and counters, for probes and metrics.

pub mod checkpoint;
pub mod claim_metrics;
pub mod claims;
pub mod device_health;
pub mod device_status;
mod driver;
pub mod health;
pub mod hold;
pub mod kubelet;
pub mod names;
pub mod prepare;
pub mod runtime;
mod service;
pub mod slices;

pub use devplug::dra::{ClaimBackend, ReleaseError};
pub use driver::{DraDriver, DraDriverSettings, DraStartError};
pub use health::DraHealth;
pub use hold::Hold;
