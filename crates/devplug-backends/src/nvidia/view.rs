//! What one resource serves, computed once per discovery: the GPUs it selected (by model), their
//! NUMA nodes (from sysfs, by PCI address), their replica ids, the CDI spec, and the pair
//! matrix that preferred allocation searches (NVLink count and PCIe level, scored as
//! go-gpuallocator scores them).

use super::lib::{GpuInfo, Snapshot};
use super::settings::NvidiaSettings;
use crate::cdi::Spec;
use crate::placement::PairMatrix;
use crate::sysfs::{dev_node, numa_node};
use devplug::ContainerEdits;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// The CDI kind of NVIDIA GPUs.
pub const CDI_KIND: &str = "nvidia.com/gpu";
/// NVIDIA's control nodes, given with every GPU when present.
pub const CONTROL_NODES: [&str; 4] = [
    "nvidiactl",
    "nvidia-uvm",
    "nvidia-uvm-tools",
    "nvidia-modeset",
];
/// Score per NVLink between two GPUs (go-gpuallocator: 100 per link).
pub const NVLINK_SCORE: u32 = 100;

/// One served GPU.
#[derive(Debug, Clone)]
pub struct ServedGpu {
    /// What NVML said.
    pub info: GpuInfo,
    /// NUMA node from sysfs.
    pub numa: Option<i64>,
    /// Its device ids: the UUID, or `<uuid>::<n>` for each replica.
    pub ids: Vec<String>,
}

/// One resource's view of the node.
#[derive(Debug, Clone)]
pub struct View {
    /// The GPUs this resource serves.
    pub gpus: Vec<ServedGpu>,
    /// Device id → position in `gpus`.
    pub index: HashMap<String, usize>,
    /// Pair weights between the served GPUs.
    pub matrix: PairMatrix,
    /// True if some GPU has more than one replica.
    pub shared: bool,
}

fn glob_match(globs: &[String], text: &str) -> bool {
    globs
        .iter()
        .any(|g| glob::Pattern::new(g).is_ok_and(|p| p.matches(text)))
}

/// Whether this resource serves the GPU.
pub fn selected(settings: &NvidiaSettings, gpu: &GpuInfo) -> bool {
    (settings.models.is_empty() || glob_match(&settings.models, &gpu.name))
        && !glob_match(&settings.exclude_models, &gpu.name)
}

/// The replica count for a GPU: the first override naming its UUID, index or model.
pub fn replicas_for(settings: &NvidiaSettings, gpu: &GpuInfo) -> u32 {
    settings
        .replica_overrides
        .iter()
        .find(|o| {
            o.gpus.iter().any(|sel| {
                *sel == gpu.uuid
                    || *sel == gpu.index.to_string()
                    || glob::Pattern::new(sel).is_ok_and(|p| p.matches(&gpu.name))
            })
        })
        .map_or(settings.replicas, |o| o.replicas)
}

/// NVLinks between two GPUs: direct links (remote address = the other GPU), plus, through
/// NVSwitches (remote addresses that are no GPU), the links both have to the same switch.
fn nvlinks(a: &GpuInfo, b: &GpuInfo, gpu_addresses: &[&str]) -> u32 {
    let direct = a.nvlinks.iter().filter(|r| **r == b.bus_id).count();
    fn per_switch<'g>(g: &'g GpuInfo, gpu_addresses: &[&str]) -> BTreeMap<&'g str, usize> {
        let mut m: BTreeMap<&'g str, usize> = BTreeMap::new();
        for r in g
            .nvlinks
            .iter()
            .filter(|r| !gpu_addresses.contains(&r.as_str()))
        {
            *m.entry(r.as_str()).or_default() += 1;
        }
        m
    }
    let (sa, sb) = (per_switch(a, gpu_addresses), per_switch(b, gpu_addresses));
    let switched: usize = sa
        .iter()
        .filter_map(|(s, n)| sb.get(s).map(|m| (*n).min(*m)))
        .sum();
    u32::try_from(direct.saturating_add(switched)).unwrap_or(u32::MAX)
}

