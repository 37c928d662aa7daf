//! Fake sysfs and /dev trees for tests and benchmarks, built from a short description, the way
//! Intel's `gpu_fakedev` and NVIDIA's `nvpci` mock do: PCI device folders with `vendor`,
//! `device`, `class`, `numa_node`; **real symlinks** for `driver`, `iommu_group`, `physfn`,
//! `bus/pci/devices/<bdf>`, `bus/pci/drivers/<driver>/<bdf>` and `class/drm/<node>`; DRM
//! folders with `dev` files; AMD KFD topology (`nodes/*/properties`, `io_links`); and device
//! nodes as plain files under `dev/`. No root needed; nothing outside the given folder is
//! touched.
//!
//! ```no_run
//! # fn main() -> std::io::Result<()> {
//! use devplug_testkit::fake_sysfs::{AmdNode, FakeSysfs};
//! let tmp = std::env::temp_dir().join("fake-mi300x");
//! let tree = FakeSysfs::new(&tmp)?;
//! let node = AmdNode::mi300x(); // 8 GPUs, XGMI, CPX + NPS4: 64 partitions
//! node.create(&tree)?;
//! node.load_driver(&tree)?; // or later, to test a driver that loads after start
//! # Ok(()) }
//! ```

use std::io;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

/// The folder to make fake trees in: `/dev/shm` (tmpfs) when it exists, as a fake MI300X
/// node is ~15,000 files and folders and tmpfs makes them in milliseconds; else the temp dir.
pub fn scratch_dir() -> PathBuf {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_owned()
    } else {
        std::env::temp_dir()
    }
}

/// A fake tree: `<root>/sys` and `<root>/dev`.
#[derive(Debug, Clone)]
pub struct FakeSysfs {
    root: PathBuf,
}

/// PCI vendor id of AMD.
pub const VENDOR_AMD: u32 = 0x1002;
/// PCI vendor id of Intel.
pub const VENDOR_INTEL: u32 = 0x8086;

impl FakeSysfs {
    /// An empty tree under `root` (created if missing).
    pub fn new(root: &Path) -> io::Result<FakeSysfs> {
        std::fs::create_dir_all(root.join("sys/bus/pci/devices"))?;
        std::fs::create_dir_all(root.join("sys/bus/pci/drivers"))?;
        std::fs::create_dir_all(root.join("sys/class/drm"))?;
        std::fs::create_dir_all(root.join("sys/devices/platform"))?;
        std::fs::create_dir_all(root.join("dev"))?;
        Ok(FakeSysfs {
            root: root.to_owned(),
        })
    }

    /// The fake `/sys`.
    pub fn sys_root(&self) -> PathBuf {
        self.root.join("sys")
    }

    /// The fake `/dev`.
    pub fn dev_root(&self) -> PathBuf {
        self.root.join("dev")
    }

    /// A path in the tree.
    pub fn path(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }

