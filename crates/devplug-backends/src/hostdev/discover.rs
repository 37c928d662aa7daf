//! Finding host devices: glob patterns under the dev root, and USB and PCI devices in sysfs with
//! the device nodes they own (from the `DEVNAME=` lines of their `uevent` files, as udev maps
//! them), their VFIO group node and their NUMA node. Reads only files; needs no root.

use super::settings::{normalize_hex, GroupSettings, HostdevSettings, PciMatch, UsbMatch};
use crate::dra_attributes::Attributes;
use crate::sysfs::{self, parse_hex, read_trimmed};
use devplug::dra::DeviceAttributes;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// One physical device: what containers get when they are given it (or a share of it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Physical {
    /// Id without a share suffix.
    pub(crate) id: String,
    /// Which group found it.
    pub(crate) group: usize,
    /// Device nodes, relative to the dev root (`ttyUSB0`, `dri/card0`).
    pub(crate) nodes: Vec<PathBuf>,
    /// NUMA node, from sysfs.
    pub(crate) numa: Option<i64>,
    /// Why it cannot be used right now (it is then reported unhealthy).
    pub(crate) problem: Option<String>,
    /// DRA attributes ([`crate::dra_attributes`]).
    pub(crate) attributes: Option<Box<DeviceAttributes>>,
}

/// Everything found in one scan, and the folders whose changes could change it.
#[derive(Debug, Default)]
pub(crate) struct Discovery {
    pub(crate) devices: Vec<Physical>,
    pub(crate) watch_dirs: BTreeSet<PathBuf>,
}

/// Scans for every group's devices.
pub(crate) fn discover(settings: &HostdevSettings) -> Discovery {
    let mut found = Discovery::default();
    found.watch_dirs.insert(settings.dev_root.clone());
    for (index, group) in settings.groups.iter().enumerate() {
        if !group.paths.is_empty() {
            by_paths(settings, index, group, &mut found);
        } else if !group.usb.is_empty() {
            by_usb(settings, index, group, &group.usb, &mut found);
        } else {
            by_pci(settings, index, group, &group.pci, &mut found);
        }
    }
    for device in &found.devices {
        for node in &device.nodes {
            if let Some(parent) = settings.dev_root.join(node).parent() {
                found.watch_dirs.insert(parent.to_owned());
            }
        }
    }
    found
}

fn is_glob(pattern: &str) -> bool {
    pattern.contains(['*', '?', '['])
}

fn node_id(group: &GroupSettings, rel: &Path) -> String {
    let base = rel.display().to_string().replace('/', "_");
    match &group.name {
        Some(name) => format!("{name}-{base}"),
        None => base,
    }
}

fn by_paths(
    settings: &HostdevSettings,
    index: usize,
    group: &GroupSettings,
    found: &mut Discovery,
) {
    let mut matched: Vec<PathBuf> = Vec::new();
    let mut missing: Vec<PathBuf> = Vec::new();
    for pattern in &group.paths {
        let rel = pattern.trim_start_matches("/dev/");
        // Watch the deepest folder with no glob in its path: new matches appear there.
        let literal: PathBuf = Path::new(rel)
            .components()
            .take_while(|c| !is_glob(&c.as_os_str().to_string_lossy()))
            .collect();
        let literal_dir = if is_glob(rel) {
            literal
        } else {
            literal.parent().map(Path::to_owned).unwrap_or_default()
        };
        found.watch_dirs.insert(settings.dev_root.join(literal_dir));
        let full = settings.dev_root.join(rel);
        if is_glob(rel) {
            let Ok(paths) = glob::glob(&full.to_string_lossy()) else {
                continue;
            };
            for path in paths.flatten() {
                if let Ok(rel) = path.strip_prefix(&settings.dev_root) {
                    if !path.is_dir() {
                        matched.push(rel.to_owned());
                    }
                }
            }
        } else if full.exists() {
            matched.push(PathBuf::from(rel));
        } else {
            missing.push(PathBuf::from(rel));
        }
    }
    matched.sort();
    matched.dedup();
    let missing_reason = |nodes: &[PathBuf]| {
        let names: Vec<String> = nodes
            .iter()
            .map(|n| format!("/dev/{}", n.display()))
            .collect();
        format!("{} missing", names.join(", "))
    };
    if group.bundle {
        if matched.is_empty() && missing.is_empty() {
            return;
        }
        let first = group.paths[0]
            .trim_start_matches("/dev/")
            .replace(['*', '?', '[', ']'], "");
        let id = match &group.name {
            Some(name) => name.clone(),
            None => first.trim_end_matches(['/', '_', '-']).replace('/', "_"),
        };
        let problem = (!missing.is_empty()).then(|| missing_reason(&missing));
        let mut nodes = matched;
        nodes.extend(missing);
        let attributes = path_attributes(&nodes).build();
        found.devices.push(Physical {
            id,
            group: index,
            nodes,
            numa: None,
            problem,
            attributes,
        });
        return;
    }
    for rel in matched {
        let id = node_id(group, &rel);
        let nodes = vec![rel];
        found.devices.push(Physical {
            id,
            group: index,
            attributes: path_attributes(&nodes).build(),
            nodes,
            numa: None,
            problem: None,
        });
    }
    for rel in missing {
        let problem = Some(missing_reason(std::slice::from_ref(&rel)));
        let id = node_id(group, &rel);
        let nodes = vec![rel];
        found.devices.push(Physical {
            id,
            group: index,
            attributes: path_attributes(&nodes).build(),
            nodes,
            numa: None,
            problem,
        });
    }
}

