//! Finding Intel GPUs in sysfs, as Intel's plugin does but without polling: the `card<N>`
//! entries of `class/drm` whose PCI device has vendor 0x8086, a `drm/` folder and the
//! configured driver. A physical function with SR-IOV virtual functions enabled is skipped (its
//! VFs are the devices); a VF is a device like any GPU.

use super::settings::IntelGpuSettings;
use crate::dra_attributes::Attributes;
use crate::replicas::ShareInfo;
use crate::sysfs::{node_edits, pci_device};
use crate::sysfs_watch::{Entry, Scan};
use devplug::cdi::Spec;
use devplug::dra::DeviceAttributes;
use devplug::{ContainerEdits, Mount};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// PCI vendor id of Intel.
const VENDOR_INTEL: u32 = 0x8086;

/// One GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct IntelGpu {
    /// Its card name, `card<N>` (the CDI device name, and the id prefix of its shares).
    pub(crate) card: String,
    /// Device nodes relative to the dev root.
    pub(crate) nodes: Vec<PathBuf>,
    /// Read-only `/dev/dri/by-path` mounts.
    pub(crate) mounts: Vec<Mount>,
}

/// What allocation needs from the latest scan.
#[derive(Debug, Default)]
pub(crate) struct IntelState {
    pub(crate) gpus: Vec<IntelGpu>,
    pub(crate) shares: HashMap<String, ShareInfo>,
}

/// The CDI kind for a driver: `gpu.intel.com/i915` or `gpu.intel.com/xe`.
pub(crate) fn cdi_kind(settings: &IntelGpuSettings) -> String {
    format!("gpu.intel.com/{}", settings.driver.name())
}

fn card_number(name: &str) -> Option<u32> {
    name.strip_prefix("card")?.parse().ok()
}

/// Scans sysfs and /dev.
pub(crate) fn scan(settings: &IntelGpuSettings) -> Scan<IntelState> {
    let sys = &settings.sys_root;
    let dev = &settings.dev_root;
    let by_path = dev.join("dri/by-path");
    let class_drm = sys.join("class/drm");
    let watch_dirs: BTreeSet<PathBuf> = [
        dev.clone(),
        dev.join("dri"),
        by_path.clone(),
        class_drm.clone(),
        sys.join("bus/pci/devices"),
        sys.join("bus/pci/drivers"),
        sys.join("bus/pci/drivers").join(settings.driver.name()),
    ]
    .into_iter()
    .collect();
    let mut cards: Vec<(u32, String, PathBuf)> = std::fs::read_dir(&class_drm)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let n = card_number(&name)?; // `card0-DP-1` connectors do not parse
            let device = std::fs::canonicalize(e.path().join("device")).ok()?;
            Some((n, name, device))
        })
        .collect();
    cards.sort();

    let mut gpus = Vec::new();
    let mut present = BTreeSet::new();
    type Facts = (
        IntelGpu,
        Option<i64>,
        Option<String>,
        Option<Box<DeviceAttributes>>,
    );
    let mut found: Vec<Facts> = Vec::new();
    let mut label_facts: Vec<super::labels::GpuFacts> = Vec::new();
    for (_, card, device) in cards {
        let Some(address) = device.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let pci = pci_device(sys, address, &device);
        if pci.vendor != Some(VENDOR_INTEL) || !device.join("drm").is_dir() {
            continue;
        }
        if pci.driver.as_deref() != Some(settings.driver.name()) {
            continue; // the other driver's resource serves it
        }
        present.insert(card.clone());
        if pci.sriov_numvfs > 0 {
            continue; // a PF with VFs enabled: the VFs are the devices
        }
        let nodes = pci.drm.dev_paths();
        let mut problems: Vec<String> = nodes
            .iter()
            .filter(|n| !dev.join(n).exists())
            .map(|n| format!("/dev/{} missing", n.display()))
            .collect();
        if pci.drm.render.is_none() {
            problems.push("no DRM render node in sysfs".to_owned());
        }
        let mut mounts = Vec::new();
        if settings.by_path && by_path.is_dir() {
            for suffix in ["card", "render"] {
                let name = format!("pci-{address}-{suffix}");
                let host = by_path.join(&name);
                if host.symlink_metadata().is_ok() {
                    mounts.push(Mount {
                        host_path: host.display().to_string(),
                        container_path: format!("/dev/dri/by-path/{name}"),
                        read_only: true,
                    });
                }
            }
        }
        let problem = (!problems.is_empty()).then(|| problems.join(", "));
        label_facts.push(label_facts_of(&class_drm.join(&card), pci.numa));
        let attributes = Attributes::default()
            .hex_id("deviceID", pci.device)
            .string("card", &card)
            .bool("sriovVF", pci.physfn.is_some())
            .pci(address, Some(&device))
            .build();
        found.push((
            IntelGpu {
                card,
                nodes,
                mounts,
            },
            pci.numa,
            problem,
            attributes,
        ));
    }

    let mut entries = Vec::new();
    let mut shares = HashMap::new();
    for (index, (gpu, numa, problem, attributes)) in found.iter().enumerate() {
        for k in 0..settings.count {
            let id = if settings.count == 1 {
                gpu.card.clone()
            } else {
                format!("{}-{k}", gpu.card)
            };
            shares.insert(
                id.clone(),
                ShareInfo {
                    physical: index,
                    numa: *numa,
                },
            );
            entries.push(Entry {
                id,
                physical: gpu.card.clone(),
                numa: *numa,
                problem: problem.clone(),
                attributes: attributes.clone(),
            });
        }
        gpus.push(gpu.clone());
    }
    let spec = settings.cdi.then(|| {
        let mut spec = Spec::new(cdi_kind(settings));
        for gpu in &gpus {
            spec = spec.device(gpu.card.clone(), &gpu_edits(dev, gpu));
        }
        spec
    });
    Scan {
        entries,
        state: IntelState { gpus, shares },
        watch_dirs,
        spec,
        absent: BTreeMap::new(),
        present,
        labels: super::labels::node_labels(&label_facts),
    }
}

/// What the node labels say of the GPU whose DRM card folder is `card`: its tiles (`gt/gt*`
/// under i915, `device/tile?` under xe) and local memory per tile.
fn label_facts_of(card: &Path, numa: Option<i64>) -> super::labels::GpuFacts {
    let count = |dir: PathBuf, prefix: &str| -> usize {
        std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| {
                e.file_name()
                    .to_str()
                    .is_some_and(|n| n.starts_with(prefix))
            })
            .count()
    };
    let tiles = count(card.join("gt"), "gt").saturating_add(count(card.join("device"), "tile"));
    super::labels::GpuFacts {
        card: card
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_owned(),
        numa,
        tiles: u64::try_from(tiles.max(1)).unwrap_or(1),
        lmem_per_tile: crate::sysfs::read_trimmed(&card.join("lmem_total_bytes"))
            .and_then(|v| v.parse().ok()),
    }
}

/// A GPU's nodes and mounts.
pub(crate) fn gpu_edits(dev_root: &Path, gpu: &IntelGpu) -> ContainerEdits {
    let mut edits = node_edits(dev_root, &gpu.nodes);
    edits.mounts.clone_from(&gpu.mounts);
    edits
}