    /// Writes a file, making its folders.
    pub fn file(&self, rel: &str, text: &str) -> io::Result<()> {
        let path = self.path(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(path, text)
    }

    /// Makes a symlink `rel` → `target` (relative targets as sysfs has them).
    pub fn link(&self, rel: &str, target: &str) -> io::Result<()> {
        let path = self.path(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        if path.symlink_metadata().is_ok() {
            std::fs::remove_file(&path)?;
        }
        symlink(target, path)
    }

    /// Removes a file, symlink or folder; missing is fine.
    pub fn remove(&self, rel: &str) -> io::Result<()> {
        let path = self.path(rel);
        match path.symlink_metadata() {
            Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
            Ok(_) => std::fs::remove_file(path),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// A PCI device folder under `devices/pci0000:00/`, its `bus/pci/devices` link and its
    /// IOMMU group link.
    pub fn pci(&self, dev: &PciSpec) -> io::Result<()> {
        let dir = pci_dir(&dev.address);
        self.file(
            &format!("sys/{dir}/vendor"),
            &format!("0x{:04x}\n", dev.vendor),
        )?;
        self.file(
            &format!("sys/{dir}/device"),
            &format!("0x{:04x}\n", dev.device),
        )?;
        self.file(
            &format!("sys/{dir}/class"),
            &format!("0x{:06x}\n", dev.class),
        )?;
        self.file(&format!("sys/{dir}/numa_node"), &format!("{}\n", dev.numa))?;
        let group = format!("sys/kernel/iommu_groups/{}", dev.iommu_group);
        self.link(
            &format!("{group}/devices/{}", dev.address),
            &format!("../../../../{dir}"),
        )?;
        self.link(
            &format!("sys/{dir}/iommu_group"),
            &format!("../../../kernel/iommu_groups/{}", dev.iommu_group),
        )?;
        self.link(
            &format!("sys/bus/pci/devices/{}", dev.address),
            &format!("../../../{dir}"),
        )
    }

    /// Binds `address` to `driver`: `driver` link in the device, device link in the driver.
    pub fn bind(&self, address: &str, driver: &str) -> io::Result<()> {
        let dir = pci_dir(address);
        std::fs::create_dir_all(self.path(&format!("sys/bus/pci/drivers/{driver}")))?;
        self.link(
            &format!("sys/bus/pci/drivers/{driver}/{address}"),
            &format!("../../../../{dir}"),
        )?;
        self.link(
            &format!("sys/{dir}/driver"),
            &format!("../../../bus/pci/drivers/{driver}"),
        )
    }

    /// DRM nodes of a device folder (`sys`-relative, e.g. `devices/platform/amdgpu_xcp_1`):
    /// `drm/card<N>` and `drm/renderD<M>` with `dev` files and `device` links, the
    /// `class/drm` links, and the `/dev/dri` nodes.
    pub fn drm(&self, device_dir: &str, card: u32, render: u32) -> io::Result<()> {
        for (name, minor) in [
            (format!("card{card}"), card),
            (format!("renderD{render}"), render),
        ] {
            let dir = format!("{device_dir}/drm/{name}");
            self.file(&format!("sys/{dir}/dev"), &format!("226:{minor}\n"))?;
            let leaf = device_dir.rsplit('/').next().unwrap_or(device_dir);
            self.link(&format!("sys/{dir}/device"), &format!("../../../{leaf}"))?;
            self.link(&format!("sys/class/drm/{name}"), &format!("../../{dir}"))?;
            self.file(&format!("dev/dri/{name}"), "")?;
        }
        Ok(())
    }

    /// Removes the DRM nodes made by [`FakeSysfs::drm`].
    pub fn remove_drm(&self, device_dir: &str, card: u32, render: u32) -> io::Result<()> {
        for name in [format!("card{card}"), format!("renderD{render}")] {
            self.remove(&format!("dev/dri/{name}"))?;
            self.remove(&format!("sys/class/drm/{name}"))?;
            self.remove(&format!("sys/{device_dir}/drm/{name}"))?;
        }
        Ok(())
    }
}

/// The sysfs folder of a PCI device (relative to `sys/`).
pub fn pci_dir(address: &str) -> String {
    format!("devices/pci0000:00/{address}")
}

/// One PCI device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciSpec {
    /// Address, e.g. `0000:0c:00.0`.
    pub address: String,
    /// Vendor id.
    pub vendor: u32,
    /// Device id.
    pub device: u32,
    /// Class code (24 bits).
    pub class: u32,
    /// NUMA node (`-1` for none).
    pub numa: i64,
    /// IOMMU group number.
    pub iommu_group: u32,
}

/// An AMD node: GPUs of one model, optionally partitioned, with or without XGMI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AmdNode {
    /// The GPUs.
    pub gpus: Vec<AmdGpu>,
    /// XGMI links between GPUs as (a, b) GPU indices; PCIe everywhere else.
    pub xgmi: Vec<(usize, usize)>,
    /// Extra `amdgpu_xcp_*` folders with render nodes KFD does not list (the driver makes
    /// unused slots; they must be skipped).
    pub unused_xcp: u32,
}

/// One AMD GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AmdGpu {
    /// PCI address.
    pub address: String,
    /// NUMA node.
    pub numa: i64,
    /// `current_compute_partition` (e.g. `CPX`), if the GPU supports partitioning.
    pub compute: Option<String>,
    /// `current_memory_partition` (e.g. `NPS4`).
    pub memory: Option<String>,
    /// Number of compute partitions (1 for SPX).
    pub partitions: u32,
}

/// The amdgpu module version the fake driver reports (`/sys/module/amdgpu/version`).
pub const AMDGPU_VERSION: &str = "6.10.5";

/// Where one partition's nodes are in an [`AmdNode`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AmdPartition {
    /// The device id devplug gives it (PCI address, or `amdgpu_xcp_<k>`).
    pub id: String,
    /// Its sysfs folder, relative to `sys/`.
    pub dir: String,
    /// Card number.
    pub card: u32,
    /// Render minor.
    pub render: u32,
    /// KFD node id.
    pub kfd_node: u32,
    /// GPU index.
    pub gpu: usize,
}

