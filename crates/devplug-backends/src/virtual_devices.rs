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
use devplug::{AllocateError, Backend, ContainerEdits, Device, DeviceList, Health, SharePolicy};
use serde::Deserialize;
use std::collections::BTreeMap;
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
    fn capacities(&self) -> Result<Vec<(&'static str, u64, SharePolicy)>, SettingsError> {
        let mut out = Vec::new();
        let cores = SharePolicy::steps_of(1);
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
            let policy = SharePolicy::steps_of(step);
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
    devplug::quantity::parse_quantity(value).ok_or_else(|| {
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
        if longest.len() > devplug::MAX_ID_LEN {
            return Err(SettingsError::new(
                "id_prefix",
                "device ids would be longer than the kubelet's 63 characters; shorten the prefix",
            ));
        }
        if let Err(problem) = devplug::check_id(&longest) {
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
        Ok(())
    }
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
        let devices = (0..settings.count).map(|i| {
            let mut device = Device::new(format!("{}{i}", settings.id_prefix));
            for (name, value, policy) in &shared {
                device = device.with_shared_capacity(*name, *value, *policy);
            }
            match settings.numa_nodes {
                0 => device,
                n => device.with_numa_nodes([(i as u64 % u64::from(n)) as i64]),
            }
        });
        Ok(VirtualBackend {
            env: settings.env.clone(),
            devices: watch::Sender::new(DeviceList::new(devices)),
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
        Ok(ContainerEdits::default().env(&self.env, ids.join(",")))
    }

    /// The device in `<env>`, and what the share got of each capacity in `<env>_<NAME>`.
    fn allocate_share(
        &self,
        id: &str,
        consumed: &BTreeMap<String, u64>,
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
        assert_eq!(attrs.shared["memory"], SharePolicy::steps_of(1 << 30));
        let consumed = BTreeMap::from([("cores".to_owned(), 40), ("memory".to_owned(), 4 << 30)]);
        let edits = backend.allocate_share("virtual-1", &consumed).unwrap();
        assert_eq!(edits.envs["VIRTUAL_DEVICES"], "virtual-1");
        assert_eq!(edits.envs["VIRTUAL_DEVICES_CORES"], "40");
        assert_eq!(
            edits.envs["VIRTUAL_DEVICES_MEMORY"],
            (4u64 << 30).to_string()
        );
        let whole = VirtualBackend::new(&VirtualSettings::new(1)).unwrap();
        let err = whole.allocate_share("virtual-0", &consumed).unwrap_err();
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
