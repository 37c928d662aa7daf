//! What the simulated kubelet knows about the node: resources with their devices and endpoint,
//! pods with their allocations, the registration history, and the DRA side (registered DRA
//! plugins, prepared claims, pods' claim references). Read it through
//! [`Kubelet::wait_for`](crate::Kubelet::wait_for) or [`Kubelet::read`](crate::Kubelet::read).

use crate::dra::types::{DraClaim, DraPluginRecord, DraState, PreparedClaim};
use devplug_proto::v1beta1::{ContainerAllocateResponse, DevicePluginOptions};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Instant;
use tokio_util::sync::CancellationToken;

/// The device manager's view of the node.
#[derive(Debug, Default)]
pub struct NodeState {
    pub(crate) resources: BTreeMap<String, ResourceState>,
    pub(crate) pods: BTreeMap<String, PodState>,
    pub(crate) registrations: Vec<RegistrationRecord>,
    pub(crate) restarts: u64,
    pub(crate) bound_at: Option<Instant>,
    pub(crate) pod_resources_calls: u64,
    pub(crate) dra: DraState,
}

impl NodeState {
    /// A resource the kubelet knows, connected or within its grace period.
    pub fn resource(&self, name: &str) -> Option<&ResourceState> {
        self.resources.get(name)
    }

    /// Every known resource, by name.
    pub fn resources(&self) -> impl Iterator<Item = (&str, &ResourceState)> {
        self.resources.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Node capacity and allocatable of `name`, as node status would show them; (0, 0) for a
    /// resource the kubelet does not know.
    pub fn capacity(&self, name: &str) -> (usize, usize) {
        self.resource(name)
            .map_or((0, 0), |r| (r.capacity(), r.allocatable()))
    }

    /// Every successful registration, oldest first.
    pub fn registrations(&self) -> &[RegistrationRecord] {
        &self.registrations
    }

    /// Successful registrations of `resource`.
    pub fn registration_count(&self, resource: &str) -> usize {
        self.registrations
            .iter()
            .filter(|r| r.resource == resource)
            .count()
    }

    /// When the current kubelet.sock was bound (the file appeared), before it listened.
    pub fn socket_bound_at(&self) -> Option<Instant> {
        self.bound_at
    }

    /// Calls to the pod resources API, rate-limited ones included.
    pub fn pod_resources_calls(&self) -> u64 {
        self.pod_resources_calls
    }

    /// How many simulated kubelet restarts have happened.
    pub fn restarts(&self) -> u64 {
        self.restarts
    }

    /// Every registered DRA plugin endpoint, oldest registration first (a driver has several
    /// during a rolling update).
    pub fn dra_plugins(&self) -> impl Iterator<Item = &DraPluginRecord> {
        self.dra.plugins.iter().map(|p| &p.record)
    }

    /// The registered endpoints of one DRA driver, oldest first.
    pub fn dra_driver(&self, driver: &str) -> Vec<&DraPluginRecord> {
        self.dra_plugins().filter(|p| p.driver == driver).collect()
    }

    /// The claims prepared through `driver`, by claim UID.
    pub fn dra_prepared(&self, driver: &str) -> impl Iterator<Item = &PreparedClaim> {
        self.dra
            .prepared
            .get(driver)
            .into_iter()
            .flat_map(|m| m.values())
    }

    /// The claim with UID `uid` if `driver` prepared it.
    pub fn dra_claim(&self, driver: &str, uid: &str) -> Option<&PreparedClaim> {
        self.dra.prepared.get(driver)?.get(uid)
    }

    /// The (driver, claim) pairs a pod references through
    /// [`Kubelet::dra_prepare_pod`](crate::Kubelet::dra_prepare_pod).
    pub fn dra_pod_claims(&self, pod: &str) -> impl Iterator<Item = (&str, &DraClaim)> {
        self.dra
            .pods
            .get(pod)
            .into_iter()
            .flat_map(|refs| refs.iter().map(|(d, c)| (d.as_str(), c)))
    }

    /// The devices allocated to one container for one resource.
    pub fn allocation(&self, pod: &str, container: &str, resource: &str) -> Option<&Allocation> {
        self.pods.get(pod)?.containers.get(container)?.get(resource)
    }

    /// Ids of `resource` held by any pod.
    pub fn in_use(&self, resource: &str) -> BTreeSet<&str> {
        self.pods
            .values()
            .flat_map(|p| p.containers.values())
            .filter_map(|c| c.get(resource))
            .flat_map(|a| a.device_ids.iter().map(String::as_str))
            .collect()
    }
}

/// One extended resource at the kubelet.
#[derive(Debug)]
pub struct ResourceState {
    pub(crate) endpoint: Option<Endpoint>,
    pub(crate) devices: BTreeMap<String, SimDevice>,
    pub(crate) updates: u64,
    pub(crate) stopped_at: Option<Instant>,
    pub(crate) generation: u64,
}

impl ResourceState {
    pub(crate) fn new() -> Self {
        ResourceState {
            endpoint: None,
            devices: BTreeMap::new(),
            updates: 0,
            stopped_at: None,
            generation: 0,
        }
    }

