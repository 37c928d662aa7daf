//! PCI passthrough (config key `vfio`) and Intel QAT (config key `qat`): PCI devices bound to
//! `vfio-pci`, one device per IOMMU group, for VMs (KubeVirt) and DPDK workloads.
//!
//! - `settings`: the selection (`pci:` as in `hostdev`), the environment convention, CDI, the
//!   roots; QAT's service.
//! - `discover`: IOMMU groups of the selected devices, their nodes, their viability.
//! - `qat`: which VFs are QAT and which service each runs.
//!
//! A container gets `/dev/vfio/<group>` for each device and `/dev/vfio/vfio` once, the PCI
//! addresses of every function of its groups in `PCI_RESOURCE_<RESOURCE_NAME>` (KubeVirt's
//! convention) or in numbered variables (`QAT0`, `QAT1`, … as Intel's QAT plugin does), and
//! CDI names of kind = the resource name. SR-IOV virtual functions come and go when
//! `sriov_numvfs` changes; the backend follows by events (on a real kernel, the
//! `/dev/vfio/<group>` node the kernel makes when a VF is bound to `vfio-pci`).

mod discover;
mod qat;
pub mod settings;

pub use settings::{QatService, QatSettings, VfioEnv, VfioSettings};

use crate::node_backend::{pci_resource_env, scan_result, EnvNaming, Flavor, NodeBackend};
use crate::settings::SettingsError;
use crate::sysfs_watch::Words;
use discover::pci_attributes;

/// Starts the `vfio` backend for `resource`. Must be called inside a tokio runtime.
pub fn start(resource: &str, settings: &VfioSettings) -> Result<NodeBackend, SettingsError> {
    settings.validate()?;
    let env = match settings.env {
        VfioEnv::PciResource => EnvNaming::List(pci_resource_env(resource)),
        VfioEnv::Numbered => EnvNaming::Numbered(settings.env_prefix.clone().unwrap_or_default()),
        VfioEnv::None => EnvNaming::Nothing,
    };
    let flavor = Flavor {
        what: "vfio",
        words: Words {
            noun: "PCI device",
            gone: "is gone from sysfs",
        },
        env,
        dev_root: settings.dev_root.clone(),
        cdi_dir: settings.cdi.then(|| settings.cdi_dir.clone()),
    };
    let s = settings.clone();
    NodeBackend::start(resource, flavor, move |kind| {
        let select = |d: &crate::sysfs::PciDevice| {
            let (vendor, device, class) = (
                d.vendor.map(|v| format!("{v:04x}")),
                d.device.map(|v| format!("{v:04x}")),
                d.class.map(|v| format!("{v:06x}")),
            );
            s.pci
                .iter()
                .any(|m| m.matches(vendor.as_deref(), device.as_deref(), class.as_deref()))
                .then(|| pci_attributes(d))
        };
        let inventory = discover::scan(&s.sys_root, &s.dev_root, &select);
        scan_result(inventory, &s.dev_root, kind)
    })
}

/// Starts the `qat` backend for `resource` (Intel names it `qat.intel.com/<service>`). Must be
/// called inside a tokio runtime.
pub fn start_qat(resource: &str, settings: &QatSettings) -> Result<NodeBackend, SettingsError> {
    settings.validate()?;
    let flavor = Flavor {
        what: "qat",
        words: Words {
            noun: "QAT VF",
            gone: "is gone from sysfs",
        },
        env: EnvNaming::Numbered(settings.env_prefix.clone()),
        dev_root: settings.dev_root.clone(),
        cdi_dir: settings.cdi.then(|| settings.cdi_dir.clone()),
    };
    let s = settings.clone();
    NodeBackend::start(resource, flavor, move |kind| {
        let select = |d: &crate::sysfs::PciDevice| qat::select(d, s.service);
        let inventory = discover::scan(&s.sys_root, &s.dev_root, &select);
        scan_result(inventory, &s.dev_root, kind)
    })
}