/// Devices of one sysfs bus (`usb`, `pci`): (name, canonical path), sorted by name; their
/// folder is watched.
fn bus_devices(
    settings: &HostdevSettings,
    bus: &str,
    found: &mut Discovery,
) -> Vec<(String, PathBuf)> {
    let dir = settings.sys_root.join("bus").join(bus).join("devices");
    found.watch_dirs.insert(dir);
    sysfs::bus_devices(&settings.sys_root, bus)
}

fn by_usb(
    settings: &HostdevSettings,
    index: usize,
    group: &GroupSettings,
    matches: &[UsbMatch],
    found: &mut Discovery,
) {
    for (name, path) in bus_devices(settings, "usb", found) {
        if name.contains(':') {
            continue; // an interface, not a device
        }
        let (Some(vendor), Some(product)) = (
            read_trimmed(&path.join("idVendor")),
            read_trimmed(&path.join("idProduct")),
        ) else {
            continue;
        };
        let (vendor, product) = (normalize_hex(&vendor), normalize_hex(&product));
        let wanted = matches.iter().any(|m| {
            normalize_hex(&m.vendor) == vendor
                && m.product
                    .as_deref()
                    .is_none_or(|p| normalize_hex(p) == product)
        });
        if wanted {
            let ids = Attributes::default()
                .string("vendorID", &vendor)
                .string("productID", &product);
            push_sysfs_device(
                settings,
                index,
                group,
                format!("usb-{name}"),
                &path,
                ids,
                found,
            );
        }
    }
}

fn by_pci(
    settings: &HostdevSettings,
    index: usize,
    group: &GroupSettings,
    matches: &[PciMatch],
    found: &mut Discovery,
) {
    for (address, path) in bus_devices(settings, "pci", found) {
        let read = |file: &str| read_trimmed(&path.join(file)).map(|v| normalize_hex(&v));
        let (vendor, device, class) = (read("vendor"), read("device"), read("class"));
        let wanted = matches
            .iter()
            .any(|m| m.matches(vendor.as_deref(), device.as_deref(), class.as_deref()));
        if wanted {
            let id = |v: &Option<String>| v.as_deref().and_then(parse_hex);
            let ids = Attributes::default()
                .hex_id("vendorID", id(&vendor))
                .hex_id("deviceID", id(&device))
                .pci(&address, Some(&path));
            push_sysfs_device(
                settings,
                index,
                group,
                format!("pci-{address}"),
                &path,
                ids,
                found,
            );
        }
    }
}

fn push_sysfs_device(
    settings: &HostdevSettings,
    index: usize,
    group: &GroupSettings,
    base: String,
    path: &Path,
    ids: Attributes,
    found: &mut Discovery,
) {
    let mut nodes = BTreeSet::new();
    collect_devnames(path, 0, &mut nodes);
    // A device bound to vfio-pci is used through its IOMMU group's node.
    if let Ok(group_link) = std::fs::read_link(path.join("iommu_group")) {
        if let Some(n) = group_link.file_name() {
            let vfio = Path::new("vfio").join(n);
            if settings.dev_root.join(&vfio).exists() {
                nodes.insert(vfio);
            }
        }
    }
    let nodes: Vec<PathBuf> = nodes
        .into_iter()
        .filter(|n| settings.dev_root.join(n).exists())
        .collect();
    let problem = nodes
        .is_empty()
        .then(|| "no device node found for it under /dev".to_owned());
    let id = match &group.name {
        Some(name) => format!("{name}-{base}"),
        None => base,
    };
    let numa = sysfs::numa_node(&settings.sys_root, path);
    let attributes = path_attributes_to(ids, &nodes).build();
    found.devices.push(Physical {
        id,
        group: index,
        nodes,
        numa,
        problem,
        attributes,
    });
}

/// `path`: the first device node as a container sees it (`/dev/ttyUSB0`).
fn path_attributes(nodes: &[PathBuf]) -> Attributes {
    path_attributes_to(Attributes::default(), nodes)
}

fn path_attributes_to(attributes: Attributes, nodes: &[PathBuf]) -> Attributes {
    let first = nodes
        .first()
        .map(|n| Path::new("/dev").join(n).display().to_string());
    attributes.string_opt("path", first.as_deref())
}

/// Collects `DEVNAME=` of every `uevent` below `dir`, not following symlinks (sysfs is full of
/// loops through them).
fn collect_devnames(dir: &Path, depth: usize, out: &mut BTreeSet<PathBuf>) {
    if depth > 8 {
        return;
    }
    if let Ok(uevent) = std::fs::read_to_string(dir.join("uevent")) {
        for line in uevent.lines() {
            if let Some(name) = line.strip_prefix("DEVNAME=") {
                out.insert(PathBuf::from(name.trim_start_matches("/dev/")));
            }
        }
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            collect_devnames(&entry.path(), depth + 1, out);
        }
    }
}
