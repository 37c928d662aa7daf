//! Finding AMD GPUs and their compute partitions in sysfs, and the links between them in KFD's
//! topology. GPUs are PCI display devices of vendor 0x1002 bound to `amdgpu`; partitions are the
//! `devices/platform/amdgpu_xcp_*` folders whose render node KFD lists (the driver makes spare
//! slots that KFD does not list; they are skipped, as ROCm's plugin does). A partition's GPU is
//! the PCI address KFD gives its node (`domain`, `location_id`).

use super::settings::AmdgpuSettings;
use crate::dra_attributes::Attributes;
use crate::placement::PairMatrix;
use crate::sysfs::{drm_nodes, node_edits, pci_devices, read_trimmed, DrmNodes};
use crate::sysfs_watch::{Entry, Scan};
use devplug::cdi::Spec;
use devplug::dra::DeviceAttributes;
use devplug::ContainerEdits;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// PCI vendor id of AMD.
const VENDOR_AMD: u32 = 0x1002;
/// PCI base class of processing accelerators.
const PCI_CLASS_ACCELERATOR: u32 = 0x12;
/// The CDI kind of AMD GPUs.
pub(crate) const CDI_KIND: &str = "amd.com/gpu";

/// Pair weight of two partitions of one GPU (higher is better).
pub const WEIGHT_SAME_GPU: u32 = 40;
/// Pair weight of GPUs joined by XGMI (KFD io_link type 11).
pub const WEIGHT_XGMI: u32 = 30;
/// Pair weight of GPUs with a direct PCIe peer link (KFD link type 2).
pub const WEIGHT_PCIE: u32 = 20;
/// Pair weight of GPUs with no direct link (traffic goes through the CPU).
pub const WEIGHT_NONE: u32 = 10;

/// One device: a whole GPU, or one compute partition of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AmdDevice {
    /// PCI address (a GPU, or partition 0 of a partitioned one) or `amdgpu_xcp_<k>`.
    pub(crate) id: String,
    /// The GPU's PCI address.
    pub(crate) physical: String,
    /// Device nodes relative to the dev root (`dri/card1`, `dri/renderD128`).
    pub(crate) nodes: Vec<PathBuf>,
}

/// What allocation needs from the latest scan.
#[derive(Debug)]
pub(crate) struct AmdState {
    pub(crate) devices: Vec<AmdDevice>,
    pub(crate) index: HashMap<String, usize>,
    pub(crate) matrix: PairMatrix,
}

/// A GPU node of KFD's topology.
#[derive(Debug, Clone, PartialEq, Eq)]
struct KfdNode {
    id: u32,
    /// The PCI address of its GPU.
    gpu: String,
}

/// KFD's topology: GPU nodes by render minor, and the best link kind between node pairs.
#[derive(Debug, Default)]
struct Kfd {
    by_render: HashMap<u32, KfdNode>,
    /// (lower node, higher node) → weight of their best link.
    links: HashMap<(u32, u32), u32>,
}

fn properties(path: &Path) -> HashMap<String, i64> {
    std::fs::read_to_string(path)
        .map(|text| parse_properties(&text))
        .unwrap_or_default()
}

fn parse_properties(text: &str) -> HashMap<String, i64> {
    text.lines()
        .filter_map(|line| {
            let (key, value) = line.split_once(char::is_whitespace)?;
            Some((key.to_owned(), value.trim().parse().ok()?))
        })
        .collect()
}

fn numbered_dirs(dir: &Path) -> Vec<(u32, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<(u32, PathBuf)> = entries
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path())))
        .collect();
    out.sort();
    out
}

/// The KFD nodes and their `properties` text: when these are unchanged the links are too (they
/// are fixed per boot for a given set of nodes), so the ~n² link files are read only when the
/// nodes change, not on every rescan.
pub(crate) type KfdKey = Vec<(u32, String)>;

/// The last topology read, and what it was read from.
#[derive(Debug, Default)]
pub(crate) struct KfdCache {
    key: KfdKey,
    kfd: Kfd,
}

