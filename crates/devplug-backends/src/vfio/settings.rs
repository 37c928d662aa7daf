//! Settings of the `vfio` backend (PCI devices bound to `vfio-pci`, for VMs and DPDK) and of
//! `qat` (Intel QuickAssist virtual functions, the same machinery with Intel's selection and
//! names).

use crate::hostdev::PciMatch;
use crate::settings::{
    check_env_name, check_roots, default_cdi_dir, default_dev_root, default_sys_root, yes,
    SettingsError,
};
use serde::Deserialize;
use std::path::PathBuf;

/// How the container learns the PCI addresses it was given.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VfioEnv {
    /// KubeVirt's convention: `PCI_RESOURCE_<RESOURCE_NAME>` (upper case, `.` and `/` as `_`)
    /// = the addresses, comma-separated.
    #[default]
    PciResource,
    /// One variable per address, numbered from 0: `<env_prefix>0`, `<env_prefix>1`, … (Intel's
    /// QAT plugin: `QAT0`, `QAT1`).
    Numbered,
    /// No variable.
    None,
}

/// Settings of the `vfio` backend.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VfioSettings {
    /// Which PCI devices: vendor, device and/or class, as in `hostdev` (`{vendor: 10de}`).
    /// Only those bound to `vfio-pci` are served; binding is the operator's business.
    pub pci: Vec<PciMatch>,
    /// How the container learns its addresses (default `pci_resource`).
    #[serde(default)]
    pub env: VfioEnv,
    /// With `env: numbered`, the variables' prefix (e.g. `QAT`).
    #[serde(default)]
    pub env_prefix: Option<String>,
    /// Write a CDI spec (kind = the resource name) and name CDI devices in `Allocate` (default
    /// true). Device nodes are sent as device specs either way.
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

impl VfioSettings {
    /// Devices matching `pci`, every other field at its default.
    pub fn new(pci: Vec<PciMatch>) -> Self {
        VfioSettings {
            pci,
            env: VfioEnv::PciResource,
            env_prefix: None,
            cdi: true,
            cdi_dir: default_cdi_dir(),
            dev_root: default_dev_root(),
            sys_root: default_sys_root(),
        }
    }

    /// Checks every field.
    pub fn validate(&self) -> Result<(), SettingsError> {
        if self.pci.is_empty() {
            return Err(SettingsError::new(
                "pci",
                "the list is empty; add the devices to serve, e.g. pci: [{vendor: 10de, class: \"03\"}]",
            ));
        }
        for (i, pci) in self.pci.iter().enumerate() {
            pci.validate(&format!("pci[{i}]"))?;
        }
        match (self.env, &self.env_prefix) {
            (VfioEnv::Numbered, Some(prefix)) => check_env_name("env_prefix", prefix)?,
            (VfioEnv::Numbered, None) => {
                return Err(SettingsError::new(
                    "env_prefix",
                    "env: numbered needs a prefix for the variables, e.g. env_prefix: QAT",
                ))
            }
            (_, Some(_)) => {
                return Err(SettingsError::new(
                    "env_prefix",
                    "only applies to env: numbered; remove it or set env: numbered",
                ))
            }
            (_, None) => {}
        }
        check_roots(&self.cdi_dir, &self.dev_root, &self.sys_root)
    }
}

/// Which QAT virtual functions a resource serves, by the service their physical function
/// runs. Gen4 and later (4xxx, 401xx, 402xx, 420xx, 6xxx) configure services in
/// `qat/cfg_services`; older generations (DH895xCC, C62x, C3xxx, C4xxx, D15xx) serve all of
/// them as `generic`. The names are Intel's plugin's resource names (`qat.intel.com/<service>`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub enum QatService {
    /// Pre-Gen4 VFs, and Gen4 VFs whose services cannot be read.
    #[default]
    #[serde(rename = "generic")]
    Generic,
    /// Symmetric and asymmetric crypto (`sym;asym`).
    #[serde(rename = "cy")]
    Cy,
    /// Compression (`dc`).
    #[serde(rename = "dc")]
    Dc,
    /// Symmetric crypto (`sym`).
    #[serde(rename = "sym")]
    Sym,
    /// Asymmetric crypto (`asym`).
    #[serde(rename = "asym")]
    Asym,
    /// Symmetric crypto and compression (`sym;dc`).
    #[serde(rename = "sym-dc")]
    SymDc,
    /// Asymmetric crypto and compression (`asym;dc`).
    #[serde(rename = "asym-dc")]
    AsymDc,
}

