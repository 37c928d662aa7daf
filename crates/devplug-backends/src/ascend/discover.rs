//! Finding Ascend NPUs: the `/dev/davinci<N>` nodes the Ascend driver makes, one per NPU
//! (`N` is the physical id that `ASCEND_VISIBLE_DEVICES` names), and the nodes every
//! container needs: `/dev/davinci_manager` (without it no NPU works), and `/dev/devmm_svm`
//! and `/dev/hisi_hdc` where the driver made them.
//!
//! PCI identity (for NUMA and DRA attributes) comes from the Huawei PCI device (vendor
//! `0x19e5`) whose `dev_id` file, which the Ascend driver adds to its PCI devices, holds `N`.
//! That file is what Huawei's own reset scripts read; devplug has not seen it on hardware, so
//! an NPU without it is served all the same, with no NUMA node.

use crate::dra_attributes::Attributes;
use crate::node_backend::{Found, Inventory};
use crate::sysfs::{pci_devices, read_trimmed};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// PCI vendor id of Huawei.
const VENDOR_HUAWEI: u32 = 0x19e5;

/// Nodes every container with an NPU gets: (name, required).
const SHARED: [(&str, bool); 3] = [
    ("davinci_manager", true),
    ("devmm_svm", false),
    ("hisi_hdc", false),
];

/// Known Ascend PCI device ids and their chip names.
const CHIPS: [(u32, &str); 5] = [
    (0xd100, "Ascend310"),
    (0xd500, "Ascend310P"),
    (0xd801, "Ascend910"),
    (0xd802, "Ascend910B"),
    (0xd803, "Ascend910_93"),
];

/// `davinci<N>` → N (not `davinci_manager`).
fn npu_number(name: &str) -> Option<u32> {
    let digits = name.strip_prefix("davinci")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Scans /dev and sysfs.
pub(crate) fn scan(sys: &Path, dev: &Path) -> Inventory {
    let mut numbers: Vec<u32> = std::fs::read_dir(dev)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| npu_number(e.file_name().to_str()?))
        .collect();
    numbers.sort_unstable();
    let mut shared_nodes = Vec::new();
    let mut shared_problem = None;
    for (name, required) in SHARED {
        if dev.join(name).exists() {
            shared_nodes.push(PathBuf::from(name));
        } else if required {
            shared_problem = Some(format!(
                "/dev/{name} missing (is the Ascend driver loaded?)"
            ));
        }
    }
    // The NPUs' PCI devices, by the id in their `dev_id` file.
    let mut pci: BTreeMap<u32, crate::sysfs::PciDevice> = BTreeMap::new();
    for device in pci_devices(sys) {
        if device.vendor != Some(VENDOR_HUAWEI) {
            continue;
        }
        let Some(n) = read_trimmed(&device.path.join("dev_id")).and_then(|t| t.parse().ok()) else {
            continue;
        };
        pci.insert(n, device);
    }
    let found = numbers
        .into_iter()
        .map(|n| {
            let id = format!("davinci{n}");
            let mut attributes = Attributes::default().int("index", i64::from(n));
            let mut numa = None;
            if let Some(device) = pci.get(&n) {
                numa = device.numa;
                let chip = CHIPS
                    .iter()
                    .find(|(d, _)| Some(*d) == device.device)
                    .map(|(_, name)| *name);
                attributes = attributes
                    .hex_id("deviceID", device.device)
                    .string_opt("chip", chip)
                    .pci(&device.address, Some(&device.path));
            }
            Found {
                physical: id.clone(),
                nodes: vec![PathBuf::from(&id)],
                id,
                env_values: vec![n.to_string()],
                numa,
                problem: shared_problem.clone(),
                attributes: attributes.build(),
            }
        })
        .collect();
    Inventory {
        found,
        shared_nodes,
        watch_dirs: BTreeSet::from([dev.to_owned(), sys.join("bus/pci/devices")]),
        absent: BTreeMap::new(),
        present: BTreeSet::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_numbered_nodes_are_npus() {
        assert_eq!(npu_number("davinci0"), Some(0));
        assert_eq!(npu_number("davinci15"), Some(15));
        assert_eq!(npu_number("davinci_manager"), None);
        assert_eq!(npu_number("davinci"), None);
        assert_eq!(npu_number("vdavinci1"), None);
    }
}
