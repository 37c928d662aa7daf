//! Settings of the `hostdev` backend: groups of host device nodes found by glob, USB id or PCI
//! id, how many containers may share each device, and the permissions containers get.

pub use crate::replicas::ReplicaPolicy;
use crate::settings::{check_env_name, SettingsError};
use serde::Deserialize;
use std::path::PathBuf;

/// Settings of the `hostdev` backend.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostdevSettings {
    /// Where devices come from; each group yields zero or more devices.
    pub groups: Vec<GroupSettings>,
    /// How many containers may share each device (ids become `<device>-<k>`).
    #[serde(default = "one")]
    pub count: u32,
    /// How preferred allocation places shared devices: `spread` (default) or `pack`.
    #[serde(default)]
    pub policy: ReplicaPolicy,
    /// If set, this env var receives the allocated ids, comma-separated.
    #[serde(default)]
    pub env: Option<String>,
    /// The host's /dev (for tests: a fake tree).
    #[serde(default = "default_dev_root")]
    pub dev_root: PathBuf,
    /// The host's /sys (for tests: a fake tree).
    #[serde(default = "default_sys_root")]
    pub sys_root: PathBuf,
}

/// Where a group's devices come from: exactly one of `paths`, `usb` or `pci`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupSettings {
    /// Device nodes by path or glob under /dev, e.g. `/dev/ttyUSB*` or `/dev/fuse`.
    #[serde(default)]
    pub paths: Vec<String>,
    /// With `paths`: all matched nodes together are one device (e.g. a card and its render node).
    #[serde(default)]
    pub bundle: bool,
    /// USB devices by vendor and optional product id; each brings its device nodes.
    #[serde(default)]
    pub usb: Vec<UsbMatch>,
    /// PCI devices by vendor, device and/or class; each brings its device nodes and NUMA node.
    #[serde(default)]
    pub pci: Vec<PciMatch>,
    /// Prefix for this group's device ids.
    #[serde(default)]
    pub name: Option<String>,
    /// Cgroup permissions for the nodes: a combination of `r`, `w`, `m` (default `rw`).
    #[serde(default = "default_permissions")]
    pub permissions: String,
    /// Extra bind mounts for containers that get a device of this group.
    #[serde(default)]
    pub mounts: Vec<MountSettings>,
}

impl Default for GroupSettings {
    /// Nothing matched yet, permissions `rw` (as when the field is left out of the config).
    fn default() -> Self {
        GroupSettings {
            paths: Vec::new(),
            bundle: false,
            usb: Vec::new(),
            pci: Vec::new(),
            name: None,
            permissions: default_permissions(),
            mounts: Vec::new(),
        }
    }
}

/// A USB device id, as in `lsusb` (hex, e.g. `0403` and `6001`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UsbMatch {
    /// Vendor id.
    pub vendor: String,
    /// Product id; any product of the vendor if absent.
    #[serde(default)]
    pub product: Option<String>,
}

/// A PCI device match; every given field must match (hex, e.g. vendor `10de`, class `0300`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PciMatch {
    /// Vendor id.
    #[serde(default)]
    pub vendor: Option<String>,
    /// Device id.
    #[serde(default)]
    pub device: Option<String>,
    /// Class code prefix (`03` display, `0300` VGA, `030000`).
    #[serde(default)]
    pub class: Option<String>,
}

impl PciMatch {
    /// True when every given field matches a device's ids, as sysfs writes them (`0x10de`,
    /// class `0x030000`; with or without `0x`, any case): vendor and device exactly, class as a
    /// prefix.
    pub fn matches(&self, vendor: Option<&str>, device: Option<&str>, class: Option<&str>) -> bool {
        let norm = |v: Option<&str>| v.map(normalize_hex);
        let (vendor, device, class) = (norm(vendor), norm(device), norm(class));
        let eq = |want: &Option<String>, have: &Option<String>| {
            want.as_ref()
                .is_none_or(|w| have.as_deref() == Some(normalize_hex(w).as_str()))
        };
        let class_ok = self.class.as_ref().is_none_or(|w| {
            class
                .as_deref()
                .is_some_and(|c| c.starts_with(&normalize_hex(w)))
        });
        eq(&self.vendor, &vendor) && eq(&self.device, &device) && class_ok
    }

    /// Checks the fields (`field` is this match's place in the config, e.g. `pci[0]`).
    pub(crate) fn validate(&self, field: &str) -> Result<(), SettingsError> {
        if self.vendor.is_none() && self.device.is_none() && self.class.is_none() {
            return Err(SettingsError::new(
                field,
                "set at least one of vendor, device, class",
            ));
        }
        for (name, value, max) in [
            ("vendor", &self.vendor, 4),
            ("device", &self.device, 4),
            ("class", &self.class, 6),
        ] {
            if let Some(value) = value {
                check_hex(&format!("{field}.{name}"), value, max)?;
            }
        }
        Ok(())
    }
}

