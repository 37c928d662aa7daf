//! The node labels of an `intel_gpu` resource, named and formatted as the labeller of Intel's
//! GPU plugin writes them for Node Feature Discovery (intel-device-plugins-for-kubernetes,
//! `cmd/internal/labeler/labeler.go`): the cards (`card0.card1`), their numbers (`0.1`), the
//! tiles, the local memory, 1000 millicores per GPU and the NUMA map (`0-0.1_1-2.3`). Read from
//! sysfs at each scan, so a GPU that goes changes them.

use crate::NodeLabels;
use std::collections::BTreeMap;

/// The prefix of every label this backend writes.
pub const PREFIX: &str = "gpu.intel.com/";
/// Millicores per GPU, as Intel's labeller counts them.
const MILLICORES_PER_GPU: u64 = 1000;

/// What the labels say of one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuFacts {
    /// Its DRM card name (`card1`).
    pub card: String,
    /// Its NUMA node, if known.
    pub numa: Option<i64>,
    /// Its tiles (`gt/gt*` under i915, `device/tile?` under xe; 1 when neither).
    pub tiles: u64,
    /// Local memory per tile in bytes (`lmem_total_bytes`), if the driver says.
    pub lmem_per_tile: Option<u64>,
}

/// The labels of these GPUs (none without a GPU).
pub fn node_labels(gpus: &[GpuFacts]) -> NodeLabels {
    let mut labels = NodeLabels::new();
    if gpus.is_empty() {
        return labels;
    }
    let mut put = |key: &str, value: String| {
        labels.insert(format!("{PREFIX}{key}"), value);
    };
    let cards: Vec<&str> = gpus.iter().map(|g| g.card.as_str()).collect();
    let numbers: Vec<&str> = cards
        .iter()
        .map(|c| c.strip_prefix("card").unwrap_or(c))
        .collect();
    put("cards", value(&cards.join(".")));
    put("gpu-numbers", value(&numbers.join(".")));
    let tiles: u64 = gpus.iter().map(|g| g.tiles).fold(0, u64::saturating_add);
    put("tiles", tiles.to_string());
    let count = u64::try_from(gpus.len()).unwrap_or(u64::MAX);
    put(
        "millicores",
        MILLICORES_PER_GPU.saturating_mul(count).to_string(),
    );
    let memory: Option<u64> = gpus
        .iter()
        .map(|g| g.lmem_per_tile.map(|m| m.saturating_mul(g.tiles)))
        .try_fold(0u64, |sum, m| m.map(|m| sum.saturating_add(m)));
    if let Some(memory) = memory {
        put("memory.max", memory.to_string());
    }
    let mut by_numa: BTreeMap<i64, Vec<&str>> = BTreeMap::new();
    for (g, number) in gpus.iter().zip(&numbers) {
        if let Some(numa) = g.numa {
            by_numa.entry(numa).or_default().push(number);
        }
    }
    if !by_numa.is_empty() {
        let map: Vec<String> = by_numa
            .iter()
            .map(|(numa, gpus)| format!("{numa}-{}", gpus.join(".")))
            .collect();
        put("numa-gpu-map", value(&map.join("_")));
    }
    labels
}

/// A label value: at most 63 characters, cut after the last whole entry (Intel's labeller
/// splits longer values over numbered keys; devplug keeps the first).
fn value(text: &str) -> String {
    if text.len() <= 63 {
        return text.to_owned();
    }
    let cut = &text[..63];
    cut.rfind(['.', '_'])
        .map_or(cut, |end| &cut[..end])
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(card: u32, numa: i64, tiles: u64) -> GpuFacts {
        GpuFacts {
            card: format!("card{card}"),
            numa: Some(numa),
            tiles,
            lmem_per_tile: Some(64 << 30),
        }
    }

    #[test]
    fn labels_are_intels() {
        let got = node_labels(&[gpu(0, 0, 2), gpu(1, 0, 2), gpu(2, 1, 2)]);
        let want: NodeLabels = [
            ("cards", "card0.card1.card2"),
            ("gpu-numbers", "0.1.2"),
            ("memory.max", "412316860416"),
            ("millicores", "3000"),
            ("numa-gpu-map", "0-0.1_1-2"),
            ("tiles", "6"),
        ]
        .into_iter()
        .map(|(k, v)| (format!("{PREFIX}{k}"), v.to_owned()))
        .collect();
        assert_eq!(got, want);
        assert!(node_labels(&[]).is_empty());
    }

    #[test]
    fn memory_is_left_out_when_a_gpu_does_not_say_and_long_values_are_cut_whole() {
        let mut gpus: Vec<GpuFacts> = (0..40).map(|c| gpu(c, 0, 1)).collect();
        gpus[3].lmem_per_tile = None;
        let got = node_labels(&gpus);
        assert!(!got.contains_key("gpu.intel.com/memory.max"));
        let cards = &got["gpu.intel.com/cards"];
        assert!(
            cards.len() <= 63 && cards.ends_with(|c: char| c.is_ascii_digit()),
            "{cards}"
        );
        assert!(cards.starts_with("card0.card1."));
    }
}
