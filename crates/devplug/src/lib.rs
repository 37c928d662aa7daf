//! devplug: Kubernetes device plugins as a small Rust trait.
//!
//! A vendor writes a [`Backend`]: the device list on a [`tokio::sync::watch`] channel, and an
//! allocate function. The [`Host`] does the rest of the kubelet's device plugin API v1beta1:
//! sockets, registration, ListAndWatch streaming, re-registration after kubelet restarts, and
//! clean shutdown.
//!
//! - [`device`]: devices, health and the published list.
//! - [`attributes`]: what a device says about itself for DRA selectors (model, NUMA, UUID…).
//! - [`edits`]: what an allocation does to a container.
//! - [`cdi`]: the same edits as CDI spec files, written atomically.
//! - [`backend`]: the trait a vendor implements.
//! - [`health`]: health that recovers, after a hold-down.
//! - [`host`]: the kubelet lifecycle.
//! - [`podresources`]: a client of the kubelet's pod resources API (who holds which device).

pub mod attributes;
pub mod backend;
pub mod cdi;
pub mod device;
pub mod edits;
pub mod health;
pub mod host;
pub mod podresources;
pub mod quantity;
mod signal;

pub use attributes::{
    AttributeValue, CounterConsumption, CounterSet, DeviceAttributes, SharePolicy,
};
pub use backend::{
    AllocateError, Backend, BackendWarning, BoxFuture, Options, PreStartError, PreferenceRequest,
};
pub use device::{check_id, Device, DeviceList, Health, ListTooLarge, MAX_ID_LEN};
pub use edits::{ContainerEdits, DeviceNode, Mount};
pub use host::{
    bind_socket, Applied, ApplyFailure, FolderHealth, Host, HostError, HostEvent, MetricsSnapshot,
    RefusedRetry, Registered, Registration, RegistrationSocket, ResourceSettings, ResourceStatus,
    ShutdownReport, Updated, WatcherDirs, ALLOCATE_BUCKETS, DEFAULT_HEALTH_HOLD_DOWN,
    FIRST_DISCOVERY_WAIT, RELINK_WAIT,
};
pub use signal::shutdown_signal;

/// The kubelet's plugin-watcher folder on Linux.
pub const DEFAULT_PLUGINS_REGISTRY_DIR: &str = devplug_proto::constants::PLUGINS_REGISTRY_PATH;

/// The kubelet's device-plugins folder on Linux.
pub const DEFAULT_KUBELET_DIR: &str = devplug_proto::constants::DEVICE_PLUGIN_PATH;