    /// All devices, healthy or not.
    pub fn capacity(&self) -> usize {
        self.devices.len()
    }

    /// Healthy devices.
    pub fn allocatable(&self) -> usize {
        self.devices.values().filter(|d| d.healthy).count()
    }

    /// Devices by id.
    pub fn devices(&self) -> &BTreeMap<String, SimDevice> {
        &self.devices
    }

    /// True while a plugin is registered and its stream is open.
    pub fn is_connected(&self) -> bool {
        self.endpoint.is_some()
    }

    /// The plugin's options, while connected.
    pub fn options(&self) -> Option<DevicePluginOptions> {
        self.endpoint.as_ref().map(|e| e.options)
    }

    /// The socket of the connected plugin.
    pub fn socket(&self) -> Option<&PathBuf> {
        self.endpoint.as_ref().map(|e| &e.socket)
    }

    /// ListAndWatch messages received for this resource.
    pub fn updates(&self) -> u64 {
        self.updates
    }

    /// How many times a plugin connected for this resource (registrations and restarts). A
    /// stream that was never interrupted keeps this number.
    pub fn connections(&self) -> u64 {
        self.generation
    }
}

/// A device as the kubelet records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimDevice {
    /// `health == "Healthy"` exactly.
    pub healthy: bool,
    /// NUMA nodes from the device's topology.
    pub numa_nodes: Vec<i64>,
}

/// A connected plugin.
#[derive(Debug)]
pub(crate) struct Endpoint {
    pub(crate) socket: PathBuf,
    pub(crate) options: DevicePluginOptions,
    pub(crate) client: crate::registration::PluginClient,
    /// Ends the ListAndWatch consumer.
    pub(crate) stop: CancellationToken,
}

/// A successful registration.
#[derive(Debug, Clone)]
pub struct RegistrationRecord {
    /// Resource name.
    pub resource: String,
    /// Socket file name the plugin gave.
    pub endpoint: String,
    /// When the kubelet accepted it.
    pub at: Instant,
    /// True when it came through the plugin watcher (`plugins_registry/`), false for a
    /// `Register` call on kubelet.sock.
    pub via_watcher: bool,
}

/// One pod's device assignments.
#[derive(Debug, Default)]
pub(crate) struct PodState {
    /// Container name → resource → allocation.
    pub(crate) containers: BTreeMap<String, BTreeMap<String, Allocation>>,
    /// Devices of init containers that later containers reuse, by resource.
    pub(crate) reusable: BTreeMap<String, BTreeSet<String>>,
    /// Names of the pod's (non-restartable) init containers.
    pub(crate) init_containers: BTreeSet<String>,
}

/// The devices one container got for one resource, and what the plugin said to do with them.
#[derive(Debug, Clone, PartialEq)]
pub struct Allocation {
    /// Device ids, in the order sent to the plugin.
    pub device_ids: Vec<String>,
    /// The plugin's answer (the kubelet keeps the first container response).
    pub response: ContainerAllocateResponse,
}

impl Allocation {
    /// An environment variable the container gets.
    pub fn env(&self, key: &str) -> Option<&str> {
        self.response.envs.get(key).map(String::as_str)
    }
}
