//! Settings of the `fpga` backend: which ports a resource serves (by the AFU they carry and
//! the interface of their region), the environment variable, CDI output, the roots.

use crate::settings::{
    check_env_name, check_roots, default_cdi_dir, default_dev_root, default_sys_root, yes,
    SettingsError,
};
use serde::Deserialize;
use std::path::PathBuf;

/// Settings of the `fpga` backend.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FpgaSettings {
    /// Serve the ports whose accelerator function (AFU) has this id: the port's `afu_id`, 32
    /// hex digits (`-` and case ignored), e.g. `d8424dc4a4a3c413f89e433683f9040b`.
    #[serde(default)]
    pub afu_id: Option<String>,
    /// Serve the ports of regions with this interface id: the FME region's `compat_id`, 32 hex
    /// digits. Alone, every port of such a region, whatever it carries.
    #[serde(default)]
    pub interface_id: Option<String>,
    /// If set, this variable lists the allocated ports, comma-separated (`dfl-port.0`).
    #[serde(default)]
    pub env: Option<String>,
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

impl FpgaSettings {
    /// Ports carrying `afu_id`, every other field at its default.
    pub fn afu(afu_id: &str) -> Self {
        FpgaSettings {
            afu_id: Some(afu_id.to_owned()),
            interface_id: None,
            env: None,
            cdi: true,
            cdi_dir: default_cdi_dir(),
            dev_root: default_dev_root(),
            sys_root: default_sys_root(),
        }
    }

    /// Checks every field.
    pub fn validate(&self) -> Result<(), SettingsError> {
        if self.afu_id.is_none() && self.interface_id.is_none() {
            return Err(SettingsError::new(
                "afu_id",
                "set afu_id (the AFU the ports carry), interface_id (the regions' interface), \
                 or both",
            ));
        }
        for (field, value) in [
            ("afu_id", &self.afu_id),
            ("interface_id", &self.interface_id),
        ] {
            if let Some(value) = value {
                let id = canonical_id(value);
                if id.len() != 32 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(SettingsError::new(
                        field,
                        format!(
                            "{value:?} must be 32 hex digits (a UUID, dashes allowed), as sysfs \
                             shows it"
                        ),
                    ));
                }
            }
        }
        if let Some(env) = &self.env {
            check_env_name("env", env)?;
        }
        check_roots(&self.cdi_dir, &self.dev_root, &self.sys_root)
    }
}

/// An AFU or interface id as sysfs writes it: lower case, no dashes.
pub(crate) fn canonical_id(value: &str) -> String {
    value
        .trim()
        .chars()
        .filter(|c| *c != '-')
        .map(|c| c.to_ascii_lowercase())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_checked_and_canonical() {
        let mut s = FpgaSettings::afu("D8424DC4-A4A3-C413-F89E-433683F9040B");
        assert_eq!(s.validate(), Ok(()));
        assert_eq!(
            canonical_id(s.afu_id.as_deref().unwrap_or_default()),
            "d8424dc4a4a3c413f89e433683f9040b"
        );
        s.interface_id = Some("ce4896".into());
        assert_eq!(
            s.validate().map_err(|e| e.field),
            Err("interface_id".to_owned())
        );
        s.interface_id = None;
        s.afu_id = None;
        assert_eq!(s.validate().map_err(|e| e.field), Err("afu_id".to_owned()));
    }
}