impl AmdNode {
    /// `gpus` GPUs of `partitions` partitions each (`compute`/`memory` mode names), the first
    /// half on NUMA 0 and the rest on NUMA 1, all XGMI-connected if `xgmi`.
    pub fn new(gpus: usize, partitions: u32, compute: &str, memory: &str, xgmi: bool) -> Self {
        let gpus_v = (0..gpus)
            .map(|g| AmdGpu {
                address: format!("0000:{:02x}:00.0", 0x0c + g * 0x10),
                numa: (g * 2 / gpus.max(1)) as i64,
                compute: Some(compute.to_owned()),
                memory: Some(memory.to_owned()),
                partitions,
            })
            .collect();
        let links = if xgmi {
            (0..gpus)
                .flat_map(|a| ((a + 1)..gpus).map(move |b| (a, b)))
                .collect()
        } else {
            Vec::new()
        };
        AmdNode {
            gpus: gpus_v,
            xgmi: links,
            unused_xcp: 2,
        }
    }

    /// An MI300X-like node: 8 GPUs, 4 per NUMA node, all XGMI, CPX + NPS4 (64 partitions).
    pub fn mi300x() -> Self {
        AmdNode::new(8, 8, "CPX", "NPS4", true)
    }

    /// Every partition (the GPU's own PCI device is partition 0), in order.
    pub fn partitions(&self) -> Vec<AmdPartition> {
        let mut out = Vec::new();
        let (mut card, mut render, mut xcp) = (1u32, 128u32, 0u32);
        let cpu_nodes = self.cpu_nodes();
        let mut kfd = cpu_nodes;
        for (g, gpu) in self.gpus.iter().enumerate() {
            for p in 0..gpu.partitions.max(1) {
                let (id, dir) = if p == 0 {
                    (gpu.address.clone(), pci_dir(&gpu.address))
                } else {
                    xcp += 1;
                    let name = format!("amdgpu_xcp_{xcp}");
                    (name.clone(), format!("devices/platform/{name}"))
                };
                out.push(AmdPartition {
                    id,
                    dir,
                    card,
                    render,
                    kfd_node: kfd,
                    gpu: g,
                });
                card += 1;
                render += 1;
                kfd += 1;
            }
        }
        out
    }

    fn cpu_nodes(&self) -> u32 {
        let max = self.gpus.iter().map(|g| g.numa.max(0)).max().unwrap_or(0);
        u32::try_from(max).unwrap_or(0) + 1
    }

    /// The PCI devices (present even before the driver loads), each in its own IOMMU group.
    pub fn create(&self, tree: &FakeSysfs) -> io::Result<()> {
        for (g, gpu) in self.gpus.iter().enumerate() {
            tree.pci(&PciSpec {
                address: gpu.address.clone(),
                vendor: VENDOR_AMD,
                device: 0x74a1,
                class: 0x038000,
                numa: gpu.numa,
                iommu_group: u32::try_from(g).unwrap_or(0) + 10,
            })?;
        }
        Ok(())
    }