fn kfd_key(nodes_dir: &Path) -> KfdKey {
    numbered_dirs(nodes_dir)
        .into_iter()
        .map(|(id, dir)| {
            let text = std::fs::read_to_string(dir.join("properties")).unwrap_or_default();
            (id, text)
        })
        .collect()
}

fn read_kfd(nodes_dir: &Path, key: &KfdKey) -> Kfd {
    let mut kfd = Kfd::default();
    for (id, text) in key {
        let id = *id;
        let dir = nodes_dir.join(id.to_string());
        let p = parse_properties(text);
        let get = |k: &str| p.get(k).copied().unwrap_or(0);
        let render = get("drm_render_minor");
        if get("simd_count") > 0 && get("cpu_cores_count") == 0 && render > 0 {
            let loc = get("location_id");
            let gpu = format!(
                "{:04x}:{:02x}:{:02x}.{:x}",
                get("domain") & 0xffff,
                (loc >> 8) & 0xff,
                (loc >> 3) & 0x1f,
                loc & 0x7
            );
            if let Ok(render) = u32::try_from(render) {
                kfd.by_render.insert(render, KfdNode { id, gpu });
            }
        }
        for sub in ["io_links", "p2p_links"] {
            for (_, link) in numbered_dirs(&dir.join(sub)) {
                let lp = properties(&link.join("properties"));
                let (Some(from), Some(to), Some(kind)) =
                    (lp.get("node_from"), lp.get("node_to"), lp.get("type"))
                else {
                    continue;
                };
                let weight = match kind {
                    11 => WEIGHT_XGMI,
                    2 => WEIGHT_PCIE,
                    _ => continue,
                };
                let (Ok(a), Ok(b)) = (u32::try_from(*from), u32::try_from(*to)) else {
                    continue;
                };
                let key = (a.min(b), a.max(b));
                let best = kfd.links.entry(key).or_insert(weight);
                *best = (*best).max(weight);
            }
        }
    }
    kfd
}

/// One candidate before filtering.
struct Found {
    device: AmdDevice,
    numa: Option<i64>,
    kind: Option<String>,
    /// DRA attributes: its GPU's (a partition lives on it).
    attributes: Option<Box<DeviceAttributes>>,
    drm: DrmNodes,
    kfd_node: Option<u32>,
}

