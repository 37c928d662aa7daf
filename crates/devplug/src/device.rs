//! The device model: a device's id, health, NUMA nodes and (for DRA) attributes, and the list a
//! backend publishes.

use crate::dra::{
    AttributeValue, CapacityRequestPolicy, CounterConsumption, CounterSet, DeviceAttributes,
};
use devplug_proto::constants::{HEALTHY, MAX_RECV_MESSAGE_BYTES, UNHEALTHY};
use devplug_proto::v1beta1 as pb;
use prost::Message;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

/// Whether a device can be given to a container, and if not, why.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Health {
    /// The device works; the kubelet counts it as allocatable.
    #[default]
    Healthy,
    /// The device does not work. The reason is for people (logs, metrics, the inspector);
    /// the kubelet only sees `"Unhealthy"`.
    Unhealthy {
        /// Why the device is unhealthy, e.g. `"XID 79"` or `"node /dev/ttyUSB0 vanished"`.
        reason: String,
    },
}

/// The longest device id the kubelet documents (`Device.ID`).
pub const MAX_ID_LEN: usize = 63;

/// Checks that `id` can be a device id: not empty, at most [`MAX_ID_LEN`] bytes, and free of
/// ',' (ids are joined with ',' in env vars, by us and by vendors' tools), white space and
/// control characters. Returns what is wrong.
pub fn check_id(id: &str) -> Result<(), String> {
    if id.is_empty() {
        return Err("a device id cannot be empty".to_owned());
    }
    if id.len() > MAX_ID_LEN {
        return Err(format!(
            "device id {:?}… is {} bytes; the kubelet takes at most {MAX_ID_LEN}",
            id.chars().take(16).collect::<String>(),
            id.len()
        ));
    }
    if let Some(bad) = id
        .chars()
        .find(|c| *c == ',' || c.is_whitespace() || c.is_control())
    {
        return Err(format!(
            "device id {id:?} contains {bad:?}; ids cannot contain ',', spaces or control characters"
        ));
    }
    Ok(())
}

impl Health {
    /// An unhealthy state with a reason.
    pub fn unhealthy(reason: impl Into<String>) -> Self {
        Health::Unhealthy {
            reason: reason.into(),
        }
    }

    /// True for [`Health::Healthy`].
    pub fn is_healthy(&self) -> bool {
        matches!(self, Health::Healthy)
    }

    /// The string the kubelet expects: exactly `"Healthy"` or `"Unhealthy"`.
    pub fn as_wire(&self) -> &'static str {
        if self.is_healthy() {
            HEALTHY
        } else {
            UNHEALTHY
        }
    }
}

impl fmt::Display for Health {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Health::Healthy => f.write_str(HEALTHY),
            Health::Unhealthy { reason } if reason.is_empty() => f.write_str(UNHEALTHY),
            Health::Unhealthy { reason } => write!(f, "{UNHEALTHY} ({reason})"),
        }
    }
}

/// One schedulable device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    /// Unique id within the resource (the kubelet documents at most 63 characters).
    pub id: String,
    /// Current health.
    pub health: Health,
    /// NUMA nodes the device is attached to; empty means no NUMA preference.
    pub numa_nodes: Vec<i64>,
    /// Attributes and capacities for DRA selectors; `None` when the backend gives none. The
    /// device plugin path ignores them. Boxed: most device plugin lists never carry any.
    pub attributes: Option<Box<DeviceAttributes>>,
}

impl Device {
    /// A healthy device with no NUMA affinity.
    pub fn new(id: impl Into<String>) -> Self {
        Device {
            id: id.into(),
            health: Health::Healthy,
            numa_nodes: Vec::new(),
            attributes: None,
        }
    }

    /// The same device with one more DRA attribute (`model`, `numa`, `uuid`…).
    pub fn with_attribute(mut self, name: impl Into<String>, value: AttributeValue) -> Self {
        self.attributes
            .get_or_insert_with(Box::default)
            .attributes
            .insert(name.into(), value);
        self
    }

    /// The same device with one more DRA capacity (`memory` in bytes…).
    pub fn with_capacity(mut self, name: impl Into<String>, value: u64) -> Self {
        self.attributes
            .get_or_insert_with(Box::default)
            .capacity
            .insert(name.into(), value);
        self
    }

    /// The same device shared by capacity (DRA only): a capacity `name` of `value` that claims
    /// consume parts of by `policy`. A shared device needs a policy for each of its capacities.
    pub fn with_shared_capacity(
        mut self,
        name: impl Into<String>,
        value: u64,
        policy: CapacityRequestPolicy,
    ) -> Self {
        let name = name.into();
        let attributes = self.attributes.get_or_insert_with(Box::default);
        attributes.capacity.insert(name.clone(), value);
        attributes.shared.insert(name, policy);
        self
    }

