//! Reading PCI devices from sysfs, shared by `hostdev`, `amdgpu` and `intel-gpu`: vendor,
//! device and class ids, the NUMA node, the bound driver (the `driver` symlink), SR-IOV state,
//! and the DRM card and render nodes a device owns (its `drm/` folder). Every reader takes the
//! sysfs root as a path, so tests point it at a fake tree. Reads only files; needs no root.

use devplug::{ContainerEdits, DeviceNode};
use std::path::{Path, PathBuf};

/// PCI base class of display controllers (`0x03xxxx`: VGA, 3D, other).
pub(crate) const PCI_CLASS_DISPLAY: u32 = 0x03;

/// A file's contents without surrounding white space.
pub(crate) fn read_trimmed(path: &Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_owned())
}

/// A hex number such as `0x1002` (with or without the `0x`).
pub(crate) fn parse_hex(text: &str) -> Option<u32> {
    let t = text.trim();
    let t = t
        .strip_prefix("0x")
        .or_else(|| t.strip_prefix("0X"))
        .unwrap_or(t);
    u32::from_str_radix(t, 16).ok()
}

/// The file name of a symlink's target (`driver` → `amdgpu`).
pub(crate) fn link_name(path: &Path) -> Option<String> {
    let target = std::fs::read_link(path).ok()?;
    target.file_name()?.to_str().map(str::to_owned)
}

/// Devices of one sysfs bus (`usb`, `pci`) as (name, canonical path), sorted by name. The
/// folder `<sys>/bus/<bus>/devices` holds one symlink per device.
pub(crate) fn bus_devices(sys_root: &Path, bus: &str) -> Vec<(String, PathBuf)> {
    let dir = sys_root.join("bus").join(bus).join("devices");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut out: Vec<(String, PathBuf)> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let path = std::fs::canonicalize(e.path()).ok()?;
            Some((name, path))
        })
        .collect();
    out.sort();
    out
}

/// The NUMA node of the device at `path` or of its nearest ancestor below `sys_root` that has
/// one (USB devices sit below their controller's PCI device). `-1` (unknown) gives `None`.
pub(crate) fn numa_node(sys_root: &Path, path: &Path) -> Option<i64> {
    let root = std::fs::canonicalize(sys_root).ok()?;
    path.ancestors()
        .take_while(|p| p.starts_with(&root) && *p != root)
        .find_map(|p| read_trimmed(&p.join("numa_node")))
        .and_then(|v| v.parse::<i64>().ok())
        .filter(|n| *n >= 0)
}

/// The DRM nodes a device owns, as names under `/dev/dri` (`card0`, `renderD128`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct DrmNodes {
    /// The primary node, `card<N>`.
    pub(crate) card: Option<String>,
    /// The render node, `renderD<M>`.
    pub(crate) render: Option<String>,
}

impl DrmNodes {
    /// The nodes relative to the dev root (`dri/card0`, `dri/renderD128`), card first.
    pub(crate) fn dev_paths(&self) -> Vec<PathBuf> {
        [&self.card, &self.render]
            .into_iter()
            .flatten()
            .map(|n| Path::new("dri").join(n))
            .collect()
    }

    /// The render node's minor (`renderD128` → 128), which KFD's topology names.
    pub(crate) fn render_minor(&self) -> Option<u32> {
        self.render
            .as_deref()?
            .strip_prefix("renderD")?
            .parse()
            .ok()
    }
}

/// Reads `<device>/drm/`: the lowest-numbered `card<N>` and `renderD<M>` (a device has one of
/// each; `controlD*` is legacy and skipped).
pub(crate) fn drm_nodes(device: &Path) -> DrmNodes {
    let mut nodes = DrmNodes::default();
    let Ok(entries) = std::fs::read_dir(device.join("drm")) else {
        return nodes;
    };
    let mut cards: Vec<(u32, String)> = Vec::new();
    let mut renders: Vec<(u32, String)> = Vec::new();
    for entry in entries.flatten() {
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        if let Some(n) = name.strip_prefix("card").and_then(|n| n.parse().ok()) {
            cards.push((n, name));
        } else if let Some(n) = name.strip_prefix("renderD").and_then(|n| n.parse().ok()) {
            renders.push((n, name));
        }
    }
    cards.sort();
    renders.sort();
    nodes.card = cards.into_iter().next().map(|c| c.1);
    nodes.render = renders.into_iter().next().map(|r| r.1);
    nodes
}

/// One PCI device as sysfs shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PciDevice {
    /// The address, e.g. `0000:0c:00.0`.
    pub(crate) address: String,
    /// Its folder in sysfs (canonical).
    pub(crate) path: PathBuf,
    /// Vendor id (`0x1002` AMD, `0x8086` Intel, `0x10de` NVIDIA).
    pub(crate) vendor: Option<u32>,
    /// Device id.
    pub(crate) device: Option<u32>,
    /// Class code, 24 bits (`0x030000` VGA, `0x038000` display other).
    pub(crate) class: Option<u32>,
    /// NUMA node; `None` if unknown (`-1`).
    pub(crate) numa: Option<i64>,
    /// The bound driver (`amdgpu`, `i915`, `xe`, `vfio-pci`); `None` when unbound.
    pub(crate) driver: Option<String>,
    /// Number of SR-IOV virtual functions enabled (0 if none or not capable).
    pub(crate) sriov_numvfs: u32,
    /// For a virtual function: its physical function's address.
    pub(crate) physfn: Option<String>,
    /// Its DRM nodes, if a DRM driver is bound.
    pub(crate) drm: DrmNodes,
}