impl View {
    /// The view of `snapshot` for a resource with these settings.
    pub fn build(settings: &NvidiaSettings, snapshot: &Snapshot) -> View {
        let addresses: Vec<&str> = snapshot.gpus.iter().map(|g| g.bus_id.as_str()).collect();
        let positions: Vec<usize> = (0..snapshot.gpus.len())
            .filter(|&i| selected(settings, &snapshot.gpus[i]))
            .collect();
        let mut gpus = Vec::new();
        let mut index = HashMap::new();
        let mut shared = false;
        for &p in &positions {
            let info = snapshot.gpus[p].clone();
            let device = settings.sys_root.join("bus/pci/devices").join(&info.bus_id);
            let device = std::fs::canonicalize(&device).unwrap_or(device);
            let numa = numa_node(&settings.sys_root, &device);
            let n = replicas_for(settings, &info);
            shared |= n > 1;
            let ids: Vec<String> = if n == 1 {
                vec![info.uuid.clone()]
            } else {
                (0..n).map(|k| format!("{}::{k}", info.uuid)).collect()
            };
            for id in &ids {
                index.insert(id.clone(), gpus.len());
            }
            gpus.push(ServedGpu { info, numa, ids });
        }
        let numa: Vec<Option<i64>> = gpus.iter().map(|g| g.numa).collect();
        let matrix = PairMatrix::from_fn(numa, |a, b| {
            let (pa, pb) = (positions[a], positions[b]);
            let pcie = snapshot
                .pcie
                .get(pa)
                .and_then(|row| row.get(pb))
                .copied()
                .flatten()
                .map_or(0, |l| l.score());
            let links = nvlinks(&snapshot.gpus[pa], &snapshot.gpus[pb], &addresses);
            pcie.saturating_add(links.saturating_mul(NVLINK_SCORE))
        });
        View {
            gpus,
            index,
            matrix,
            shared,
        }
    }

    /// The node of one GPU (`nvidia<minor>`).
    pub fn gpu_node(gpu: &GpuInfo) -> PathBuf {
        PathBuf::from(format!("nvidia{}", gpu.minor))
    }

    /// The control nodes that exist under the dev root.
    pub fn control_nodes(dev_root: &Path) -> Vec<PathBuf> {
        CONTROL_NODES
            .iter()
            .map(PathBuf::from)
            .filter(|n| dev_root.join(n).exists())
            .collect()
    }

    /// The CDI spec: one device per GPU (named by UUID) with its node, the control nodes as
    /// common edits.
    pub fn spec(&self, dev_root: &Path) -> Spec {
        let common = ContainerEdits {
            devices: Self::control_nodes(dev_root)
                .iter()
                .map(|n| dev_node(dev_root, n))
                .collect(),
            ..Default::default()
        };
        let mut spec = Spec::new(CDI_KIND).common(&common);
        for gpu in &self.gpus {
            let edits = ContainerEdits {
                devices: vec![dev_node(dev_root, &Self::gpu_node(&gpu.info))],
                ..Default::default()
            };
            spec = spec.device(gpu.info.uuid.clone(), &edits);
        }
        spec
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvidia::lib::PcieLevel;
    use crate::nvidia::settings::ReplicaOverride;

    fn gpu(index: u32, name: &str, links: &[&str]) -> GpuInfo {
        GpuInfo {
            index,
            uuid: format!("GPU-{index}"),
            name: name.into(),
            minor: index,
            memory_bytes: 1 << 30,
            bus_id: format!("0000:0{index}:00.0"),
            nvlinks: links.iter().map(|s| s.to_string()).collect(),
            mig_enabled: false,
        }
    }

    #[test]
    fn models_replicas_and_weights() {
        let snapshot = Snapshot {
            gpus: vec![
                gpu(
                    0,
                    "NVIDIA H100 80GB HBM3",
                    &["0000:01:00.0", "0000:01:00.0", "0000:f0:00.0"],
                ),
                gpu(
                    1,
                    "NVIDIA H100 80GB HBM3",
                    &["0000:00:00.0", "0000:00:00.0", "0000:f0:00.0"],
                ),
                gpu(2, "NVIDIA A100-SXM4-40GB", &[]),
            ],
            pcie: vec![
                vec![None, Some(PcieLevel::Single), Some(PcieLevel::System)],
                vec![Some(PcieLevel::Single), None, Some(PcieLevel::System)],
                vec![Some(PcieLevel::System), Some(PcieLevel::System), None],
            ],
        };
        let settings = NvidiaSettings {
            replicas: 2,
            replica_overrides: vec![ReplicaOverride {
                gpus: vec!["GPU-1".into()],
                replicas: 3,
            }],
            ..Default::default()
        };
        let view = View::build(&settings, &snapshot);
        assert_eq!(view.gpus[0].ids, ["GPU-0::0", "GPU-0::1"]);
        assert_eq!(view.gpus[1].ids.len(), 3);
        // 2 direct links + 1 through the same switch, plus PCIe SINGLE.
        assert_eq!(view.matrix.weight(0, 1), 3 * NVLINK_SCORE + 50);
        assert_eq!(view.matrix.weight(0, 2), 10);

        let h100 = NvidiaSettings {
            models: vec!["*H100*".into()],
            ..Default::default()
        };
        let view = View::build(&h100, &snapshot);
        assert_eq!(view.gpus.len(), 2);
        assert_eq!(view.gpus[1].ids, ["GPU-1"]);
        assert!(!view.shared);
    }
}