    /// The same device consuming `counters` of the list's counter set `set` when allocated
    /// (DRA only: a partition of a partitionable device).
    pub fn consuming(mut self, set: impl Into<String>, counters: BTreeMap<String, u64>) -> Self {
        self.attributes
            .get_or_insert_with(Box::default)
            .consumes
            .push(CounterConsumption {
                set: set.into(),
                counters,
            });
        self
    }

    /// The device's DRA attributes and capacities (empty when it has none).
    pub fn dra_attributes(&self) -> &DeviceAttributes {
        static NONE: DeviceAttributes = DeviceAttributes {
            attributes: std::collections::BTreeMap::new(),
            capacity: std::collections::BTreeMap::new(),
            shared: std::collections::BTreeMap::new(),
            consumes: Vec::new(),
        };
        self.attributes.as_deref().unwrap_or(&NONE)
    }

    /// The same device attached to the given NUMA nodes.
    pub fn with_numa_nodes(mut self, nodes: impl IntoIterator<Item = i64>) -> Self {
        self.numa_nodes = nodes.into_iter().collect();
        self
    }

    /// The same device with another health.
    pub fn with_health(mut self, health: Health) -> Self {
        self.health = health;
        self
    }

    fn to_wire(&self) -> pb::Device {
        pb::Device {
            id: self.id.clone(),
            health: self.health.as_wire().to_owned(),
            topology: pb::TopologyInfo::for_numa_nodes(&self.numa_nodes),
        }
    }
}

/// The whole device list of one resource, as a backend publishes it. Each published list
/// replaces the previous one, exactly as each ListAndWatch message does at the kubelet.
///
/// Cheap to clone: the devices are shared, and copied only when a shared list is changed. The
/// lookup index is the devices' positions sorted by id (4 bytes a device, not a second copy of
/// every id).
#[derive(Debug, Clone, Default)]
pub struct DeviceList {
    inner: Arc<ListInner>,
}

#[derive(Debug, Clone, Default)]
struct ListInner {
    devices: Vec<Device>,
    by_id: Vec<u32>,
    counter_sets: Vec<CounterSet>,
}

impl PartialEq for DeviceList {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
            || (self.inner.devices == other.inner.devices
                && self.inner.counter_sets == other.inner.counter_sets)
    }
}

impl Eq for DeviceList {}

impl DeviceList {
    /// A list of `devices` in the given order. If an id repeats, the last entry wins.
    pub fn new(devices: impl IntoIterator<Item = Device>) -> Self {
        let mut devices: Vec<Device> = devices.into_iter().collect();
        let mut by_id: Vec<u32> = (0..devices.len() as u32).collect();
        // Stable sort: among equal ids the last position comes last.
        by_id.sort_by(|&a, &b| devices[a as usize].id.cmp(&devices[b as usize].id));
        let repeated = by_id
            .windows(2)
            .any(|w| devices[w[0] as usize].id == devices[w[1] as usize].id);
        if repeated {
            // Keep the last entry of each id, in first-seen order.
            let mut last: std::collections::HashMap<&str, usize> = Default::default();
            for (i, d) in devices.iter().enumerate() {
                last.insert(d.id.as_str(), i);
            }
            let mut seen = std::collections::HashSet::new();
            let keep: Vec<usize> = devices
                .iter()
                .filter(|d| seen.insert(d.id.as_str()))
                .map(|d| last[d.id.as_str()])
                .collect();
            let deduped: Vec<Device> = keep.into_iter().map(|i| devices[i].clone()).collect();
            return DeviceList::new(deduped);
        }
        devices.shrink_to_fit();
        DeviceList {
            inner: Arc::new(ListInner {
                devices,
                by_id,
                counter_sets: Vec::new(),
            }),
        }
    }

    /// The same list with the counter sets its devices consume (DRA only: partitionable
    /// devices, see [`Device::consuming`]).
    pub fn with_counter_sets(mut self, sets: Vec<CounterSet>) -> Self {
        Arc::make_mut(&mut self.inner).counter_sets = sets;
        self
    }

    /// The counter sets of the list (empty for most).
    pub fn counter_sets(&self) -> &[CounterSet] {
        &self.inner.counter_sets
    }

    /// The devices, in the backend's order.
    pub fn devices(&self) -> &[Device] {
        &self.inner.devices
    }

    fn position(&self, id: &str) -> Option<usize> {
        let inner = &self.inner;
        inner
            .by_id
            .binary_search_by(|&i| inner.devices[i as usize].id.as_str().cmp(id))
            .ok()
            .map(|k| inner.by_id[k] as usize)
    }

    /// The device with this id.
    pub fn get(&self, id: &str) -> Option<&Device> {
        self.position(id).map(|i| &self.inner.devices[i])
    }

