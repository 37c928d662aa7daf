//! The `virtual` backend: `count` devices that exist only in software (the tutorial's dummy NPU,
//! done right). Ids are stable (`<prefix><n>`), allocation sets one env var to the ids,
//! comma-separated, and devices can be spread over NUMA nodes for topology tests. Health changes
//! only when asked ([`VirtualBackend::set_health`]); allocation never marks a device unhealthy.
//!
//! Virtual devices carry no DRA attributes, on purpose: even one int (`index`) costs about 685
//! bytes a device (a boxed attribute set and its B-tree node; measured: 100 bytes a device
//! without, 785 with), some 2 MiB for the 3 × 1,000 devices of the memory benchmark. A DRA
//! driver still publishes `numa` for them when `numa_nodes` is set: the ResourceSlice publisher
//! derives it from the NUMA node when it writes the slice, at no cost here.

use crate::settings::{check_env_name, SettingsError};
use devplug::dra::{AttributeValue, CapacityRequestPolicy, CounterSet};
use devplug::{AllocateError, Backend, ContainerEdits, Device, DeviceList, Health};
use serde::Deserialize;
use tokio::sync::watch;

/// Most devices one virtual resource may have: more would not fit the kubelet's 4 MiB message.
pub const MAX_COUNT: usize = 50_000;

/// Settings of the `virtual` backend.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VirtualSettings {
    /// How many devices.
    pub count: usize,
    /// The env var that receives the allocated ids, comma-separated.
    #[serde(default = "default_env")]
    pub env: String,
    /// Device ids are this prefix followed by a number.
    #[serde(default = "default_prefix")]
    pub id_prefix: String,
    /// Spread devices round-robin over this many NUMA nodes (0: no topology).
    #[serde(default)]
    pub numa_nodes: u32,
    /// Share each device by capacity between claims (DRA only; the device plugin API counts
    /// whole devices).
    #[serde(default)]
    pub share: Option<VirtualShare>,
    /// Make each device partitionable (DRA only): published whole and in parts that the
    /// scheduler never gives out overlapping.
    #[serde(default)]
    pub partitions: Option<VirtualPartitions>,
}

/// How each virtual device splits: into `slices` equal parts, offered whole and as partitions
/// of each of `sizes` slices at aligned offsets (`<id>-s<size>-<offset>`, e.g. `virtual-0-s2-2`:
/// slices 2 and 3). Each device is a counter set of `slices` counters (`slice-0` …); a
/// partition consumes its slices, the whole device all of them, so the scheduler never gives
/// out two that overlap. A container finds its devices in `<env>` and their slices in
/// `<env>_SLICES` (`2-3`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VirtualPartitions {
    /// How many slices a device has.
    pub slices: u32,
    /// The partition sizes offered besides the whole device, in slices; each divides `slices`.
    pub sizes: Vec<u32>,
}

/// The counter of one slice of a partitionable virtual device.
fn slice_counter(slice: u32) -> String {
    format!("slice-{slice}")
}

/// A partition's id: `<parent>-s<size>-<offset>`.
fn partition_id(parent: &str, size: u32, offset: u32) -> String {
    format!("{parent}-s{size}-{offset}")
}

/// How each virtual device is shared by capacity: `cores` compute units in steps of 1, and
/// optionally `memory` bytes in steps of `memory_step`. A claim that does not ask for one of
/// them gets one step of it. A share's container sees what it got as `<env>_CORES` and
/// `<env>_MEMORY`, beside `<env>` naming the device.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VirtualShare {
    /// Compute units a device has (100: a percentage).
    #[serde(default = "default_cores")]
    pub cores: u64,
    /// Memory a device has, as a quantity (`16Gi`); none: shared by cores only.
    #[serde(default)]
    pub memory: Option<String>,
    /// The unit memory is shared in (`256Mi`).
    #[serde(default = "default_memory_step")]
    pub memory_step: String,
}

fn default_cores() -> u64 {
    100
}

fn default_memory_step() -> String {
    "256Mi".to_owned()
}