/// Scans sysfs and /dev; `cache` keeps KFD's links between scans.
pub(crate) fn scan(settings: &AmdgpuSettings, cache: &mut KfdCache) -> Scan<AmdState> {
    let sys = &settings.sys_root;
    let dev = &settings.dev_root;
    let kfd_nodes = sys.join("class/kfd/kfd/topology/nodes");
    let platform = sys.join("devices/platform");
    let watch_dirs: BTreeSet<PathBuf> = [
        dev.clone(),
        dev.join("dri"),
        sys.join("bus/pci/devices"),
        sys.join("bus/pci/drivers"),
        sys.join("bus/pci/drivers/amdgpu"),
        sys.join("class/drm"),
        platform.clone(),
        kfd_nodes.clone(),
    ]
    .into_iter()
    .collect();
    let key = kfd_key(&kfd_nodes);
    if key != cache.key {
        cache.kfd = read_kfd(&kfd_nodes, &key);
        cache.key = key;
    }
    let kfd = &cache.kfd;
    let mut absent = BTreeMap::new();
    let mut found: Vec<Found> = Vec::new();
    type GpuFacts = (Option<i64>, Option<String>, Option<Box<DeviceAttributes>>);
    let mut gpus: HashMap<String, GpuFacts> = HashMap::new();
    let mut label_facts: Vec<super::labels::GpuFacts> = Vec::new();
    for pci in pci_devices(sys) {
        // Display controllers (0x03) and processing accelerators (0x12, as some Instinct
        // parts report); being bound to amdgpu is what makes one a device.
        let accelerator = pci.class.is_some_and(|c| c >> 16 == PCI_CLASS_ACCELERATOR);
        if pci.vendor != Some(VENDOR_AMD) || !(pci.is_display() || accelerator) {
            continue;
        }
        if pci.driver.as_deref() != Some("amdgpu") {
            let why = match &pci.driver {
                Some(d) => format!("is bound to {d}, not amdgpu"),
                None => "has no driver bound (amdgpu not loaded yet?)".to_owned(),
            };
            absent.insert(pci.address.clone(), why);
            continue;
        }
        let read = |f: &str| read_trimmed(&pci.path.join(f)).map(|v| v.to_ascii_lowercase());
        let kind = match (
            read("current_compute_partition"),
            read("current_memory_partition"),
        ) {
            (Some(c), Some(m)) if !c.is_empty() && !m.is_empty() => Some(format!("{c}_{m}")),
            _ => None,
        };
        let attributes = Attributes::default()
            .hex_id("deviceID", pci.device)
            .string_opt("partition", kind.as_deref())
            .pci(&pci.address, Some(&pci.path))
            .build();
        gpus.insert(
            pci.address.clone(),
            (pci.numa, kind.clone(), attributes.clone()),
        );
        let kfd_node = pci
            .drm
            .render_minor()
            .and_then(|r| kfd.by_render.get(&r))
            .map(|n| n.id);
        label_facts.push(label_facts_of(&pci, kind.as_deref(), kfd_node, &kfd_nodes));
        found.push(Found {
            device: AmdDevice {
                id: pci.address.clone(),
                physical: pci.address.clone(),
                nodes: pci.drm.dev_paths(),
            },
            numa: pci.numa,
            kind,
            attributes,
            drm: pci.drm,
            kfd_node,
        });
    }
    let mut xcps: Vec<(u32, String, PathBuf)> = std::fs::read_dir(&platform)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let k = name.strip_prefix("amdgpu_xcp_")?.parse().ok()?;
            Some((k, name, e.path()))
        })
        .collect();
    xcps.sort();
    for (_, name, path) in xcps {
        let drm = drm_nodes(&path);
        let Some(node) = drm.render_minor().and_then(|r| kfd.by_render.get(&r)) else {
            continue; // a spare slot: KFD does not list it
        };
        let Some((numa, kind, attributes)) = gpus.get(&node.gpu) else {
            continue; // its GPU is not (yet) bound to amdgpu
        };
        found.push(Found {
            device: AmdDevice {
                id: name,
                physical: node.gpu.clone(),
                nodes: drm.dev_paths(),
            },
            numa: *numa,
            kind: kind.clone(),
            attributes: attributes.clone(),
            drm,
            kfd_node: Some(node.id),
        });
    }
    // Each GPU's partitions right after it; GPUs by address.
    found.sort_by(|a, b| {
        let rank = |f: &Found| (f.device.id != f.device.physical, xcp_number(&f.device.id));
        (a.device.physical.as_str(), rank(a)).cmp(&(b.device.physical.as_str(), rank(b)))
    });
    let present: BTreeSet<String> = gpus.keys().cloned().collect();
    if let Some(want) = &settings.partition_type {
        found.retain(|f| f.kind.as_deref() == Some(want.as_str()));
    }

    let kfd_present = dev.join("kfd").exists();
    let entries: Vec<Entry> = found
        .iter()
        .map(|f| Entry {
            id: f.device.id.clone(),
            physical: f.device.physical.clone(),
            numa: f.numa,
            problem: problem(dev, kfd_present, f),
            attributes: f.attributes.clone(),
        })
        .collect();
    let matrix = PairMatrix::from_fn(found.iter().map(|f| f.numa).collect(), |a, b| {
        let (fa, fb) = (&found[a], &found[b]);
        if fa.device.physical == fb.device.physical {
            return WEIGHT_SAME_GPU;
        }
        match (fa.kfd_node, fb.kfd_node) {
            (Some(x), Some(y)) => kfd
                .links
                .get(&(x.min(y), x.max(y)))
                .copied()
                .unwrap_or(WEIGHT_NONE),
            _ => WEIGHT_NONE,
        }
    });
    let spec = settings.cdi.then(|| {
        let mut spec = Spec::new(CDI_KIND).common(&kfd_edits(dev));
        for f in &found {
            spec = spec.device(f.device.id.clone(), &node_edits(dev, &f.device.nodes));
        }
        spec
    });
    let devices: Vec<AmdDevice> = found.into_iter().map(|f| f.device).collect();
    let index = devices
        .iter()
        .enumerate()
        .map(|(i, d)| (d.id.clone(), i))
        .collect();
    Scan {
        entries,
        state: AmdState {
            devices,
            index,
            matrix,
        },
        watch_dirs,
        spec,
        absent,
        present,
        labels: super::labels::node_labels(&label_facts),
    }
}

