//! Settings of the `ascend` backend: the environment variable, CDI output, the roots.

use crate::settings::{
    check_env_name, check_roots, default_cdi_dir, default_dev_root, default_sys_root, yes,
    SettingsError,
};
use serde::Deserialize;
use std::path::PathBuf;

/// Settings of the `ascend` backend.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AscendSettings {
    /// The variable that lists the NPUs' ids, comma-separated (default
    /// `ASCEND_VISIBLE_DEVICES`, which Ascend's container runtime and CANN read).
    #[serde(default = "visible_devices")]
    pub env: String,
    /// Write a CDI spec (kind = the resource name) and name CDI devices in `Allocate` (default
    /// true).
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

impl Default for AscendSettings {
    /// `ASCEND_VISIBLE_DEVICES`, CDI on, the host's /sys and /dev.
    fn default() -> Self {
        AscendSettings {
            env: visible_devices(),
            cdi: true,
            cdi_dir: default_cdi_dir(),
            dev_root: default_dev_root(),
            sys_root: default_sys_root(),
        }
    }
}

impl AscendSettings {
    /// Checks every field.
    pub fn validate(&self) -> Result<(), SettingsError> {
        check_env_name("env", &self.env)?;
        check_roots(&self.cdi_dir, &self.dev_root, &self.sys_root)
    }
}

fn visible_devices() -> String {
    "ASCEND_VISIBLE_DEVICES".to_owned()
}
