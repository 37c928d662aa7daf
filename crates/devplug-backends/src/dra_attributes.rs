//! The DRA attributes and capacities the backends give their devices, from what each already
//! knows (no extra discovery). A ResourceSlice publishes them for CEL selectors
//! (`device.attributes["gpu.example.com"].productName`); the device plugin path ignores them.
//!
//! | backend | attributes | capacity |
//! |---|---|---|
//! | `virtual` | none (one int would cost ~700 bytes a device, see [`crate::virtual_devices`]) | |
//! | `files` | `file` (the file name) | |
//! | `hostdev` | `path` (first node, `/dev/ttyUSB0`); USB: `vendorID`, `productID`; PCI: `vendorID`, `deviceID`, [`PCI_BUS_ID`], [`PCIE_ROOT`] | |
//! | `amdgpu` | `deviceID`, `partition` (`cpx_nps4`, when the GPU reports one), [`PCI_BUS_ID`], [`PCIE_ROOT`] | |
//! | `intel_gpu` | `deviceID`, `card` (`card0`), `sriovVF` (bool), [`PCI_BUS_ID`], [`PCIE_ROOT`] | |
//! | `nvidia` | `type` (`gpu` or `mig`), `uuid`, `productName`, `index`, `minor`, [`PCI_BUS_ID`], [`PCIE_ROOT`]; MIG: `parentUUID`, `profile` | `memory` (bytes) |
//!
//! Ids are lower-case hex without `0x` (`10de`), as `lspci -n` prints them. Shares of one
//! device (`count`, replicas, partitions, MIG devices) carry the attributes of the PCI device
//! they live on, so `matchAttribute: resource.kubernetes.io/pciBusID` keeps a claim's devices
//! on one physical device. The slice publisher adds `numa` from the device's NUMA node.
//! Values that would break the API server's rules (a string over 64 bytes, a malformed PCI
//! address) are left out here rather than refused there.

use devplug::dra::{AttributeValue, DeviceAttributes, CapacityRequestPolicy};
use std::path::Path;

/// The standard attribute for a device's PCI address in extended BDF form (`0000:3b:00.0`).
pub const PCI_BUS_ID: &str = "resource.kubernetes.io/pciBusID";

/// The standard attribute for the PCIe root complex a device sits below (`pci0000:00`).
pub const PCIE_ROOT: &str = "resource.kubernetes.io/pcieRoot";

/// The longest string value the API server takes.
const MAX_STRING: usize = 64;

/// Builds one device's attributes, leaving out values the API server would refuse.
#[derive(Debug, Default)]
pub(crate) struct Attributes(DeviceAttributes);

impl Attributes {
    /// A string attribute, if it is not empty and at most 64 bytes.
    pub(crate) fn string(mut self, name: &str, value: &str) -> Self {
        if !value.is_empty() && value.len() <= MAX_STRING {
            self.0
                .attributes
                .insert(name.to_owned(), AttributeValue::String(value.to_owned()));
        }
        self
    }

    /// A string attribute when there is a value.
    pub(crate) fn string_opt(self, name: &str, value: Option<&str>) -> Self {
        match value {
            Some(value) => self.string(name, value),
            None => self,
        }
    }

    /// An int attribute.
    pub(crate) fn int(mut self, name: &str, value: i64) -> Self {
        self.0
            .attributes
            .insert(name.to_owned(), AttributeValue::Int(value));
        self
    }

    /// A bool attribute.
    pub(crate) fn bool(mut self, name: &str, value: bool) -> Self {
        self.0
            .attributes
            .insert(name.to_owned(), AttributeValue::Bool(value));
        self
    }

    /// A PCI id (`0x10de`, `10DE`) as four lower-case hex digits, when there is one.
    pub(crate) fn hex_id(self, name: &str, value: Option<u32>) -> Self {
        match value {
            Some(value) => self.string(name, &format!("{value:04x}")),
            None => self,
        }
    }

    /// A capacity, when it is known (not 0).
    pub(crate) fn capacity(mut self, name: &str, value: u64) -> Self {
        if value > 0 {
            self.0.capacity.insert(name.to_owned(), value);
        }
        self
    }

    /// A capacity of `value` that claims share by `policy` (left out, as the device's sharing
    /// is, when the policy does not fit the value).
    pub(crate) fn shared(mut self, name: &str, value: u64, policy: CapacityRequestPolicy) -> Self {
        if policy.check(value).is_ok() {
            self.0.capacity.insert(name.to_owned(), value);
            self.0.shared.insert(name.to_owned(), policy);
        }
        self
    }