impl VirtualShare {
    /// The device's shared capacities and their policies, or what is wrong with a field.
    fn capacities(&self) -> Result<Vec<(&'static str, u64, CapacityRequestPolicy)>, SettingsError> {
        let mut out = Vec::new();
        let cores = CapacityRequestPolicy::steps_of(1);
        cores.check(self.cores).map_err(|e| {
            SettingsError::new(
                "share.cores",
                format!("{e}; give at least 2 (100 is usual)"),
            )
        })?;
        out.push(("cores", self.cores, cores));
        if let Some(memory) = &self.memory {
            let bytes = quantity_field("share.memory", memory)?;
            let step = quantity_field("share.memory_step", &self.memory_step)?;
            let policy = CapacityRequestPolicy::steps_of(step);
            policy.check(bytes).map_err(|e| {
                SettingsError::new(
                    "share.memory_step",
                    format!("{e}; make memory_step at most half of memory"),
                )
            })?;
            out.push(("memory", bytes, policy));
        }
        Ok(out)
    }
}

fn quantity_field(field: &str, value: &str) -> Result<u64, SettingsError> {
    devplug::dra::parse_quantity(value).ok_or_else(|| {
        SettingsError::new(
            field,
            format!("{value:?} is not a whole quantity; write it as 16Gi, 512Mi or 1000000"),
        )
    })
}

fn default_env() -> String {
    "VIRTUAL_DEVICES".to_owned()
}

fn default_prefix() -> String {
    "virtual-".to_owned()
}

impl VirtualSettings {
    /// `count` devices with the default env var and id prefix.
    pub fn new(count: usize) -> Self {
        VirtualSettings {
            count,
            env: default_env(),
            id_prefix: default_prefix(),
            numa_nodes: 0,
            share: None,
            partitions: None,
        }
    }

    /// Checks every field.
    pub fn validate(&self) -> Result<(), SettingsError> {
        if !(1..=MAX_COUNT).contains(&self.count) {
            return Err(SettingsError::new(
                "count",
                format!("must be between 1 and {MAX_COUNT}, got {}", self.count),
            ));
        }
        check_env_name("env", &self.env)?;
        let longest = format!("{}{}", self.id_prefix, self.count - 1);
        if longest.len() > devplug::device::MAX_ID_LEN {
            return Err(SettingsError::new(
                "id_prefix",
                "device ids would be longer than the kubelet's 63 characters; shorten the prefix",
            ));
        }
        if let Err(problem) = devplug::device::check_id(&longest) {
            return Err(SettingsError::new(
                "id_prefix",
                format!("{problem}; ids are joined with ',' in the env var"),
            ));
        }
        if self.numa_nodes > 1024 {
            return Err(SettingsError::new("numa_nodes", "must be at most 1024"));
        }
        if let Some(share) = &self.share {
            share.capacities()?;
        }
        if let Some(partitions) = &self.partitions {
            self.check_partitions(partitions)?;
        }
        Ok(())
    }

    fn check_partitions(&self, partitions: &VirtualPartitions) -> Result<(), SettingsError> {
        use devplug::dra::{check_label, MAX_COUNTERS, MAX_COUNTER_SETS};
        if self.share.is_some() {
            return Err(SettingsError::new(
                "partitions",
                "a device is shared by capacity or split into partitions, not both: remove \
                 share or partitions",
            ));
        }
        if self.count > MAX_COUNTER_SETS {
            return Err(SettingsError::new(
                "partitions",
                format!(
                    "{} devices; at most {MAX_COUNTER_SETS} can be partitionable (a \
                     ResourceSlice holds at most {MAX_COUNTER_SETS} counter sets)",
                    self.count
                ),
            ));
        }
        let slices = partitions.slices;
        if !(2..=MAX_COUNTERS as u32).contains(&slices) {
            return Err(SettingsError::new(
                "partitions.slices",
                format!("must be between 2 and {MAX_COUNTERS}, got {slices}"),
            ));
        }
        if partitions.sizes.is_empty() {
            return Err(SettingsError::new(
                "partitions.sizes",
                "is empty: name at least one partition size, e.g. [1, 2]",
            ));
        }
        for (i, &size) in partitions.sizes.iter().enumerate() {
            if size == 0 || size >= slices || !slices.is_multiple_of(size) {
                return Err(SettingsError::new(
                    format!("partitions.sizes[{i}]"),
                    format!("{size} must be less than slices ({slices}) and divide it"),
                ));
            }
            if partitions.sizes[..i].contains(&size) {
                return Err(SettingsError::new(
                    format!("partitions.sizes[{i}]"),
                    format!("{size} is listed twice"),
                ));
            }
        }
        let last = format!("{}{}", self.id_prefix, self.count.saturating_sub(1));
        let smallest = partitions.sizes.iter().min().copied().unwrap_or(1);
        let longest = partition_id(&last, smallest, slices.saturating_sub(smallest));
        check_label(&last)
            .and_then(|()| check_label(&longest))
            .map_err(|e| {
                SettingsError::new(
                    "id_prefix",
                    format!("with partitions, ids name counter sets and devices: {longest:?} {e}"),
                )
            })?;
        Ok(())
    }
}

