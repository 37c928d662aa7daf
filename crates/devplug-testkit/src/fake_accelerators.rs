//! Fake trees of the accelerators that are not GPUs, on [`FakeSysfs`]: PCI devices bound to
//! `vfio-pci` with their IOMMU groups and `/dev/vfio` nodes, Intel QAT cards whose virtual
//! functions come and go with `sriov_numvfs`, Huawei Ascend NPUs and Intel FPGA (DFL) ports.
//! Real symlinks, as the kernel lays them out; device nodes are plain files (a test that
//! hands them to a real container runtime replaces them with `mknod`).

use crate::fake_sysfs::{pci_dir, FakeSysfs, PciSpec, VENDOR_INTEL};
use std::io;

/// The driver VFIO devices are bound to.
pub const VFIO_PCI: &str = "vfio-pci";

impl FakeSysfs {
    /// The VFIO modules loaded: the `vfio-pci` driver folder and `/dev/vfio/vfio`.
    pub fn load_vfio(&self) -> io::Result<()> {
        std::fs::create_dir_all(self.path(&format!("sys/bus/pci/drivers/{VFIO_PCI}")))?;
        self.file("dev/vfio/vfio", "")
    }

    /// Binds `address` to `vfio-pci` and makes its group's node `/dev/vfio/<group>`, as the
    /// kernel does when the first device of a group is bound.
    pub fn bind_vfio(&self, address: &str, group: u32) -> io::Result<()> {
        self.bind(address, VFIO_PCI)?;
        self.file(&format!("dev/vfio/{group}"), "")
    }

    /// Unbinds `address` from its driver; `group`'s node goes too (its last device left
    /// `vfio-pci`).
    pub fn unbind_vfio(&self, address: &str, group: u32) -> io::Result<()> {
        self.remove(&format!("dev/vfio/{group}"))?;
        self.remove(&format!("sys/bus/pci/drivers/{VFIO_PCI}/{address}"))?;
        self.remove(&format!("sys/{}/driver", pci_dir(address)))
    }

    /// Adds a PCI device and binds it to `vfio-pci` (its group's node made).
    pub fn vfio_device(&self, spec: &PciSpec) -> io::Result<()> {
        self.pci(spec)?;
        self.bind_vfio(&spec.address, spec.iommu_group)
    }
}

/// An Intel QAT card: a physical function bound to its kernel driver, SR-IOV capable, with
/// its virtual functions bound to `vfio-pci` when enabled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QatCard {
    /// The PF's address; VFs follow it (`…:00.1`, `…:00.2`, …).
    pub address: String,
    /// PF device id (`0x4940` 4xxx, `0x37c8` C62x).
    pub pf_device: u32,
    /// VF device id (`0x4941`, `0x37c9`).
    pub vf_device: u32,
    /// The PF's kernel driver (`4xxx`, `c6xx`).
    pub driver: String,
    /// NUMA node.
    pub numa: i64,
    /// `qat/cfg_services` (Gen4 and later), e.g. `sym;asym`.
    pub services: Option<String>,
    /// IOMMU group of the first VF; the others follow.
    pub first_group: u32,
}

impl QatCard {
    /// A Gen4 (4xxx) card with `services`.
    pub fn gen4(address: &str, numa: i64, services: &str, first_group: u32) -> Self {
        QatCard {
            address: address.to_owned(),
            pf_device: 0x4940,
            vf_device: 0x4941,
            driver: "4xxx".to_owned(),
            numa,
            services: Some(services.to_owned()),
            first_group,
        }
    }

    /// A C62x card (Gen2: no service configuration).
    pub fn c62x(address: &str, numa: i64, first_group: u32) -> Self {
        QatCard {
            address: address.to_owned(),
            pf_device: 0x37c8,
            vf_device: 0x37c9,
            driver: "c6xx".to_owned(),
            numa,
            services: None,
            first_group,
        }
    }

    /// The address of VF `n` (0-based): functions after the PF's, eight to a slot.
    pub fn vf_address(&self, n: u32) -> String {
        let (prefix, rest) = self.address.rsplit_once(':').unwrap_or(("0000:00", "00.0"));
        let slot = rest
            .split_once('.')
            .and_then(|(s, _)| u32::from_str_radix(s, 16).ok())
            .unwrap_or(0);
        let function = n + 1;
        format!("{prefix}:{:02x}.{}", slot + function / 8, function % 8)
    }

