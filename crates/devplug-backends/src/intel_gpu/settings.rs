//! Settings of the `intel-gpu` backend (config key `intel_gpu`): which driver's GPUs to
//! serve, how many containers share each GPU and how shares are placed, `/dev/dri/by-path`
//! mounts, CDI output, and the sysfs and dev roots (fake trees in tests).

use crate::hostdev::ReplicaPolicy;
use crate::settings::{
    check_roots, default_cdi_dir, default_dev_root, default_sys_root, yes, SettingsError,
};
use serde::Deserialize;
use std::path::PathBuf;

/// The kernel driver an Intel GPU is bound to; one resource serves one driver's GPUs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IntelDriver {
    /// `i915` (resource `gpu.intel.com/i915`).
    #[default]
    I915,
    /// `xe` (resource `gpu.intel.com/xe`).
    Xe,
}

impl IntelDriver {
    /// The driver's name in sysfs.
    pub fn name(self) -> &'static str {
        match self {
            IntelDriver::I915 => "i915",
            IntelDriver::Xe => "xe",
        }
    }
}

/// Settings of the `intel-gpu` backend.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IntelGpuSettings {
    /// Serve the GPUs bound to this driver: `i915` (default) or `xe`.
    #[serde(default)]
    pub driver: IntelDriver,
    /// How many containers may share each GPU (default 1). These are shares of one GPU, not
    /// more GPUs: ids become `card0-0 … card0-(N-1)`, and every share gets the whole GPU's
    /// nodes, with no isolation of memory or compute between the containers.
    #[serde(default = "one")]
    pub count: u32,
    /// How preferred allocation places shares: `spread` (default, shares of different GPUs) or
    /// `pack` (fill one GPU's shares first).
    #[serde(default)]
    pub policy: ReplicaPolicy,
    /// Mount `/dev/dri/by-path/pci-<bdf>-{card,render}` read-only when that folder exists
    /// (default true).
    #[serde(default = "yes")]
    pub by_path: bool,
    /// Write a CDI spec (kind `gpu.intel.com/<driver>`) and name CDI devices in `Allocate`
    /// (default true). Device nodes are sent as device specs either way.
    #[serde(default = "yes")]
    pub cdi: bool,
    /// Where the CDI spec goes (default `/var/run/cdi`).
    #[serde(default = "default_cdi_dir")]
    pub cdi_dir: PathBuf,
    /// The host's /dev (for tests: a fake tree).
    #[serde(default = "default_dev_root")]
    pub dev_root: PathBuf,
    /// The host's /sys (for tests: a fake tree).
    #[serde(default = "default_sys_root")]
    pub sys_root: PathBuf,
}

impl Default for IntelGpuSettings {
    /// `i915` GPUs, unshared, by-path mounts and CDI on, the host's /sys and /dev.
    fn default() -> Self {
        IntelGpuSettings {
            driver: IntelDriver::I915,
            count: 1,
            policy: ReplicaPolicy::Spread,
            by_path: true,
            cdi: true,
            cdi_dir: default_cdi_dir(),
            dev_root: default_dev_root(),
            sys_root: default_sys_root(),
        }
    }
}

fn one() -> u32 {
    1
}

impl IntelGpuSettings {
    /// Checks every field.
    pub fn validate(&self) -> Result<(), SettingsError> {
        if !(1..=1000).contains(&self.count) {
            return Err(SettingsError::new(
                "count",
                format!(
                    "must be between 1 and 1000 (shares of each GPU), got {}",
                    self.count
                ),
            ));
        }
        check_roots(&self.cdi_dir, &self.dev_root, &self.sys_root)
    }
}