/// `device` as the partition of `size` slices at `offset` of the partitionable device `parent`
/// of `slices` slices (the whole device: offset 0, all slices).
fn partition(device: Device, parent: &str, slices: u32, offset: u32, size: u32) -> Device {
    let consumed = (offset..offset.saturating_add(size))
        .map(|s| (slice_counter(s), 1))
        .collect();
    device
        .with_attribute("parent", AttributeValue::String(parent.to_owned()))
        .with_attribute("slices", AttributeValue::Int(i64::from(size)))
        .with_attribute("offset", AttributeValue::Int(i64::from(offset)))
        .with_attribute("whole", AttributeValue::Bool(size == slices))
        .consuming(parent, consumed)
}

/// Software-only devices.
pub struct VirtualBackend {
    env: String,
    devices: watch::Sender<DeviceList>,
}

impl VirtualBackend {
    /// A backend with the devices `settings` describe.
    pub fn new(settings: &VirtualSettings) -> Result<Self, SettingsError> {
        settings.validate()?;
        let shared = match &settings.share {
            Some(share) => share.capacities()?,
            None => Vec::new(),
        };
        let mut devices = Vec::new();
        let mut counter_sets = Vec::new();
        for i in 0..settings.count {
            let id = format!("{}{i}", settings.id_prefix);
            let numa = match settings.numa_nodes {
                0 => None,
                n => Some((i as u64 % u64::from(n)) as i64),
            };
            let mut device = Device::new(&id).with_numa_nodes(numa);
            for (name, value, policy) in &shared {
                device = device.with_shared_capacity(*name, *value, *policy);
            }
            let Some(partitions) = &settings.partitions else {
                devices.push(device);
                continue;
            };
            let slices = partitions.slices;
            counter_sets.push(CounterSet {
                name: id.clone(),
                counters: (0..slices).map(|s| (slice_counter(s), 1)).collect(),
            });
            devices.push(partition(device, &id, slices, 0, slices));
            for &size in &partitions.sizes {
                for offset in (0..slices).step_by(size.max(1) as usize) {
                    let part = Device::new(partition_id(&id, size, offset)).with_numa_nodes(numa);
                    devices.push(partition(part, &id, slices, offset, size));
                }
            }
        }
        Ok(VirtualBackend {
            env: settings.env.clone(),
            devices: watch::Sender::new(DeviceList::new(devices).with_counter_sets(counter_sets)),
        })
    }

    /// Changes one device's health (a virtual device breaks or recovers when told). Returns false
    /// if there is no such device or nothing changed.
    pub fn set_health(&self, id: &str, health: Health) -> bool {
        self.devices
            .send_if_modified(|list| list.set_health(id, health))
    }
}

impl Backend for VirtualBackend {
    fn devices(&self) -> watch::Receiver<DeviceList> {
        self.devices.subscribe()
    }

    fn allocate(&self, ids: &[String]) -> Result<ContainerEdits, AllocateError> {
        let edits = ContainerEdits::default().env(&self.env, ids.join(","));
        let list = self.devices.borrow();
        if list.counter_sets().is_empty() {
            return Ok(edits);
        }
        let slices: Vec<String> = ids
            .iter()
            .filter_map(|id| list.get(id))
            .map(|d| {
                let int = |name: &str| match d.dra_attributes().attributes.get(name) {
                    Some(AttributeValue::Int(v)) => *v,
                    _ => 0,
                };
                let (offset, size) = (int("offset"), int("slices"));
                format!("{offset}-{}", offset.saturating_add(size).saturating_sub(1))
            })
            .collect();
        Ok(edits.env(format!("{}_SLICES", self.env), slices.join(",")))
    }
}

