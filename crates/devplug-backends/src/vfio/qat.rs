//! Intel QuickAssist (QAT) virtual functions bound to `vfio-pci`, as Intel's QAT plugin
//! serves them in its default (DPDK) mode: one device per VF, `/dev/vfio/<group>` and
//! `/dev/vfio/vfio`, the VFs' PCI addresses in `QAT0`, `QAT1`, …, one resource per service.
//!
//! The VF device ids and generations are those of the kernel's QAT driver
//! (`drivers/crypto/intel/qat`) and Intel's plugin. Gen4 and later VFs take their service from
//! their physical function's `qat/cfg_services` while its `qat/state` is `up` (the kernel's
//! `Documentation/ABI/testing/sysfs-driver-qat`); older generations, and VFs seen inside a VM
//! (no `physfn`), are `generic`. Unlike Intel's plugin, devplug never binds or unbinds a VF
//! (bind them to `vfio-pci` as its `qat-init.sh` does) and reads no debugfs heartbeat.
//!
//! The kernel takes a new `cfg_services` only while the PF is down, with its VFs disabled:
//! the VFs vanish and come back, and the backend rescans on those events.

use super::discover::pci_attributes;
use super::settings::QatService;
use crate::dra_attributes::Attributes;
use crate::sysfs::{read_trimmed, PciDevice};

/// PCI vendor id of Intel.
const VENDOR_INTEL: u32 = 0x8086;

/// VF device ids and the generation each belongs to; `true` where services are configured.
const QAT_VFS: [(u32, &str, bool); 11] = [
    (0x0442, "dh895xcc", false),
    (0x0443, "dh895xcc", false),
    (0x18a1, "c4xxx", false),
    (0x19e3, "c3xxx", false),
    (0x37c9, "c6xx", false),
    (0x6f55, "d15xx", false),
    (0x4941, "4xxx", true),
    (0x4943, "401xx", true),
    (0x4945, "402xx", true),
    (0x4947, "420xx", true),
    (0x4949, "6xxx", true),
];

/// A VF's generation name and whether it has configurable services; `None` for a device that
/// is not a QAT VF.
pub(crate) fn generation(device: &PciDevice) -> Option<(&'static str, bool)> {
    if device.vendor != Some(VENDOR_INTEL) {
        return None;
    }
    let id = device.device?;
    QAT_VFS
        .iter()
        .find(|(vf, _, _)| *vf == id)
        .map(|(_, name, services)| (*name, *services))
}

/// The service a VF serves: its PF's `cfg_services` when the PF is up, else `generic`.
/// `None` for services no resource serves (`dcc`, `decomp`, three at once).
pub(crate) fn service(device: &PciDevice, configurable: bool) -> Option<QatService> {
    if !configurable {
        return Some(QatService::Generic);
    }
    let Ok(pf) = std::fs::canonicalize(device.path.join("physfn")) else {
        return Some(QatService::Generic); // a VF passed into a VM: no PF to ask
    };
    let qat = pf.join("qat");
    if read_trimmed(&qat.join("state")).as_deref() != Some("up") {
        return Some(QatService::Generic);
    }
    match read_trimmed(&qat.join("cfg_services")) {
        Some(text) => QatService::from_cfg_services(&text),
        None => Some(QatService::Generic),
    }
}

/// The selection of the `qat` backend: QAT VFs of `wanted` service.
pub(crate) fn select(device: &PciDevice, wanted: QatService) -> Option<Attributes> {
    let (generation, configurable) = generation(device)?;
    let service = service(device, configurable)?;
    (service == wanted).then(|| {
        pci_attributes(device)
            .string("generation", generation)
            .string("service", service.name())
    })
}
