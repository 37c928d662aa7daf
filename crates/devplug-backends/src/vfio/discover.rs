//! Finding PCI devices bound to `vfio-pci`, one device per IOMMU group, as the kernel's VFIO
//! documentation (`Documentation/driver-api/vfio.rst`) describes them: the group is the unit
//! of ownership, its node is `/dev/vfio/<group>` (`/dev/vfio/noiommu-<group>` for a group the
//! kernel made without an IOMMU), the container node `/dev/vfio/vfio` is shared, and a group
//! can be opened only when every device in it is bound to `vfio-pci`, `pci-stub` or no
//! driver (PCI bridges may keep theirs).
//!
//! A selected device bound to another driver is not taken: binding is the operator's business.
//! One that was served before and is now bound elsewhere stays listed, Unhealthy, saying so.

use crate::dra_attributes::Attributes;
use crate::node_backend::{Found, Inventory};
use crate::sysfs::{link_name, pci_device, pci_devices, read_trimmed, PciDevice};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The driver a device must be bound to.
pub(crate) const VFIO_PCI: &str = "vfio-pci";

/// PCI class of a PCI-to-PCI bridge (`0x0604xx`).
const PCI_CLASS_BRIDGE: u32 = 0x0604;

/// What a selection says about a device it takes: its attributes so far.
pub(crate) type Select<'a> = &'a dyn Fn(&PciDevice) -> Option<Attributes>;

/// The device's IOMMU group number (its `iommu_group` link).
fn iommu_group(device: &PciDevice) -> Option<u32> {
    link_name(&device.path.join("iommu_group"))?.parse().ok()
}

/// The group's node under /dev: `vfio/<N>`, or `vfio/noiommu-<N>` for a no-IOMMU group.
fn group_node(sys: &Path, group: u32) -> PathBuf {
    let name = read_trimmed(&sys.join(format!("kernel/iommu_groups/{group}/name")));
    if name.as_deref() == Some("vfio-noiommu") {
        PathBuf::from(format!("vfio/noiommu-{group}"))
    } else {
        PathBuf::from(format!("vfio/{group}"))
    }
}

/// Every device of a group, by address.
fn group_members(sys: &Path, group: u32) -> Vec<PciDevice> {
    let dir = sys.join(format!("kernel/iommu_groups/{group}/devices"));
    let mut members: Vec<PciDevice> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let address = e.file_name().into_string().ok()?;
            let path = std::fs::canonicalize(e.path()).ok()?;
            Some(pci_device(sys, &address, &path))
        })
        .collect();
    members.sort_by(|a, b| a.address.cmp(&b.address));
    members
}

/// The folders whose changes can change what a scan finds.
pub(crate) fn watch_dirs(sys: &Path, dev: &Path) -> BTreeSet<PathBuf> {
    [
        dev.to_owned(),
        dev.join("vfio"),
        sys.join("bus/pci/devices"),
        sys.join("bus/pci/drivers"),
        sys.join("bus/pci/drivers").join(VFIO_PCI),
        sys.join("kernel/iommu_groups"),
    ]
    .into_iter()
    .collect()
}

/// Scans sysfs and /dev for the devices `select` takes.
pub(crate) fn scan(sys: &Path, dev: &Path, select: Select<'_>) -> Inventory {
    let mut inventory = Inventory {
        shared_nodes: vec![PathBuf::from("vfio/vfio")],
        watch_dirs: watch_dirs(sys, dev),
        ..Inventory::default()
    };
    let mut groups: BTreeMap<u32, Vec<(PciDevice, Attributes)>> = BTreeMap::new();
    for device in pci_devices(sys) {
        if device.path.join("sriov_totalvfs").exists() {
            inventory.present.insert(device.address.clone());
        }
        let Some(attributes) = select(&device) else {
            continue;
        };
        if device.driver.as_deref() != Some(VFIO_PCI) {
            let bound = match &device.driver {
                Some(driver) => format!("is bound to {driver}, not {VFIO_PCI}"),
                None => format!("is bound to no driver, not {VFIO_PCI}"),
            };
            inventory.absent.insert(device.address.clone(), bound);
            continue;
        }
        match iommu_group(&device) {
            Some(group) => groups.entry(group).or_default().push((device, attributes)),
            None => inventory.found.push(Found {
                id: device.address.clone(),
                physical: physical(&device),
                nodes: Vec::new(),
                env_values: vec![device.address.clone()],
                numa: device.numa,
                problem: Some(
                    "has no IOMMU group: turn the IOMMU on (intel_iommu=on or amd_iommu=on on the \
                     kernel command line)"
                        .to_owned(),
                ),
                attributes: attributes.build(),
            }),
        }
    }
    let container_node = dev.join("vfio/vfio").exists();
    for (group, mut selected) in groups {
        let (first, attributes) = selected.swap_remove(0);
        let node = group_node(sys, group);
        let mut problems = Vec::new();
        if !dev.join(&node).exists() {
            problems.push(format!("/dev/{} missing", node.display()));
        }
        if !container_node {
            problems.push("/dev/vfio/vfio missing (is the vfio module loaded?)".to_owned());
        }
        let mut addresses = Vec::new();
        for member in group_members(sys, group) {
            match member.driver.as_deref() {
                Some(VFIO_PCI) => addresses.push(member.address.clone()),
                None | Some("pci-stub") => {}
                Some(_) if member.class.is_some_and(|c| c >> 8 == PCI_CLASS_BRIDGE) => {}
                Some(driver) => {
                    // Its leaving that driver opens the group. (Fake trees report it; on a
                    // real kernel sysfs tells inotify nothing, and the next /dev event does.)
                    let drivers = sys.join("bus/pci/drivers").join(driver);
                    inventory.watch_dirs.insert(drivers);
                    problems.push(format!(
                    "IOMMU group {group} also holds {}, bound to {driver}: the group opens only \
                     when every device in it is bound to {VFIO_PCI}, pci-stub or no driver",
                    member.address
                    ))
                }
            }
        }
        if addresses.is_empty() {
            // A sysfs without the group's device list: the selected functions.
            addresses.push(first.address.clone());
            addresses.extend(selected.iter().map(|(d, _)| d.address.clone()));
        }
        inventory.found.push(Found {
            id: first.address.clone(),
            physical: physical(&first),
            nodes: vec![node],
            env_values: addresses,
            numa: first.numa,
            problem: (!problems.is_empty()).then(|| problems.join("; ")),
            attributes: attributes.int("iommuGroup", i64::from(group)).build(),
        });
    }
    inventory
}

/// The physical device: a VF's PF, else the device itself.
fn physical(device: &PciDevice) -> String {
    device
        .physfn
        .clone()
        .unwrap_or_else(|| device.address.clone())
}

/// The attributes every selected device has: its ids and PCI place.
pub(crate) fn pci_attributes(device: &PciDevice) -> Attributes {
    Attributes::default()
        .hex_id("vendorID", device.vendor)
        .hex_id("deviceID", device.device)
        .pci(&device.address, Some(&device.path))
}