/// What the node labels say of a GPU: its PCI device id and product name, its KFD node's
/// SIMDs and VRAM, the driver's version, its partition mode.
fn label_facts_of(
    pci: &crate::sysfs::PciDevice,
    partition: Option<&str>,
    kfd_node: Option<u32>,
    kfd_nodes: &Path,
) -> super::labels::GpuFacts {
    let node = kfd_node.map(|id| kfd_nodes.join(id.to_string()));
    let props = node
        .as_ref()
        .map(|n| properties(&n.join("properties")))
        .unwrap_or_default();
    let bank = node
        .as_ref()
        .map(|n| properties(&n.join("mem_banks/0/properties")))
        .unwrap_or_default();
    let count =
        |map: &HashMap<String, i64>, key: &str| map.get(key).and_then(|v| u64::try_from(*v).ok());
    super::labels::GpuFacts {
        device_id: pci.device.map(|d| format!("{d:04x}")),
        product_name: read_trimmed(&pci.path.join("product_name"))
            .map(|n| crate::nvidia::labels::sanitise(&n))
            .filter(|n| !n.is_empty()),
        vram_bytes: count(&bank, "size_in_bytes"),
        simd_count: count(&props, "simd_count"),
        simd_per_cu: count(&props, "simd_per_cu"),
        driver_version: read_trimmed(&pci.path.join("driver/module/version")),
        partition: partition.map(str::to_owned),
    }
}

fn xcp_number(id: &str) -> u32 {
    id.strip_prefix("amdgpu_xcp_")
        .and_then(|k| k.parse().ok())
        .unwrap_or(0)
}

fn problem(dev: &Path, kfd_present: bool, f: &Found) -> Option<String> {
    if f.drm.render.is_none() {
        return Some("no DRM render node in sysfs".to_owned());
    }
    let mut missing: Vec<String> = Vec::new();
    if !kfd_present {
        missing.push("/dev/kfd".to_owned());
    }
    for node in &f.device.nodes {
        if !dev.join(node).exists() {
            missing.push(format!("/dev/{}", node.display()));
        }
    }
    (!missing.is_empty()).then(|| format!("{} missing", missing.join(", ")))
}