    /// What loading `amdgpu` makes: module folder, bindings, partition files, DRM nodes,
    /// `amdgpu_xcp_*` folders, the KFD topology, `/dev/kfd` and `/dev/dri/*`. The device nodes
    /// come last, as udev/devtmpfs would make them.
    pub fn load_driver(&self, tree: &FakeSysfs) -> io::Result<()> {
        std::fs::create_dir_all(tree.path("sys/module/amdgpu/drivers"))?;
        tree.file("sys/module/amdgpu/version", &format!("{AMDGPU_VERSION}\n"))?;
        tree.link(
            "sys/bus/pci/drivers/amdgpu/module",
            "../../../../module/amdgpu",
        )?;
        for gpu in &self.gpus {
            tree.bind(&gpu.address, "amdgpu")?;
            let dir = pci_dir(&gpu.address);
            tree.file(&format!("sys/{dir}/product_name"), "AMD Instinct MI300X\n")?;
            if let (Some(c), Some(m)) = (&gpu.compute, &gpu.memory) {
                tree.file(
                    &format!("sys/{dir}/current_compute_partition"),
                    &format!("{c}\n"),
                )?;
                tree.file(
                    &format!("sys/{dir}/current_memory_partition"),
                    &format!("{m}\n"),
                )?;
            }
        }
        let parts = self.partitions();
        // Each KFD node is made in a staging folder and renamed into place, so it appears
        // whole, with its links, as the kernel's do.
        let topo = "sys/class/kfd/kfd/topology/nodes";
        let staging = "kfd-staging";
        std::fs::create_dir_all(tree.path(topo))?;
        let publish = |id: u32| {
            std::fs::rename(
                tree.path(&format!("{staging}/{id}")),
                tree.path(&format!("{topo}/{id}")),
            )
        };
        for cpu in 0..self.cpu_nodes() {
            tree.file(
                &format!("{staging}/{cpu}/properties"),
                "cpu_cores_count 96\nsimd_count 0\nvendor_id 0\ndrm_render_minor 0\n",
            )?;
            publish(cpu)?;
        }
        for part in &parts {
            let gpu = &self.gpus[part.gpu];
            let (bus, dev, func) = parse_bdf(&gpu.address);
            let location = (bus << 8) | (dev << 3) | func;
            tree.file(
                &format!("{staging}/{}/properties", part.kfd_node),
                &format!(
                    "cpu_cores_count 0\nsimd_count 304\nsimd_per_cu 4\nvendor_id 4098\n\
                     location_id {location}\ndomain 0\ndrm_render_minor {}\n",
                    part.render
                ),
            )?;
            // An MI300X's 192 GiB, split by the memory partition mode (NPS<n>).
            let nps: u64 = gpu
                .memory
                .as_deref()
                .and_then(|m| m.trim_start_matches("NPS").parse().ok())
                .unwrap_or(1);
            tree.file(
                &format!("{staging}/{}/mem_banks/0/properties", part.kfd_node),
                &format!(
                    "heap_type 1\nsize_in_bytes {}\n",
                    (192u64 << 30) / nps.max(1)
                ),
            )?;
            let mut links = vec![(u32::try_from(gpu.numa.max(0)).unwrap_or(0), 2u32)];
            for other in &parts {
                if other.kfd_node == part.kfd_node {
                    continue;
                }
                let (a, b) = (part.gpu.min(other.gpu), part.gpu.max(other.gpu));
                if a == b || self.xgmi.contains(&(a, b)) {
                    links.push((other.kfd_node, 11));
                }
            }
            for (i, (to, kind)) in links.into_iter().enumerate() {
                tree.file(
                    &format!("{staging}/{}/io_links/{i}/properties", part.kfd_node),
                    &format!(
                        "type {kind}\nnode_from {}\nnode_to {to}\nweight 15\n",
                        part.kfd_node
                    ),
                )?;
            }
            publish(part.kfd_node)?;
        }
        std::fs::remove_dir(tree.path(staging))?;
        let last_xcp = parts.iter().filter(|p| p.dir.contains("xcp")).count();
        let (mut card, mut render) = (1 + parts.len() as u32, 128 + parts.len() as u32);
        for k in 0..self.unused_xcp {
            let dir = format!("devices/platform/amdgpu_xcp_{}", last_xcp as u32 + 1 + k);
            tree.drm(&dir, card, render)?;
            card += 1;
            render += 1;
        }
        for part in &parts {
            tree.drm(&part.dir, part.card, part.render)?;
        }
        tree.file("dev/kfd", "")
    }
}

fn parse_bdf(address: &str) -> (u32, u32, u32) {
    let mut it = address.split([':', '.']).skip(1);
    let mut next = || {
        it.next()
            .and_then(|v| u32::from_str_radix(v, 16).ok())
            .unwrap_or(0)
    };
    (next(), next(), next())
}