impl PciDevice {
    /// True for a display controller (base class `0x03`).
    pub(crate) fn is_display(&self) -> bool {
        self.class.is_some_and(|c| c >> 16 == PCI_CLASS_DISPLAY)
    }
}

/// Reads the PCI device whose sysfs folder is `path` (canonical), named `address`.
pub(crate) fn pci_device(sys_root: &Path, address: &str, path: &Path) -> PciDevice {
    let hex = |file: &str| read_trimmed(&path.join(file)).and_then(|v| parse_hex(&v));
    PciDevice {
        address: address.to_owned(),
        path: path.to_owned(),
        vendor: hex("vendor"),
        device: hex("device"),
        class: hex("class"),
        numa: numa_node(sys_root, path),
        driver: link_name(&path.join("driver")),
        sriov_numvfs: read_trimmed(&path.join("sriov_numvfs"))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
        physfn: link_name(&path.join("physfn")),
        drm: drm_nodes(path),
    }
}

/// Every PCI device under `<sys>/bus/pci/devices`, sorted by address.
pub(crate) fn pci_devices(sys_root: &Path) -> Vec<PciDevice> {
    bus_devices(sys_root, "pci")
        .into_iter()
        .map(|(address, path)| pci_device(sys_root, &address, &path))
        .collect()
}

/// A device spec (`rw`) for a node under the dev root (`dri/card0`), at the same path under
/// /dev in the container.
pub(crate) fn dev_node(dev_root: &Path, rel: &Path) -> DeviceNode {
    DeviceNode {
        host_path: dev_root.join(rel).display().to_string(),
        container_path: Path::new("/dev").join(rel).display().to_string(),
        permissions: "rw".to_owned(),
    }
}

/// The edits that give a container these nodes.
pub(crate) fn node_edits(dev_root: &Path, nodes: &[PathBuf]) -> ContainerEdits {
    ContainerEdits {
        devices: nodes.iter().map(|n| dev_node(dev_root, n)).collect(),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn reads_a_pci_gpu_with_driver_numa_and_drm_nodes() {
        let tmp = tempfile::tempdir().unwrap();
        let sys = tmp.path().join("sys");
        let dev = sys.join("devices/pci0000:00/0000:00:01.0/0000:0c:00.0");
        for (f, v) in [
            ("vendor", "0x1002\n"),
            ("device", "0x74a1\n"),
            ("class", "0x038000\n"),
            ("sriov_numvfs", "0\n"),
        ] {
            std::fs::create_dir_all(&dev).unwrap();
            std::fs::write(dev.join(f), v).unwrap();
        }
        std::fs::write(sys.join("devices/pci0000:00/numa_node"), "1\n").unwrap();
        for n in ["card3", "card1", "renderD129", "controlD65"] {
            std::fs::create_dir_all(dev.join("drm").join(n)).unwrap();
        }
        std::fs::create_dir_all(sys.join("bus/pci/drivers/amdgpu")).unwrap();
        symlink("../../../../bus/pci/drivers/amdgpu", dev.join("driver")).unwrap();
        std::fs::create_dir_all(sys.join("bus/pci/devices")).unwrap();
        symlink(
            "../../../devices/pci0000:00/0000:00:01.0/0000:0c:00.0",
            sys.join("bus/pci/devices/0000:0c:00.0"),
        )
        .unwrap();
        let all = pci_devices(&sys);
        assert_eq!(all.len(), 1);
        let gpu = &all[0];
        assert_eq!(gpu.address, "0000:0c:00.0");
        assert_eq!(
            (gpu.vendor, gpu.device, gpu.class),
            (Some(0x1002), Some(0x74a1), Some(0x038000))
        );
        assert!(gpu.is_display());
        assert_eq!(gpu.numa, Some(1), "inherited from the parent bridge");
        assert_eq!(gpu.driver.as_deref(), Some("amdgpu"));
        assert_eq!(gpu.drm.card.as_deref(), Some("card1"), "lowest card");
        assert_eq!(gpu.drm.render_minor(), Some(129));
        assert_eq!(
            gpu.drm.dev_paths(),
            [PathBuf::from("dri/card1"), PathBuf::from("dri/renderD129")]
        );
        std::fs::write(dev.join("numa_node"), "-1\n").unwrap();
        assert_eq!(
            pci_devices(&sys)[0].numa,
            None,
            "-1 is unknown, and the device's own file wins"
        );
    }

    #[test]
    fn hex_parsing() {
        assert_eq!(parse_hex("0x8086\n"), Some(0x8086));
        assert_eq!(parse_hex("10DE"), Some(0x10de));
        assert_eq!(parse_hex("0xzz"), None);
        assert_eq!(parse_hex(""), None);
    }
}