/// An extra bind mount.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MountSettings {
    /// Path on the host.
    pub host_path: PathBuf,
    /// Path in the container.
    pub container_path: PathBuf,
    /// Mount read-only (default true).
    #[serde(default = "yes")]
    pub read_only: bool,
}

fn one() -> u32 {
    1
}

fn yes() -> bool {
    true
}

fn default_permissions() -> String {
    "rw".to_owned()
}

fn default_dev_root() -> PathBuf {
    PathBuf::from("/dev")
}

fn default_sys_root() -> PathBuf {
    PathBuf::from("/sys")
}

impl HostdevSettings {
    /// Settings with these groups and every default.
    pub fn new(groups: Vec<GroupSettings>) -> Self {
        HostdevSettings {
            groups,
            count: 1,
            policy: ReplicaPolicy::Spread,
            env: None,
            dev_root: default_dev_root(),
            sys_root: default_sys_root(),
        }
    }

    /// Checks every field.
    pub fn validate(&self) -> Result<(), SettingsError> {
        if self.groups.is_empty() {
            return Err(SettingsError::new(
                "groups",
                "the list is empty; add a group with paths, usb or pci",
            ));
        }
        if !(1..=10_000).contains(&self.count) {
            return Err(SettingsError::new(
                "count",
                format!("must be between 1 and 10000, got {}", self.count),
            ));
        }
        if let Some(env) = &self.env {
            check_env_name("env", env)?;
        }
        for (i, group) in self.groups.iter().enumerate() {
            group
                .validate()
                .map_err(|e| SettingsError::new(format!("groups[{i}].{}", e.field), e.problem))?;
        }
        Ok(())
    }
}

impl GroupSettings {
    fn validate(&self) -> Result<(), SettingsError> {
        let kinds = [
            !self.paths.is_empty(),
            !self.usb.is_empty(),
            !self.pci.is_empty(),
        ];
        if kinds.iter().filter(|k| **k).count() != 1 {
            return Err(SettingsError::new(
                "paths",
                "a group needs exactly one of paths, usb or pci",
            ));
        }
        for (i, path) in self.paths.iter().enumerate() {
            if !path.starts_with("/dev/") {
                return Err(SettingsError::new(
                    format!("paths[{i}]"),
                    format!("{path:?} must be a device node path under /dev/"),
                ));
            }
            if let Err(err) = glob::Pattern::new(path) {
                return Err(SettingsError::new(
                    format!("paths[{i}]"),
                    format!("{path:?} is not a valid glob: {err}"),
                ));
            }
        }
        if self.bundle && self.paths.is_empty() {
            return Err(SettingsError::new("bundle", "only applies to paths"));
        }
        for (i, usb) in self.usb.iter().enumerate() {
            check_hex(&format!("usb[{i}].vendor"), &usb.vendor, 4)?;
            if let Some(product) = &usb.product {
                check_hex(&format!("usb[{i}].product"), product, 4)?;
            }
        }
        for (i, pci) in self.pci.iter().enumerate() {
            pci.validate(&format!("pci[{i}]"))?;
        }
        if self.permissions.is_empty() || !self.permissions.chars().all(|c| "rwm".contains(c)) {
            return Err(SettingsError::new(
                "permissions",
                format!(
                    "{:?} must combine r, w and m (e.g. rw, or rwm to allow mknod)",
                    self.permissions
                ),
            ));
        }
        if let Some(name) = &self.name {
            if name.is_empty() || name.contains(',') || name.contains('/') {
                return Err(SettingsError::new(
                    "name",
                    "must be non-empty without ',' or '/'",
                ));
            }
        }
        for (i, mount) in self.mounts.iter().enumerate() {
            if !mount.host_path.is_absolute() || !mount.container_path.is_absolute() {
                return Err(SettingsError::new(
                    format!("mounts[{i}]"),
                    "host_path and container_path must be absolute",
                ));
            }
        }
        Ok(())
    }
}

/// Normalises a hex id: lowercase, without `0x`.
pub(crate) fn normalize_hex(value: &str) -> String {
    value
        .trim()
        .trim_start_matches("0x")
        .trim_start_matches("0X")
        .to_ascii_lowercase()
}

fn check_hex(field: &str, value: &str, max: usize) -> Result<(), SettingsError> {
    let v = normalize_hex(value);
    if v.is_empty() || v.len() > max || !v.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(SettingsError::new(
            field,
            format!("{value:?} must be a hex id of at most {max} digits, e.g. 10de"),
        ));
    }
    Ok(())
}