/// One Intel GPU (a physical function, or a virtual function with `physfn`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IntelGpu {
    /// PCI address.
    pub address: String,
    /// `i915` or `xe`.
    pub driver: String,
    /// NUMA node (`-1` for none).
    pub numa: i64,
    /// Card number.
    pub card: u32,
    /// Render minor.
    pub render: u32,
    /// Virtual functions enabled on it (`sriov_numvfs`).
    pub sriov_numvfs: u32,
    /// For a VF: its PF's address.
    pub physfn: Option<String>,
}

impl IntelGpu {
    /// A GPU at `address` bound to `driver`, card `card`, render node `128 + card`.
    pub fn new(address: &str, driver: &str, numa: i64, card: u32) -> Self {
        IntelGpu {
            address: address.to_owned(),
            driver: driver.to_owned(),
            numa,
            card,
            render: 128 + card,
            sriov_numvfs: 0,
            physfn: None,
        }
    }

    /// The sysfs folder of its PCI device (relative to `sys/`).
    pub fn dir(&self) -> String {
        pci_dir(&self.address)
    }

    /// Adds the GPU: PCI device, binding, DRM nodes, and `/dev/dri/by-path` links if
    /// `by_path`.
    pub fn create(&self, tree: &FakeSysfs, by_path: bool) -> io::Result<()> {
        tree.pci(&PciSpec {
            address: self.address.clone(),
            vendor: VENDOR_INTEL,
            device: 0x56c0,
            class: 0x030000,
            numa: self.numa,
            iommu_group: self.card + 40,
        })?;
        let dir = self.dir();
        tree.file(
            &format!("sys/{dir}/sriov_numvfs"),
            &format!("{}\n", self.sriov_numvfs),
        )?;
        if let Some(pf) = &self.physfn {
            tree.link(&format!("sys/{dir}/physfn"), &format!("../{pf}"))?;
        }
        tree.bind(&self.address, &self.driver)?;
        tree.drm(&dir, self.card, self.render)?;
        if by_path {
            let base = format!("dev/dri/by-path/pci-{}", self.address);
            tree.link(&format!("{base}-card"), &format!("../card{}", self.card))?;
            tree.link(
                &format!("{base}-render"),
                &format!("../renderD{}", self.render),
            )?;
        }
        Ok(())
    }
}

/// A 2-GPU Intel node: an integrated GPU on `i915` (card0, no NUMA) and a discrete one on `xe`
/// (card1, NUMA 0).
pub fn intel_pair() -> Vec<IntelGpu> {
    vec![
        IntelGpu::new("0000:00:02.0", "i915", -1, 0),
        IntelGpu::new("0000:03:00.0", "xe", 0, 1),
    ]
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn mi300x_layout() {
        let tmp = tempfile::tempdir_in(scratch_dir()).unwrap();
        let tree = FakeSysfs::new(tmp.path()).unwrap();
        let node = AmdNode::mi300x();
        node.create(&tree).unwrap();
        assert!(!tree.path("sys/module/amdgpu").exists());
        node.load_driver(&tree).unwrap();
        let parts = node.partitions();
        assert_eq!(parts.len(), 64);
        assert_eq!(parts[0].id, "0000:0c:00.0");
        assert_eq!(parts[1].id, "amdgpu_xcp_1");
        assert_eq!(parts[63].render, 191);
        let link = std::fs::read_link(tree.path("sys/bus/pci/devices/0000:1c:00.0")).unwrap();
        assert_eq!(link, Path::new("../../../devices/pci0000:00/0000:1c:00.0"));
        let card = std::fs::canonicalize(tree.path("sys/class/drm/card2/device")).unwrap();
        assert!(card.ends_with("devices/platform/amdgpu_xcp_1"), "{card:?}");
        let driver =
            std::fs::canonicalize(tree.path("sys/bus/pci/devices/0000:0c:00.0/driver")).unwrap();
        assert!(driver.ends_with("bus/pci/drivers/amdgpu"));
        let props =
            std::fs::read_to_string(tree.path("sys/class/kfd/kfd/topology/nodes/2/properties"))
                .unwrap();
        assert!(props.contains("location_id 3072\n"), "{props}"); // bus 0x0c << 8
        assert!(tree.path("dev/dri/renderD191").exists());
        assert!(
            tree.path("sys/devices/platform/amdgpu_xcp_57/drm").exists(),
            "unused slot"
        );
    }
}