impl QatService {
    /// The name, as in the resource `qat.intel.com/<name>`.
    pub fn name(self) -> &'static str {
        match self {
            QatService::Generic => "generic",
            QatService::Cy => "cy",
            QatService::Dc => "dc",
            QatService::Sym => "sym",
            QatService::Asym => "asym",
            QatService::SymDc => "sym-dc",
            QatService::AsymDc => "asym-dc",
        }
    }

    /// The service of a `cfg_services` value (`sym;asym`, `dc`, `asym;dc`), in any order;
    /// `None` for one no resource serves (`dcc`, `decomp`, three services).
    pub fn from_cfg_services(text: &str) -> Option<QatService> {
        let mut parts: Vec<&str> = text.trim().split(';').map(str::trim).collect();
        parts.sort_unstable();
        match parts.as_slice() {
            ["asym", "sym"] => Some(QatService::Cy),
            ["dc"] => Some(QatService::Dc),
            ["sym"] => Some(QatService::Sym),
            ["asym"] => Some(QatService::Asym),
            ["dc", "sym"] => Some(QatService::SymDc),
            ["asym", "dc"] => Some(QatService::AsymDc),
            _ => None,
        }
    }
}

/// Settings of the `qat` backend.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QatSettings {
    /// Serve the VFs whose physical function runs this service (default `generic`: the
    /// VFs of generations without service configuration).
    #[serde(default)]
    pub service: QatService,
    /// The variables' prefix: `QAT0`, `QAT1`, … hold the VFs' PCI addresses (default `QAT`).
    #[serde(default = "qat_prefix")]
    pub env_prefix: String,
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

impl Default for QatSettings {
    /// Generic VFs, `QAT<n>` variables, CDI on, the host's /sys and /dev.
    fn default() -> Self {
        QatSettings {
            service: QatService::Generic,
            env_prefix: qat_prefix(),
            cdi: true,
            cdi_dir: default_cdi_dir(),
            dev_root: default_dev_root(),
            sys_root: default_sys_root(),
        }
    }
}

impl QatSettings {
    /// Checks every field.
    pub fn validate(&self) -> Result<(), SettingsError> {
        check_env_name("env_prefix", &self.env_prefix)?;
        check_roots(&self.cdi_dir, &self.dev_root, &self.sys_root)
    }
}

fn qat_prefix() -> String {
    "QAT".to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn services_as_intel_names_them() {
        for (text, want) in [
            ("sym;asym", Some(QatService::Cy)),
            ("asym;sym\n", Some(QatService::Cy)),
            ("dc", Some(QatService::Dc)),
            ("dc;sym", Some(QatService::SymDc)),
            ("asym;dc", Some(QatService::AsymDc)),
            ("dcc", None),
            ("asym;sym;dc", None),
        ] {
            assert_eq!(QatService::from_cfg_services(text), want, "{text}");
        }
        assert_eq!(QatService::SymDc.name(), "sym-dc");
    }

    #[test]
    fn errors_name_the_field() {
        let mut s = VfioSettings::new(Vec::new());
        assert_eq!(s.validate().map_err(|e| e.field), Err("pci".to_owned()));
        s.pci.push(PciMatch::default());
        assert_eq!(s.validate().map_err(|e| e.field), Err("pci[0]".to_owned()));
        s.pci[0].vendor = Some("10de".into());
        assert_eq!(s.validate(), Ok(()));
        s.env = VfioEnv::Numbered;
        assert_eq!(
            s.validate().map_err(|e| e.field),
            Err("env_prefix".to_owned())
        );
        s.env_prefix = Some("GPU".into());
        assert_eq!(s.validate(), Ok(()));
        s.env = VfioEnv::PciResource;
        assert_eq!(
            s.validate().map_err(|e| e.field),
            Err("env_prefix".to_owned())
        );
        let q = QatSettings {
            env_prefix: "9QAT".into(),
            ..QatSettings::default()
        };
        assert_eq!(
            q.validate().map_err(|e| e.field),
            Err("env_prefix".to_owned())
        );
    }
}