    /// The IOMMU group of VF `n`.
    pub fn vf_group(&self, n: u32) -> u32 {
        self.first_group + n
    }

    /// Adds the PF, bound to its driver, with SR-IOV off (`sriov_numvfs` 0 of 16).
    pub fn create(&self, tree: &FakeSysfs) -> io::Result<()> {
        tree.pci(&PciSpec {
            address: self.address.clone(),
            vendor: VENDOR_INTEL,
            device: self.pf_device,
            class: 0x0b4000,
            numa: self.numa,
            iommu_group: self.first_group.saturating_sub(1),
        })?;
        let dir = pci_dir(&self.address);
        tree.file(&format!("sys/{dir}/sriov_totalvfs"), "16\n")?;
        tree.file(&format!("sys/{dir}/sriov_numvfs"), "0\n")?;
        if let Some(services) = &self.services {
            tree.file(&format!("sys/{dir}/qat/state"), "up\n")?;
            tree.file(
                &format!("sys/{dir}/qat/cfg_services"),
                &format!("{services}\n"),
            )?;
        }
        tree.bind(&self.address, &self.driver)
    }

    /// Sets `sriov_numvfs`: VFs `0..n` exist, each bound to `vfio-pci` in its own group,
    /// and the VFs above `n` are gone (with their groups' nodes).
    pub fn set_numvfs(&self, tree: &FakeSysfs, n: u32) -> io::Result<()> {
        let pf_dir = pci_dir(&self.address);
        let before: u32 = std::fs::read_to_string(tree.path(&format!("sys/{pf_dir}/sriov_numvfs")))
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0);
        for k in n..before {
            let address = self.vf_address(k);
            tree.unbind_vfio(&address, self.vf_group(k))?;
            tree.remove(&format!("sys/bus/pci/devices/{address}"))?;
            tree.remove(&format!("sys/kernel/iommu_groups/{}", self.vf_group(k)))?;
            tree.remove(&format!("sys/{pf_dir}/virtfn{k}"))?;
            tree.remove(&format!("sys/{}", pci_dir(&address)))?;
        }
        tree.file(&format!("sys/{pf_dir}/sriov_numvfs"), &format!("{n}\n"))?;
        for k in before..n {
            let address = self.vf_address(k);
            tree.pci(&PciSpec {
                address: address.clone(),
                vendor: VENDOR_INTEL,
                device: self.vf_device,
                class: 0x0b4000,
                numa: self.numa,
                iommu_group: self.vf_group(k),
            })?;
            let dir = pci_dir(&address);
            tree.link(
                &format!("sys/{dir}/physfn"),
                &format!("../{}", self.address),
            )?;
            tree.link(&format!("sys/{pf_dir}/virtfn{k}"), &format!("../{address}"))?;
            tree.bind_vfio(&address, self.vf_group(k))?;
        }
        Ok(())
    }
}

/// PCI vendor id of Huawei.
pub const VENDOR_HUAWEI: u32 = 0x19e5;

/// A node with Huawei Ascend NPUs: `/dev/davinci<N>` per NPU, the shared nodes, and each
/// NPU's PCI device with the `dev_id` file the Ascend driver adds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AscendNode {
    /// The NPUs: (physical id, PCI address, NUMA node).
    pub npus: Vec<(u32, String, i64)>,
    /// PCI device id (`0xd801` Ascend 910).
    pub device: u32,
}

impl AscendNode {
    /// `n` Ascend 910 NPUs, the first half on NUMA node 0, the rest on 1.
    pub fn ascend910(n: u32) -> Self {
        AscendNode {
            npus: (0..n)
                .map(|k| {
                    (
                        k,
                        format!("0000:{:02x}:00.0", 0xc1 + k),
                        i64::from(k >= n / 2),
                    )
                })
                .collect(),
            device: 0xd801,
        }
    }