/// Devices handed to claims whole as [`Backend::allocate`] gives them, and shares of devices
/// shared by capacity (`share:`).
impl devplug::dra::ClaimBackend for VirtualBackend {
    /// The device in `<env>`, and what the share got of each capacity in `<env>_<NAME>`.
    fn prepare_share(
        &self,
        id: &str,
        consumed: &std::collections::BTreeMap<String, u64>,
    ) -> Result<ContainerEdits, AllocateError> {
        let shared = self
            .devices
            .borrow()
            .get(id)
            .is_some_and(|d| d.dra_attributes().is_shared());
        if !shared {
            return Err(AllocateError::InvalidRequest(format!(
                "device {id} is not shared by capacity (no share: in its settings)"
            )));
        }
        let mut edits = ContainerEdits::default().env(&self.env, id);
        for (name, value) in consumed {
            let key = format!("{}_{}", self.env, name.to_ascii_uppercase());
            edits = edits.env(key, value.to_string());
        }
        Ok(edits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stable_ids_numa_spread_and_env() {
        let settings = VirtualSettings {
            numa_nodes: 2,
            env: "DUMMY_VISIBLE_DEVICES".into(),
            ..VirtualSettings::new(4)
        };
        let backend = VirtualBackend::new(&settings).unwrap();
        let list = backend.devices().borrow().clone();
        let ids: Vec<_> = list.devices().iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["virtual-0", "virtual-1", "virtual-2", "virtual-3"]);
        assert_eq!(list.get("virtual-3").unwrap().numa_nodes, vec![1]);
        assert!(
            list.devices().iter().all(|d| d.attributes.is_none()),
            "no DRA attributes: memory"
        );
        let edits = backend
            .allocate(&["virtual-1".into(), "virtual-3".into()])
            .unwrap();
        assert_eq!(edits.envs["DUMMY_VISIBLE_DEVICES"], "virtual-1,virtual-3");
        // Allocation does not touch health.
        assert_eq!(backend.devices().borrow().healthy_count(), 4);
    }

    #[test]
    fn bad_settings_name_the_field() {
        let err = VirtualSettings::new(0).validate().unwrap_err();
        assert_eq!(err.field, "count");
        let err = VirtualSettings::new(MAX_COUNT + 1).validate().unwrap_err();
        assert!(err.problem.contains("50000"));
        let bad_env = VirtualSettings {
            env: "1X".into(),
            ..VirtualSettings::new(1)
        };
        assert_eq!(bad_env.validate().unwrap_err().field, "env");
        let long = VirtualSettings {
            id_prefix: "x".repeat(62),
            ..VirtualSettings::new(20)
        };
        assert_eq!(long.validate().unwrap_err().field, "id_prefix");
        let share = |cores: u64, memory: Option<&str>, step: &str| VirtualSettings {
            share: Some(VirtualShare {
                cores,
                memory: memory.map(str::to_owned),
                memory_step: step.into(),
            }),
            ..VirtualSettings::new(1)
        };
        let field = |s: VirtualSettings| s.validate().unwrap_err().field;
        assert_eq!(field(share(1, None, "1Mi")), "share.cores");
        assert_eq!(field(share(100, Some("16 GB"), "1Mi")), "share.memory");
        assert_eq!(field(share(100, Some("1Gi"), "1.5Mi")), "share.memory_step");
        assert_eq!(field(share(100, Some("1Gi"), "1Gi")), "share.memory_step");
        assert!(share(100, Some("16Gi"), "256Mi").validate().is_ok());
    }

    #[test]
    fn partitionable_devices_are_counter_sets_with_whole_and_partition_devices() {
        let settings = VirtualSettings {
            id_prefix: "gpu-".into(),
            partitions: Some(VirtualPartitions {
                slices: 4,
                sizes: vec![2, 1],
            }),
            ..VirtualSettings::new(2)
        };
        let backend = VirtualBackend::new(&settings).unwrap();
        let list = backend.devices().borrow().clone();
        let ids: Vec<&str> = list.devices().iter().map(|d| d.id.as_str()).collect();
        assert_eq!(
            &ids[..7],
            [
                "gpu-0",
                "gpu-0-s2-0",
                "gpu-0-s2-2",
                "gpu-0-s1-0",
                "gpu-0-s1-1",
                "gpu-0-s1-2",
                "gpu-0-s1-3"
            ]
        );
        assert_eq!(list.len(), 14);
        let sets = list.counter_sets();
        assert_eq!(sets.len(), 2);
        assert_eq!(sets[0].name, "gpu-0");
        assert_eq!(sets[0].counters.len(), 4);
        let consumed = |id: &str| -> Vec<String> {
            let attrs = list.get(id).unwrap().dra_attributes();
            assert!(attrs.check().is_ok(), "{attrs:?}");
            assert_eq!(attrs.consumes[0].set, id[..5]);
            attrs.consumes[0].counters.keys().cloned().collect()
        };
        assert_eq!(
            consumed("gpu-0"),
            ["slice-0", "slice-1", "slice-2", "slice-3"]
        );
        assert_eq!(consumed("gpu-1-s2-2"), ["slice-2", "slice-3"]);
        let edits = backend
            .allocate(&["gpu-1-s2-2".into(), "gpu-0-s1-1".into()])
            .unwrap();
        assert_eq!(edits.envs["VIRTUAL_DEVICES"], "gpu-1-s2-2,gpu-0-s1-1");
        assert_eq!(edits.envs["VIRTUAL_DEVICES_SLICES"], "2-3,1-1");

        let with = |slices: u32, sizes: Vec<u32>, count: usize| VirtualSettings {
            partitions: Some(VirtualPartitions { slices, sizes }),
            ..VirtualSettings::new(count)
        };
        let field = |s: VirtualSettings| s.validate().unwrap_err().field;
        assert_eq!(field(with(1, vec![1], 1)), "partitions.slices");
        assert_eq!(field(with(4, vec![], 1)), "partitions.sizes");
        assert_eq!(field(with(4, vec![3], 1)), "partitions.sizes[0]");
        assert_eq!(field(with(4, vec![2, 2], 1)), "partitions.sizes[1]");
        assert_eq!(field(with(4, vec![4], 1)), "partitions.sizes[0]");
        assert_eq!(field(with(4, vec![2], 9)), "partitions");
        let upper = VirtualSettings {
            id_prefix: "GPU".into(),
            ..with(4, vec![2], 1)
        };
        assert_eq!(field(upper), "id_prefix");
    }

    #[test]
    fn shared_devices_publish_their_capacities_and_give_each_share_its_limits() {
        let settings = VirtualSettings {
            share: Some(VirtualShare {
                cores: 100,
                memory: Some("16Gi".into()),
                memory_step: "1Gi".into(),
            }),
            ..VirtualSettings::new(2)
        };
        let backend = VirtualBackend::new(&settings).unwrap();
        let list = backend.devices().borrow().clone();
        let attrs = list.get("virtual-1").unwrap().dra_attributes();
        assert!(attrs.is_shared() && attrs.check().is_ok());
        assert_eq!(attrs.capacity["memory"], 16 << 30);
        assert_eq!(
            attrs.shared["memory"],
            CapacityRequestPolicy::steps_of(1 << 30)
        );
        let consumed = std::collections::BTreeMap::from([
            ("cores".to_owned(), 40),
            ("memory".to_owned(), 4 << 30),
        ]);
        let edits =
            devplug::dra::ClaimBackend::prepare_share(&backend, "virtual-1", &consumed).unwrap();
        assert_eq!(edits.envs["VIRTUAL_DEVICES"], "virtual-1");
        assert_eq!(edits.envs["VIRTUAL_DEVICES_CORES"], "40");
        assert_eq!(
            edits.envs["VIRTUAL_DEVICES_MEMORY"],
            (4u64 << 30).to_string()
        );
        let whole = VirtualBackend::new(&VirtualSettings::new(1)).unwrap();
        let err =
            devplug::dra::ClaimBackend::prepare_share(&whole, "virtual-0", &consumed).unwrap_err();
        assert!(err.to_string().contains("not shared by capacity"), "{err}");
    }

    #[test]
    fn the_largest_count_fits_the_kubelet_limit() {
        let settings = VirtualSettings::new(MAX_COUNT);
        let backend = VirtualBackend::new(&settings).unwrap();
        assert!(backend.devices().borrow().to_wire().is_ok());
    }

    #[test]
    fn health_changes_are_published_once() {
        let backend = VirtualBackend::new(&VirtualSettings::new(2)).unwrap();
        let mut rx = backend.devices();
        rx.borrow_and_update();
        assert!(backend.set_health("virtual-0", Health::unhealthy("test")));
        assert!(rx.has_changed().unwrap());
        rx.borrow_and_update();
        assert!(!backend.set_health("virtual-0", Health::unhealthy("test")));
        assert!(!backend.set_health("nope", Health::Healthy));
        assert!(!rx.has_changed().unwrap());
    }
}