/// `/dev/kfd`, once per container.
pub(crate) fn kfd_edits(dev_root: &Path) -> ContainerEdits {
    node_edits(dev_root, &[PathBuf::from("kfd")])
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use devplug_testkit::fake_sysfs::{AmdNode, FakeSysfs};

    fn settings(tree: &FakeSysfs) -> AmdgpuSettings {
        AmdgpuSettings {
            sys_root: tree.sys_root(),
            dev_root: tree.dev_root(),
            cdi_dir: tree.path("cdi"),
            ..Default::default()
        }
    }

    #[test]
    fn mi300x_partitions_links_and_numa() {
        let tmp = tempfile::tempdir_in(devplug_testkit::fake_sysfs::scratch_dir()).unwrap();
        let tree = FakeSysfs::new(tmp.path()).unwrap();
        let node = AmdNode::mi300x();
        node.create(&tree).unwrap();
        let mut cache = KfdCache::default();
        let before = scan(&settings(&tree), &mut cache);
        assert!(before.entries.is_empty());
        assert_eq!(before.absent.len(), 8, "present, driver not bound");
        node.load_driver(&tree).unwrap();
        let found = scan(&settings(&tree), &mut cache);
        assert_eq!(
            found.entries.len(),
            64,
            "8 GPUs x 8 CPX partitions; spare slots skipped"
        );
        let ids: Vec<&str> = found.entries.iter().map(|e| e.id.as_str()).collect();
        assert_eq!(&ids[..3], ["0000:0c:00.0", "amdgpu_xcp_1", "amdgpu_xcp_2"]);
        assert_eq!(ids[8], "0000:1c:00.0");
        assert!(found.entries.iter().all(|e| e.problem.is_none()));
        assert_eq!(found.entries[0].numa, Some(0));
        assert_eq!(found.entries[63].numa, Some(1));
        assert_eq!(found.entries[9].physical, "0000:1c:00.0");
        let m = &found.state.matrix;
        assert_eq!(m.weight(0, 1), WEIGHT_SAME_GPU);
        assert_eq!(m.weight(0, 8), WEIGHT_XGMI);
        assert_eq!(m.class_count(), 8);
        assert_eq!(
            found.state.devices[1].nodes,
            [PathBuf::from("dri/card2"), PathBuf::from("dri/renderD129")]
        );
        let spec = found.spec.unwrap();
        assert_eq!(spec.devices.len(), 64);
        assert_eq!(spec.kind, "amd.com/gpu");

        // Mixed naming: one resource per type.
        let only = |t: &str| AmdgpuSettings {
            partition_type: Some(t.into()),
            ..settings(&tree)
        };
        assert_eq!(scan(&only("cpx_nps4"), &mut cache).entries.len(), 64);
        assert_eq!(scan(&only("spx_nps1"), &mut cache).entries.len(), 0);
    }

    #[test]
    fn pcie_only_node_weights_and_missing_nodes() {
        let tmp = tempfile::tempdir_in(devplug_testkit::fake_sysfs::scratch_dir()).unwrap();
        let tree = FakeSysfs::new(tmp.path()).unwrap();
        let mut node = AmdNode::new(4, 1, "SPX", "NPS1", false);
        node.xgmi = vec![(0, 1)];
        node.create(&tree).unwrap();
        node.load_driver(&tree).unwrap();
        let mut cache = KfdCache::default();
        let found = scan(&settings(&tree), &mut cache);
        assert_eq!(found.entries.len(), 4);
        let m = &found.state.matrix;
        assert_eq!(m.weight(0, 1), WEIGHT_XGMI);
        assert_eq!(m.weight(0, 2), WEIGHT_NONE);
        // A processing-accelerator class (0x12) counts; AMD's HDMI audio function does not.
        let gpu3 = devplug_testkit::fake_sysfs::pci_dir(&node.gpus[3].address);
        tree.file(&format!("sys/{gpu3}/class"), "0x120000\n")
            .unwrap();
        tree.pci(&devplug_testkit::fake_sysfs::PciSpec {
            address: "0000:0c:00.1".into(),
            vendor: 0x1002,
            device: 0xab28,
            class: 0x040300,
            numa: 0,
            iommu_group: 99,
        })
        .unwrap();
        let found = scan(&settings(&tree), &mut cache);
        assert_eq!(found.entries.len(), 4);
        assert!(found.absent.is_empty(), "{:?}", found.absent);
        std::fs::remove_file(tree.path("dev/dri/renderD129")).unwrap();
        std::fs::remove_file(tree.path("dev/kfd")).unwrap();
        let found = scan(&settings(&tree), &mut cache);
        assert_eq!(
            found.entries[1].problem.as_deref(),
            Some("/dev/kfd, /dev/dri/renderD129 missing")
        );
    }
}
