//! What `devplug inspect` shows, as plain serializable structs built from the wire messages:
//! the JSON output is these structs, and the text output is rendered from them. They are ours,
//! not the prost types, so the JSON shape stays stable and readable.

use devplug_proto::constants::HEALTHY;
use devplug_proto::v1beta1 as pb;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};

/// A plugin's answer to GetDevicePluginOptions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct OptionsView {
    /// The kubelet calls PreStartContainer before each container start.
    pub pre_start_required: bool,
    /// The kubelet calls GetPreferredAllocation before Allocate.
    pub get_preferred_allocation_available: bool,
}

impl From<pb::DevicePluginOptions> for OptionsView {
    fn from(o: pb::DevicePluginOptions) -> Self {
        OptionsView {
            pre_start_required: o.pre_start_required,
            get_preferred_allocation_available: o.get_preferred_allocation_available,
        }
    }
}

/// One device of a ListAndWatch message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceView {
    /// The device id.
    pub id: String,
    /// The health string exactly as sent (only `"Healthy"` is healthy to the kubelet).
    pub health: String,
    /// NUMA nodes from the device's topology; empty when it has none.
    pub numa_nodes: Vec<i64>,
}

impl DeviceView {
    /// True if the kubelet counts the device as allocatable.
    pub fn is_healthy(&self) -> bool {
        self.health == HEALTHY
    }
}

impl From<pb::Device> for DeviceView {
    fn from(d: pb::Device) -> Self {
        DeviceView {
            id: d.id,
            health: d.health,
            numa_nodes: d
                .topology
                .map(|t| t.nodes.into_iter().map(|n| n.id).collect())
                .unwrap_or_default(),
        }
    }
}

/// The devices of one ListAndWatch message, in the plugin's order.
pub fn devices_of(message: pb::ListAndWatchResponse) -> Vec<DeviceView> {
    message.devices.into_iter().map(DeviceView::from).collect()
}

/// Device counts of one list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Counts {
    /// All devices (the kubelet's capacity).
    pub total: usize,
    /// Devices whose health is exactly `"Healthy"` (the kubelet's allocatable).
    pub healthy: usize,
    /// All other devices.
    pub unhealthy: usize,
    /// Devices per health string, as sent.
    pub by_health: BTreeMap<String, usize>,
}

impl Counts {
    /// Counts `devices`.
    pub fn of(devices: &[DeviceView]) -> Counts {
        let mut by_health = BTreeMap::new();
        for d in devices {
            *by_health.entry(d.health.clone()).or_insert(0) += 1;
        }
        let healthy = devices.iter().filter(|d| d.is_healthy()).count();
        Counts {
            total: devices.len(),
            healthy,
            unhealthy: devices.len() - healthy,
            by_health,
        }
    }
}

/// What `devplug inspect --socket` prints.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// The socket inspected.
    pub socket: String,
    /// The plugin's options.
    pub options: OptionsView,
    /// The first device list.
    pub devices: Vec<DeviceView>,
    /// Its counts.
    pub counts: Counts,
    /// Who holds the devices, from the kubelet's pod resources API (not asked with --watch).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod_resources: Option<PodResourcesView>,
}

/// What the kubelet's pod resources API said about the inspected plugin's devices.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PodResourcesView {
    /// The resource the devices belong to (given with --resource, or found by their ids).
    pub resource: Option<String>,
    /// Device id → the container holding it; devices not listed are free.
    pub holders: BTreeMap<String, HolderView>,
    /// Why the API could not be asked, if it could not.
    pub error: Option<String>,
}

/// A container holding a device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HolderView {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod.
    pub pod: String,
    /// The container.
    pub container: String,
}

/// A host device node given to the container.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceSpecView {
    /// Path on the host.
    pub host_path: String,
    /// Path in the container.
    pub container_path: String,
    /// cgroup permissions, some of `r`, `w`, `m`.
    pub permissions: String,
}

/// A host path mounted into the container.
#[derive(Debug, Clone, Serialize)]
pub struct MountView {
    /// Path on the host.
    pub host_path: String,
    /// Path in the container.
    pub container_path: String,
    /// Mounted read-only.
    pub read_only: bool,
}

/// One container's edits from an Allocate answer.
#[derive(Debug, Clone, Serialize)]
pub struct EditsView {
    /// Environment variables, by name.
    pub envs: BTreeMap<String, String>,
    /// Device nodes.
    pub devices: Vec<DeviceSpecView>,
    /// Mounts.
    pub mounts: Vec<MountView>,
    /// Annotations, by key.
    pub annotations: BTreeMap<String, String>,
    /// Fully qualified CDI device names.
    pub cdi_devices: Vec<String>,
}

