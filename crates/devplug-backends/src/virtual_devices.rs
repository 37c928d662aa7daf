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
        let devices = (0..settings.count).map(|i| {
            let device = Device::new(format!("{}{i}", settings.id_prefix));
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
