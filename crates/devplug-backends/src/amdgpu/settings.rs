//! Settings of the `amdgpu` backend: which partition type to serve (for ROCm's `mixed`
//! naming), CDI spec output, and the sysfs and dev roots (fake trees in tests).

use crate::settings::{
    check_roots, default_cdi_dir, default_dev_root, default_sys_root, yes, SettingsError,
};
use serde::Deserialize;
use std::path::PathBuf;

/// Settings of the `amdgpu` backend.
///
/// One resource serves every GPU and compute partition (ROCm's `single` naming, e.g. 8
/// MI300X in CPX + NPS4 give 64 devices), or, with `partition_type`, only those of one type
/// (ROCm's `mixed` naming: one resource entry per type, e.g. `amd.com/cpx_nps4`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AmdgpuSettings {
    /// Serve only GPUs whose `<compute>_<memory>` partition type is this (lowercase, e.g.
    /// `cpx_nps4`, `spx_nps1`). GPUs without partition support have no type and are then
    /// left out. Default: every GPU and partition.
    #[serde(default)]
    pub partition_type: Option<String>,
    /// Write a CDI spec (kind `amd.com/gpu`) and name CDI devices in `Allocate` (default true).
    /// Device nodes are sent as device specs either way.
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

impl Default for AmdgpuSettings {
    /// Every GPU, CDI on, the host's /sys and /dev.
    fn default() -> Self {
        AmdgpuSettings {
            partition_type: None,
            cdi: true,
            cdi_dir: default_cdi_dir(),
            dev_root: default_dev_root(),
            sys_root: default_sys_root(),
        }
    }
}

impl AmdgpuSettings {
    /// Checks every field.
    pub fn validate(&self) -> Result<(), SettingsError> {
        if let Some(t) = &self.partition_type {
            let ok = t.split_once('_').is_some_and(|(c, m)| {
                !c.is_empty()
                    && !m.is_empty()
                    && c.chars().all(|ch| ch.is_ascii_lowercase())
                    && m.chars()
                        .all(|ch| ch.is_ascii_lowercase() || ch.is_ascii_digit())
            });
            if !ok {
                return Err(SettingsError::new(
                    "partition_type",
                    format!(
                        "{t:?} must be <compute>_<memory> in lowercase, e.g. cpx_nps4 or spx_nps1"
                    ),
                ));
            }
        }
        check_roots(&self.cdi_dir, &self.dev_root, &self.sys_root)
    }
}