    /// [`PCI_BUS_ID`] from `address` when it is a valid extended BDF, and [`PCIE_ROOT`] from the
    /// device's canonical sysfs folder when it shows one.
    pub(crate) fn pci(mut self, address: &str, sysfs: Option<&Path>) -> Self {
        if let Some(bus_id) = pci_bus_id(address) {
            self = self.string(PCI_BUS_ID, &bus_id);
        }
        if let Some(root) = sysfs.and_then(pcie_root) {
            self = self.string(PCIE_ROOT, &root);
        }
        self
    }

    /// The attributes for a [`devplug::Device`]; `None` when there are none (no allocation).
    pub(crate) fn build(self) -> Option<Box<DeviceAttributes>> {
        (!self.0.is_empty()).then(|| Box::new(self.0))
    }
}

fn is_hex(s: &str, len: std::ops::RangeInclusive<usize>) -> bool {
    len.contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// `address` as the standard attribute wants it (`dddd:bb:dd.f`, lower-case, a domain of 4 to
/// 8 hex digits), or `None` when it is not a PCI address. NVML's 8-digit domain form
/// (`00000000:3B:00.0`) becomes sysfs's (`0000:3b:00.0`).
pub(crate) fn pci_bus_id(address: &str) -> Option<String> {
    let lower = address.trim().to_ascii_lowercase();
    let (domain, rest) = lower.split_once(':')?;
    let (bus, rest) = rest.split_once(':')?;
    let (device, function) = rest.split_once('.')?;
    let domain = match domain.strip_prefix("0000") {
        Some(short) if short.len() >= 4 => short,
        _ => domain,
    };
    let valid = is_hex(domain, 4..=8)
        && is_hex(bus, 2..=2)
        && is_hex(device, 2..=2)
        && u8::from_str_radix(device, 16).is_ok_and(|d| d < 32)
        && function.len() == 1
        && function.bytes().all(|b| (b'0'..=b'7').contains(&b));
    valid.then(|| format!("{domain}:{bus}:{device}.{function}"))
}

/// The PCIe root complex of the device whose canonical sysfs folder is `path`
/// (`/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0` → `pci0000:00`), as the standard
/// attribute names it.
pub(crate) fn pcie_root(path: &Path) -> Option<String> {
    path.components().find_map(|c| {
        let name = c.as_os_str().to_str()?;
        let (domain, bus) = name.strip_prefix("pci")?.split_once(':')?;
        let lower = |s: &str| s.to_ascii_lowercase();
        (is_hex(&lower(domain), 4..=8) && is_hex(&lower(bus), 2..=2))
            .then(|| format!("pci{}:{}", lower(domain), lower(bus)))
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn pci_addresses_in_the_standard_form() {
        assert_eq!(pci_bus_id("0000:3b:00.0").as_deref(), Some("0000:3b:00.0"));
        assert_eq!(
            pci_bus_id("00000000:3B:00.0").as_deref(),
            Some("0000:3b:00.0")
        );
        assert_eq!(
            pci_bus_id("10000:01:00.7").as_deref(),
            Some("10000:01:00.7"),
            "VMD domains are wider"
        );
        for bad in [
            "",
            "3b:00.0",
            "0000:3b:00",
            "0000:3b:20.0",
            "0000:3b:00.8",
            "x000:3b:00.0",
        ] {
            assert_eq!(pci_bus_id(bad), None, "{bad}");
        }
    }

    #[test]
    fn pcie_roots_from_sysfs_paths() {
        let path = Path::new("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0");
        assert_eq!(pcie_root(path).as_deref(), Some("pci0000:00"));
        let path = Path::new("/tmp/x/sys/devices/pci0000:3a/0000:3a:00.0");
        assert_eq!(pcie_root(path).as_deref(), Some("pci0000:3a"));
        assert_eq!(
            pcie_root(Path::new("/sys/devices/platform/amdgpu_xcp_1")),
            None
        );
    }

    #[test]
    fn values_the_api_server_refuses_are_left_out() {
        let attrs = Attributes::default()
            .string("productName", &"x".repeat(65))
            .string("empty", "")
            .capacity("memory", 0)
            .build();
        assert!(attrs.is_none(), "nothing left, nothing allocated");
        let attrs = Attributes::default()
            .string("productName", "NVIDIA H100 80GB HBM3")
            .hex_id("deviceID", Some(0x74a1))
            .int("index", 3)
            .bool("sriovVF", false)
            .capacity("memory", 80 << 30)
            .pci(
                "0000:3b:00.0",
                Some(Path::new("/sys/devices/pci0000:3a/0000:3b:00.0")),
            )
            .build()
            .unwrap();
        attrs.check().unwrap();
        assert_eq!(
            attrs.attributes["deviceID"],
            AttributeValue::String("74a1".into())
        );
        assert_eq!(
            attrs.attributes[PCIE_ROOT],
            AttributeValue::String("pci0000:3a".into())
        );
        assert_eq!(attrs.capacity["memory"], 80 << 30);
    }
}
