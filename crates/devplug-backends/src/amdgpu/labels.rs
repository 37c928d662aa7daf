//! The node labels of an `amdgpu` resource, named and formatted as AMD's node labeller writes
//! them (ROCm/k8s-device-plugin, `cmd/k8s-node-labeller/main.go`, `createLabels`): a property
//! that every GPU shares is `amd.com/gpu.<property>=<value>`; one that differs between GPUs is
//! `amd.com/gpu.<property>.<value>=<count of GPUs>`. Read from sysfs and KFD's topology at each
//! scan, so a GPU that goes, a repartition or a driver update changes them.

use crate::NodeLabels;
use std::collections::BTreeMap;

/// The prefix of every label this backend writes.
pub const PREFIX: &str = "amd.com/gpu.";

/// What the labels say of one GPU; `None` where sysfs does not have it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuFacts {
    /// PCI device id, 4 hex digits without `0x` (`74a1`).
    pub device_id: Option<String>,
    /// `product_name` in sysfs, as a label value.
    pub product_name: Option<String>,
    /// VRAM in bytes (KFD's memory bank 0, `size_in_bytes`).
    pub vram_bytes: Option<u64>,
    /// SIMDs (KFD `simd_count`).
    pub simd_count: Option<u64>,
    /// SIMDs per compute unit (KFD `simd_per_cu`).
    pub simd_per_cu: Option<u64>,
    /// The amdgpu module's version.
    pub driver_version: Option<String>,
    /// Compute and memory partition mode, `<compute>_<memory>` (`cpx_nps1`).
    pub partition: Option<String>,
}

/// The labels of these GPUs (none without a GPU).
pub fn node_labels(gpus: &[GpuFacts]) -> NodeLabels {
    let mut labels = NodeLabels::new();
    if gpus.is_empty() {
        return labels;
    }
    let mut property = |kind: &str, values: Vec<Option<String>>| {
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        for v in values.into_iter().flatten().filter(|v| !v.is_empty()) {
            *counts.entry(v).or_default() += 1;
        }
        if counts.len() == 1 {
            if let Some(value) = counts.into_keys().next() {
                labels.insert(format!("{PREFIX}{kind}"), value);
            }
        } else {
            for (value, n) in counts {
                labels.insert(format!("{PREFIX}{kind}.{value}"), n.to_string());
            }
        }
    };
    property(
        "device-id",
        gpus.iter().map(|g| g.device_id.clone()).collect(),
    );
    property(
        "product-name",
        gpus.iter().map(|g| g.product_name.clone()).collect(),
    );
    property(
        "vram",
        gpus.iter()
            .map(|g| g.vram_bytes.map(|b| format!("{}G", round_gib(b))))
            .collect(),
    );
    property(
        "simd-count",
        gpus.iter()
            .map(|g| g.simd_count.map(|s| s.to_string()))
            .collect(),
    );
    property(
        "cu-count",
        gpus.iter()
            .map(|g| match (g.simd_count, g.simd_per_cu) {
                (Some(s), Some(c)) if c != 0 => Some((s / c).to_string()),
                _ => None,
            })
            .collect(),
    );
    // One value for the node, as AMD's labeller writes these two.
    if let Some(version) = gpus.iter().find_map(|g| g.driver_version.clone()) {
        labels.insert(format!("{PREFIX}driver-version"), version);
    }
    let partitions: Vec<&Option<String>> = gpus.iter().map(|g| &g.partition).collect();
    if let Some(Some(first)) = partitions.first() {
        if partitions.iter().all(|p| p.as_ref() == Some(first)) {
            labels.insert(format!("{PREFIX}compute-memory-partition"), first.clone());
        }
    }
    labels
}

/// Bytes in GiB, rounded to the nearest (AMD's `%dG`).
fn round_gib(bytes: u64) -> u64 {
    const GIB: u64 = 1 << 30;
    bytes.saturating_add(GIB / 2) / GIB
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mi300x() -> GpuFacts {
        GpuFacts {
            device_id: Some("74a1".into()),
            product_name: Some("AMD-Instinct-MI300X".into()),
            vram_bytes: Some(205_822_885_888),
            simd_count: Some(1216),
            simd_per_cu: Some(4),
            driver_version: Some("6.10.5".into()),
            partition: Some("spx_nps1".into()),
        }
    }

    #[test]
    fn shared_properties_are_values_as_amds_labeller_writes_them() {
        let got = node_labels(&[mi300x(), mi300x()]);
        let want: NodeLabels = [
            ("compute-memory-partition", "spx_nps1"),
            ("cu-count", "304"),
            ("device-id", "74a1"),
            ("driver-version", "6.10.5"),
            ("product-name", "AMD-Instinct-MI300X"),
            ("simd-count", "1216"),
            ("vram", "192G"),
        ]
        .into_iter()
        .map(|(k, v)| (format!("{PREFIX}{k}"), v.to_owned()))
        .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn differing_properties_are_counted_per_value() {
        let mut other = mi300x();
        other.device_id = Some("74a5".into());
        other.partition = Some("cpx_nps1".into());
        other.simd_count = None;
        let got = node_labels(&[mi300x(), mi300x(), other]);
        assert_eq!(got["amd.com/gpu.device-id.74a1"], "2");
        assert_eq!(got["amd.com/gpu.device-id.74a5"], "1");
        assert!(!got.contains_key("amd.com/gpu.device-id"));
        // Only what sysfs gave is counted: two of three GPUs told their SIMDs.
        assert_eq!(got["amd.com/gpu.simd-count"], "1216");
        // Partition modes that differ: no node-wide mode.
        assert!(!got.contains_key("amd.com/gpu.compute-memory-partition"));
        assert!(node_labels(&[]).is_empty());
    }
}