    /// Number of devices.
    pub fn len(&self) -> usize {
        self.inner.devices.len()
    }

    /// True when there are no devices.
    pub fn is_empty(&self) -> bool {
        self.inner.devices.is_empty()
    }

    /// Number of healthy devices (the kubelet's allocatable).
    pub fn healthy_count(&self) -> usize {
        self.inner
            .devices
            .iter()
            .filter(|d| d.health.is_healthy())
            .count()
    }

    /// Sets one device's health; returns true if it changed.
    pub fn set_health(&mut self, id: &str, health: Health) -> bool {
        match self.position(id) {
            Some(i) if self.inner.devices[i].health != health => {
                Arc::make_mut(&mut self.inner).devices[i].health = health;
                true
            }
            _ => false,
        }
    }

    /// The ListAndWatch message for this list, refused if the kubelet could not receive it.
    pub fn to_wire(&self) -> Result<pb::ListAndWatchResponse, ListTooLarge> {
        let msg = pb::ListAndWatchResponse {
            devices: self.devices().iter().map(Device::to_wire).collect(),
        };
        let bytes = msg.encoded_len();
        if bytes > MAX_RECV_MESSAGE_BYTES {
            return Err(ListTooLarge {
                devices: self.len(),
                bytes,
                fit: self.len().saturating_mul(MAX_RECV_MESSAGE_BYTES) / bytes,
            });
        }
        Ok(msg)
    }
}

/// A device list whose ListAndWatch message is over the kubelet's 4 MiB receive limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the device list of {devices} devices encodes to {bytes} bytes, over the kubelet's 4 MiB \
     message limit; about {fit} devices of this size fit (use shorter ids, fewer shares, or split \
     the resource)"
)]
pub struct ListTooLarge {
    /// Devices in the list.
    pub devices: usize,
    /// Encoded size of the ListAndWatch message.
    pub bytes: usize,
    /// About how many devices of the same average size would fit.
    pub fit: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_form_uses_exact_health_strings_and_topology() {
        let list = DeviceList::new([
            Device::new("a").with_numa_nodes([0]),
            Device::new("b").with_health(Health::unhealthy("gone")),
        ]);
        let wire = list.to_wire().unwrap();
        assert_eq!(wire.devices[0].health, "Healthy");
        assert_eq!(wire.devices[0].topology.as_ref().unwrap().nodes[0].id, 0);
        assert_eq!(wire.devices[1].health, "Unhealthy");
        assert!(wire.devices[1].topology.is_none());
        assert_eq!(list.healthy_count(), 1);
    }

    #[test]
    fn device_ids_follow_the_kubelet_rules() {
        assert!(check_id("gpu-0").is_ok());
        assert!(check_id(&"x".repeat(63)).is_ok());
        assert!(check_id(&"x".repeat(64))
            .unwrap_err()
            .contains("at most 63"));
        assert!(check_id("").is_err());
        assert!(check_id("a,b").unwrap_err().contains("','"));
        assert!(check_id("a b").is_err());
        assert!(check_id("a\nb").is_err());
    }

    #[test]
    fn repeated_ids_keep_the_last_entry() {
        let list = DeviceList::new([
            Device::new("b"),
            Device::new("a"),
            Device::new("b").with_numa_nodes([1]),
        ]);
        assert_eq!(list.len(), 2);
        assert_eq!(list.devices()[0].id, "b", "first-seen order");
        assert_eq!(list.get("b").unwrap().numa_nodes, vec![1]);
        assert!(list.get("a").is_some() && list.get("c").is_none());
    }

    #[test]
    fn clones_share_until_changed() {
        let a = DeviceList::new((0..10).map(|i| Device::new(format!("d{i}"))));
        let mut b = a.clone();
        assert_eq!(a, b);
        assert!(b.set_health("d3", Health::unhealthy("x")));
        assert!(
            a.get("d3").unwrap().health.is_healthy(),
            "the original is untouched"
        );
        assert_ne!(a, b);
        assert!(!b.set_health("d3", Health::unhealthy("x")));
        assert!(!b.set_health("nope", Health::Healthy));
    }

    #[test]
    fn oversized_list_is_refused_with_how_many_fit() {
        // 36-character ids cost 36 + 13 bytes each: ~85,000 fit in 4 MiB.
        let ids = (0..100_000).map(|i| Device::new(format!("{i:036}")));
        let err = DeviceList::new(ids).to_wire().unwrap_err();
        assert!(err.bytes > MAX_RECV_MESSAGE_BYTES);
        assert!((84_000..86_000).contains(&err.fit), "{err}");
        assert!(err.to_string().contains("devices of this size fit"));
        let ids = (0..50_000).map(|i| Device::new(format!("{i:036}")));
        assert!(DeviceList::new(ids).to_wire().is_ok());
    }
}