impl From<pb::ContainerAllocateResponse> for EditsView {
    fn from(r: pb::ContainerAllocateResponse) -> Self {
        EditsView {
            envs: r.envs.into_iter().collect(),
            devices: r
                .devices
                .into_iter()
                .map(|d| DeviceSpecView {
                    host_path: d.host_path,
                    container_path: d.container_path,
                    permissions: d.permissions,
                })
                .collect(),
            mounts: r
                .mounts
                .into_iter()
                .map(|m| MountView {
                    host_path: m.host_path,
                    container_path: m.container_path,
                    read_only: m.read_only,
                })
                .collect(),
            annotations: r.annotations.into_iter().collect(),
            cdi_devices: r.cdi_devices.into_iter().map(|c| c.name).collect(),
        }
    }
}

/// What `devplug inspect --allocate` prints.
#[derive(Debug, Clone, Serialize)]
pub struct AllocationView {
    /// The socket asked.
    pub socket: String,
    /// The ids sent in the one container request.
    pub requested: Vec<String>,
    /// The plugin's container responses (the kubelet uses the first).
    pub container_responses: Vec<EditsView>,
}

/// What `devplug inspect --preferred` prints.
#[derive(Debug, Clone, Serialize)]
pub struct PreferenceView {
    /// The socket asked.
    pub socket: String,
    /// What the plugin's options say about GetPreferredAllocation.
    pub get_preferred_allocation_available: bool,
    /// The healthy devices offered as available.
    pub available: Vec<String>,
    /// The allocation size asked for.
    pub size: u32,
    /// The plugin's choice (its first container response).
    pub chosen: Vec<String>,
}

/// A device present in both lists whose health or NUMA nodes differ.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Changed {
    /// The device id.
    pub id: String,
    /// As it was.
    pub before: DeviceView,
    /// As it is now.
    pub after: DeviceView,
}

/// What differs between two consecutive lists.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Change {
    /// New devices, in the new list's order.
    pub appeared: Vec<DeviceView>,
    /// Ids no longer listed, in the old list's order.
    pub vanished: Vec<String>,
    /// Devices whose health or NUMA nodes changed, in the new list's order.
    pub changed: Vec<Changed>,
}

impl Change {
    /// The difference from `old` to `new`.
    pub fn between(old: &[DeviceView], new: &[DeviceView]) -> Change {
        let before: HashMap<&str, &DeviceView> = old.iter().map(|d| (d.id.as_str(), d)).collect();
        let now: HashMap<&str, &DeviceView> = new.iter().map(|d| (d.id.as_str(), d)).collect();
        let mut change = Change::default();
        for d in new {
            match before.get(d.id.as_str()) {
                None => change.appeared.push(d.clone()),
                Some(was) if *was != d => change.changed.push(Changed {
                    id: d.id.clone(),
                    before: (*was).clone(),
                    after: d.clone(),
                }),
                Some(_) => {}
            }
        }
        change.vanished = old
            .iter()
            .filter(|d| !now.contains_key(d.id.as_str()))
            .map(|d| d.id.clone())
            .collect();
        change
    }
}

/// A device's view, for the inspector's tests.
#[cfg(test)]
pub(crate) fn device_view(id: &str, health: &str, numa: &[i64]) -> DeviceView {
    DeviceView {
        id: id.into(),
        health: health.into(),
        numa_nodes: numa.to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(id: &str, health: &str) -> DeviceView {
        DeviceView {
            id: id.into(),
            health: health.into(),
            numa_nodes: vec![],
        }
    }

    use super::device_view as d;

    #[test]
    fn appeared_vanished_and_changed() {
        let old = [
            d("a", "Healthy", &[0]),
            d("b", "Healthy", &[0]),
            d("c", "Healthy", &[]),
        ];
        let new = [
            d("c", "Healthy", &[]),
            d("b", "Unhealthy", &[0]),
            d("e", "Healthy", &[1]),
        ];
        let change = Change::between(&old, &new);
        assert_eq!(change.appeared, vec![d("e", "Healthy", &[1])]);
        assert_eq!(change.vanished, vec!["a".to_owned()]);
        assert_eq!(change.changed.len(), 1);
        assert_eq!(change.changed[0].after.health, "Unhealthy");
        assert_eq!(Change::between(&new, &new), Change::default());
    }

    #[test]
    fn only_the_exact_healthy_string_counts_as_healthy() {
        let counts = Counts::of(&[
            device("a", "Healthy"),
            device("b", "Unhealthy"),
            device("c", "healthy"),
            device("d", ""),
        ]);
        assert_eq!((counts.total, counts.healthy, counts.unhealthy), (4, 1, 3));
        assert_eq!(counts.by_health.len(), 4);
    }

    #[test]
    fn topology_becomes_a_list_of_numa_nodes() {
        let d = DeviceView::from(pb::Device {
            id: "x".into(),
            health: "Healthy".into(),
            topology: Some(pb::TopologyInfo {
                nodes: vec![pb::NumaNode { id: 0 }, pb::NumaNode { id: 3 }],
            }),
        });
        assert_eq!(d.numa_nodes, vec![0, 3]);
        let none = DeviceView::from(pb::Device::default());
        assert!(none.numa_nodes.is_empty());
    }
}