    /// Adds the PCI devices and every node, as the driver does when it loads.
    pub fn create(&self, tree: &FakeSysfs) -> io::Result<()> {
        for (k, (id, address, numa)) in self.npus.iter().enumerate() {
            tree.pci(&PciSpec {
                address: address.clone(),
                vendor: VENDOR_HUAWEI,
                device: self.device,
                class: 0x120000,
                numa: *numa,
                iommu_group: 200 + k as u32,
            })?;
            tree.file(
                &format!("sys/{}/dev_id", pci_dir(address)),
                &format!("{id}\n"),
            )?;
            tree.bind(address, "devdrv_device_driver")?;
            tree.file(&format!("dev/davinci{id}"), "")?;
        }
        for shared in ["davinci_manager", "devmm_svm", "hisi_hdc"] {
            tree.file(&format!("dev/{shared}"), "")?;
        }
        Ok(())
    }
}

/// An Intel FPGA card under the DFL driver: one region with its FME, whose own region has an
/// interface id (`compat_id`), and ports, each carrying an AFU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FpgaCard {
    /// PCI address of the card.
    pub address: String,
    /// NUMA node.
    pub numa: i64,
    /// The region's number (`region<X>`) and the FME's (`dfl-fme.<X>`).
    pub region: u32,
    /// The interface id (32 hex digits).
    pub interface_id: String,
    /// Ports: (number, AFU id).
    pub ports: Vec<(u32, String)>,
}

impl FpgaCard {
    /// The card's region folder (relative to the tree).
    pub fn region_dir(&self) -> String {
        format!(
            "sys/{}/fpga_region/region{}",
            pci_dir(&self.address),
            self.region
        )
    }

    /// Adds the card: PCI device, region, FME with its interface id, ports and their nodes.
    pub fn create(&self, tree: &FakeSysfs) -> io::Result<()> {
        tree.pci(&PciSpec {
            address: self.address.clone(),
            vendor: VENDOR_INTEL,
            device: 0x0b30,
            class: 0x120000,
            numa: self.numa,
            iommu_group: 300 + self.region,
        })?;
        tree.bind(&self.address, "dfl-pci")?;
        let region = self.region_dir();
        let r = self.region;
        tree.file(
            &format!(
                "{region}/dfl-fme.{r}/dfl-fme-region.{r}/fpga_region/region{}/compat_id",
                r + 100
            ),
            &format!("{}\n", self.interface_id),
        )?;
        tree.file(
            &format!("{region}/dfl-fme.{r}/ports_num"),
            &format!("{}\n", self.ports.len()),
        )?;
        tree.link(
            &format!("sys/class/fpga_region/region{r}"),
            &format!("../../{}", region.trim_start_matches("sys/")),
        )?;
        for (port, afu) in &self.ports {
            self.set_afu(tree, *port, afu)?;
            tree.file(&format!("dev/dfl-port.{port}"), "")?;
        }
        Ok(())
    }

    /// Writes a port's `afu_id`, as a partial reconfiguration does.
    pub fn set_afu(&self, tree: &FakeSysfs, port: u32, afu: &str) -> io::Result<()> {
        tree.file(
            &format!("{}/dfl-port.{port}/afu_id", self.region_dir()),
            &format!("{afu}\n"),
        )
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::fake_sysfs::scratch_dir;

    #[test]
    fn qat_vfs_come_and_go() {
        let tmp = tempfile::tempdir_in(scratch_dir()).unwrap();
        let tree = FakeSysfs::new(tmp.path()).unwrap();
        tree.load_vfio().unwrap();
        let card = QatCard::gen4("0000:3d:00.0", 0, "sym;asym", 100);
        assert_eq!(card.vf_address(0), "0000:3d:00.1");
        assert_eq!(card.vf_address(7), "0000:3d:01.0");
        card.create(&tree).unwrap();
        card.set_numvfs(&tree, 3).unwrap();
        let vf = tree.path("sys/bus/pci/devices/0000:3d:00.3");
        assert_eq!(
            std::fs::read_link(vf.join("driver"))
                .unwrap()
                .file_name()
                .unwrap(),
            "vfio-pci"
        );
        assert!(vf.join("physfn/qat/cfg_services").exists());
        assert!(tree.path("dev/vfio/102").exists());
        assert!(tree
            .path("sys/kernel/iommu_groups/102/devices/0000:3d:00.3/physfn")
            .exists());
        card.set_numvfs(&tree, 1).unwrap();
        assert!(!tree.path("dev/vfio/102").exists());
        assert!(!tree.path("sys/bus/pci/devices/0000:3d:00.2").exists());
        assert!(tree.path("sys/bus/pci/devices/0000:3d:00.1").exists());
    }
}
