//! devplug: Kubernetes device plugins as a small Rust trait.
//!
//! A vendor writes a [`Backend`]: the device list on a [`tokio::sync::watch`] channel, and an
//! allocate function. The [`Host`] does the rest of the kubelet's device plugin API v1beta1:
//! sockets, registration, ListAndWatch streaming, re-registration after kubelet restarts, and
//! clean shutdown.
//!
//! At the root is what a plugin author needs: the [`Backend`] trait with its options and
//! errors, [`Device`]s and their [`Health`] in a [`DeviceList`], the [`ContainerEdits`] an
//! allocation makes, the [`Host`] that serves backends to the kubelet, and [`shutdown_signal`].
//!
//! - [`device`]: devices, health and the published list (id rules, the kubelet's size limit).
//! - [`dra`]: what a device says about itself for DRA (attributes, capacities shared by
//!   claims, counters of partitions), Kubernetes quantities, and [`dra::ClaimBackend`], what a
//!   backend does for claims; the DRA driver itself is the `devplug-dra` crate.
//! - [`edits`]: what an allocation does to a container.
//! - [`cdi`]: the same edits as CDI spec files, written atomically.
//! - [`backend`]: the trait a vendor implements.
//! - [`health`]: health that recovers, after a hold-down.
//! - [`host`]: the kubelet lifecycle, and what an operator's binary reads of it (metrics,
//!   status, events, applying a new set of resources, the registration sockets).
//! - [`podresources`]: a client of the kubelet's pod resources API (who holds which device).

pub mod backend;
pub mod cdi;
pub mod device;
pub mod dra;
pub mod edits;
pub mod health;
pub mod host;
pub mod podresources;
mod signal;

pub use backend::{
    AllocateError, Backend, BackendWarning, BoxFuture, Options, PreStartError, PreferenceRequest,
};
pub use device::{Device, DeviceList, Health};
pub use edits::{ContainerEdits, DeviceNode, Mount};
pub use host::{Host, HostError, Registration, ResourceSettings};
pub use signal::shutdown_signal;

/// The kubelet's plugin-watcher folder on Linux.
pub const DEFAULT_PLUGINS_REGISTRY_DIR: &str = devplug_proto::constants::PLUGINS_REGISTRY_PATH;

/// The kubelet's device-plugins folder on Linux.
pub const DEFAULT_KUBELET_DIR: &str = devplug_proto::constants::DEVICE_PLUGIN_PATH;
