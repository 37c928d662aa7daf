//! What one resource serves, computed once per discovery: the GPUs it selected (by model), or
//! their MIG devices (by `mig_strategy` and `mig_profile`, with their caps nodes from
//! `mig-minors`), their NUMA nodes (from sysfs, by the GPU's PCI address), their replica ids,
//! the CDI spec, and the pair matrix that preferred allocation searches (NVLink count and PCIe
//! level, scored as go-gpuallocator scores them; MIG devices only have NUMA).

use super::driver_files::DriverFiles;
use super::seam::{GiProfile, GpuInfo, MigInfo, Snapshot};
use super::settings::{MigStrategy, NvidiaSettings};
use crate::dra_attributes::Attributes;
use crate::placement::PairMatrix;
use crate::replicas::ShareInfo;
use crate::sysfs::{dev_node, numa_node};
use devplug::cdi::Spec;
use devplug::dra::{
    CapacityRequestPolicy, CounterConsumption, CounterSet, DeviceAttributes, MAX_COUNTER_SETS,
};
use devplug::ContainerEdits;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

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

/// Where the MIG caps minors are listed, under the proc root.
pub const MIG_MINORS: &str = "driver/nvidia-caps/mig-minors";

/// One served unit: a whole GPU, a MIG device of it, or a MIG partition of it made per claim.
#[derive(Debug, Clone)]
pub struct ServedGpu {
    /// What NVML said about the GPU (the parent, for a MIG device or partition): its health,
    /// node and NUMA node are the unit's.
    pub info: GpuInfo,
    /// What of the GPU this unit is.
    pub kind: UnitKind,
    /// NUMA node from sysfs.
    pub numa: Option<i64>,
    /// Its device ids: the UUID, or `<uuid>::<n>` for each replica.
    pub ids: Vec<String>,
    /// Its DRA attributes and capacity (every replica has the same).
    pub attributes: Option<Box<DeviceAttributes>>,
}

/// What of a GPU a served unit is.
#[derive(Debug, Clone)]
pub enum UnitKind {
    /// The whole GPU.
    Gpu,
    /// A MIG device that exists (`mig_strategy` `single` or `mixed`).
    Mig {
        /// The MIG device.
        mig: MigInfo,
        /// Its GI and CI access nodes, relative to /dev (`nvidia-caps/nvidia-cap<minor>`).
        caps: Vec<PathBuf>,
    },
    /// A MIG partition created at allocation (`mig_strategy: dynamic`): its MIG device exists
    /// only once created.
    Partition(Partition),
}

/// A MIG partition that can be created: a GPU-instance profile at one placement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partition {
    /// The profile, as NVML gives it.
    pub profile: GiProfile,
    /// Its name as NVIDIA names MIG devices (`3g.20gb`).
    pub name: String,
    /// The first memory slice.
    pub start: u32,
    /// How many memory slices it spans.
    pub size: u32,
}

/// The counter of one memory slice of a GPU in MIG mode (`mig_strategy: dynamic`).
fn memory_slice_counter(slice: u32) -> String {
    format!("memory-slice-{slice}")
}

/// The counter of a GPU's compute slices (`mig_strategy: dynamic`).
pub const COMPUTE_SLICES: &str = "compute-slices";

/// The counter set of a GPU in MIG mode: `gpu-<index>`.
fn gpu_counter_set(gpu: &GpuInfo) -> String {
    format!("gpu-{}", gpu.index)
}

/// A partition's device id: `gpu-<index>-mig-<profile>-<start>` with the profile's dot as a
/// dash (`gpu-0-mig-3g-20gb-4`), a DNS label as the ResourceSlice names devices.
pub fn partition_id(gpu: &GpuInfo, name: &str, start: u32) -> String {
    format!("gpu-{}-mig-{}-{start}", gpu.index, name.replace('.', "-"))
}

/// The counter set of a GPU in MIG mode (one counter per memory slice, and its compute slices)
/// and its partitions, each consuming its memory slices and compute slices; `None` when NVML
/// gave no profiles for it.
fn partitions_of(gpu: &GpuInfo) -> Option<(CounterSet, Vec<Partition>)> {
    let memory_slices = gpu
        .mig_profiles
        .iter()
        .flat_map(|p| {
            p.placements
                .iter()
                .map(|&(start, size)| start.saturating_add(size))
        })
        .max()?;
    let compute = gpu.mig_profiles.iter().map(|p| p.slices).max()?;
    let mut counters: BTreeMap<String, u64> = (0..memory_slices)
        .map(|s| (memory_slice_counter(s), 1))
        .collect();
    counters.insert(COMPUTE_SLICES.into(), u64::from(compute));
    let set = CounterSet {
        name: gpu_counter_set(gpu),
        counters,
    };
    let mut parts: Vec<Partition> = Vec::new();
    for profile in &gpu.mig_profiles {
        let name =
            super::seam::mig_profile(profile.slices, 0, profile.memory_mib, gpu.memory_bytes);
        for &(start, size) in &profile.placements {
            // Two profiles of one name and placement would be one device id: the first wins.
            if parts.iter().any(|p| p.name == name && p.start == start) {
                continue;
            }
            parts.push(Partition {
                profile: profile.clone(),
                name: name.clone(),
                start,
                size,
            });
        }
    }
    Some((set, parts))
}

/// What a partition consumes of its GPU's counter set.
fn partition_consumes(gpu: &GpuInfo, part: &Partition) -> CounterConsumption {
    let mut counters: BTreeMap<String, u64> = (part.start..part.start.saturating_add(part.size))
        .map(|s| (memory_slice_counter(s), 1))
        .collect();
    counters.insert(COMPUTE_SLICES.into(), u64::from(part.profile.slices));
    CounterConsumption {
        set: gpu_counter_set(gpu),
        counters,
    }
}

impl ServedGpu {
    /// The UUID a container is given: the MIG device's, else the GPU's (a partition's MIG
    /// device has its UUID only once created).
    pub fn uuid(&self) -> &str {
        match &self.kind {
            UnitKind::Mig { mig, .. } => &mig.uuid,
            UnitKind::Gpu | UnitKind::Partition(_) => &self.info.uuid,
        }
    }

    /// Its nodes relative to /dev: the GPU's `nvidia<minor>`, then a MIG device's caps nodes
    /// (a partition's are known only once it is created).
    pub fn nodes(&self) -> Vec<PathBuf> {
        let mut out = vec![View::gpu_node(&self.info)];
        match &self.kind {
            UnitKind::Mig { caps, .. } => out.extend(caps.iter().cloned()),
            UnitKind::Gpu | UnitKind::Partition(_) => {}
        }
        out
    }

    /// The MIG partition this unit is, if it is one.
    pub fn partition(&self) -> Option<&Partition> {
        match &self.kind {
            UnitKind::Partition(part) => Some(part),
            UnitKind::Gpu | UnitKind::Mig { .. } => None,
        }
    }
}

/// Parses `mig-minors` (`gpu<minor>/gi<g>/access <m>`, `gpu<minor>/gi<g>/ci<c>/access <m>`,
/// plus `config`/`monitor` lines) into name → minor.
pub fn parse_mig_minors(text: &str) -> HashMap<String, u32> {
    text.lines()
        .filter_map(|line| {
            let (name, minor) = line.trim().rsplit_once(char::is_whitespace)?;
            Some((name.trim().to_owned(), minor.trim().parse().ok()?))
        })
        .collect()
}

/// A MIG device's caps nodes (GI access, CI access), or what is missing.
pub(super) fn caps_nodes(
    minors: &HashMap<String, u32>,
    gpu: &GpuInfo,
    mig: &MigInfo,
) -> Result<Vec<PathBuf>, String> {
    let gi = format!("gpu{}/gi{}/access", gpu.minor, mig.gi);
    let ci = format!("gpu{}/gi{}/ci{}/access", gpu.minor, mig.gi, mig.ci);
    [gi, ci]
        .iter()
        .map(|name| {
            minors
                .get(name)
                .map(|m| PathBuf::from(format!("nvidia-caps/nvidia-cap{m}")))
                .ok_or_else(|| format!("{MIG_MINORS} has no {name}"))
        })
        .collect()
}

/// What a resource serves of one GPU: the GPU itself, or some of its MIG devices.
struct Unit {
    /// Position in the snapshot.
    pos: usize,
    mig: Option<MigInfo>,
}

/// The units a resource serves by its MIG strategy, or why it serves none.
fn units(settings: &NvidiaSettings, snapshot: &Snapshot) -> Result<Vec<Unit>, String> {
    let chosen: Vec<usize> = (0..snapshot.gpus.len())
        .filter(|&i| selected(settings, &snapshot.gpus[i]))
        .collect();
    let whole = |keep: &dyn Fn(&GpuInfo) -> bool| -> Vec<Unit> {
        chosen
            .iter()
            .filter(|&&p| keep(&snapshot.gpus[p]))
            .map(|&pos| Unit { pos, mig: None })
            .collect()
    };
    let migs = |keep: &dyn Fn(&MigInfo) -> bool| -> Vec<Unit> {
        chosen
            .iter()
            .flat_map(|&pos| {
                snapshot.gpus[pos]
                    .migs
                    .iter()
                    .filter(|m| keep(m))
                    .map(move |m| Unit {
                        pos,
                        mig: Some(m.clone()),
                    })
            })
            .collect()
    };
    match (settings.mig_strategy, &settings.mig_profile) {
        (MigStrategy::None, _) => Ok(whole(&|_| true)),
        // GPUs in MIG mode are served as partitions (`View::build`).
        (MigStrategy::Dynamic, _) => Ok(whole(&|g| !g.mig_enabled)),
        (MigStrategy::Mixed, None) => Ok(whole(&|g| !g.mig_enabled)),
        (MigStrategy::Mixed, Some(profile)) => Ok(migs(&|m| m.profile == *profile)),
        (MigStrategy::Single, _) => {
            let on: Vec<&GpuInfo> = chosen
                .iter()
                .map(|&p| &snapshot.gpus[p])
                .filter(|g| g.mig_enabled)
                .collect();
            if on.is_empty() {
                // NVIDIA's single strategy with no GPU in MIG mode serves the GPUs.
                return Ok(whole(&|_| true));
            }
            if let Some(off) = chosen
                .iter()
                .map(|&p| &snapshot.gpus[p])
                .find(|g| !g.mig_enabled)
            {
                return Err(format!(
                    "mig_strategy single: GPU {} ({}) is not in MIG mode while others are; \
                     enable MIG on it, leave it out (models/exclude_models), or use mixed",
                    off.index, off.uuid
                ));
            }
            let profiles: BTreeSet<&str> = on
                .iter()
                .flat_map(|g| g.migs.iter().map(|m| m.profile.as_str()))
                .collect();
            if profiles.len() > 1 {
                let list: Vec<&str> = profiles.into_iter().collect();
                return Err(format!(
                    "mig_strategy single needs one MIG profile, the GPUs have {}; use mixed",
                    list.join(", ")
                ));
            }
            Ok(migs(&|_| true))
        }
    }
}

/// The capacity of a GPU shared through MPS that stands for its SMs, in percent.
pub const MPS_CORES: &str = "cores";

/// The DRA attributes of a GPU or a MIG device of it ([`crate::dra_attributes`]), named as
/// NVIDIA's DRA driver names them; `sysfs` is the GPU's canonical sysfs folder.
fn dra_attributes(
    gpu: &GpuInfo,
    mig: Option<&MigInfo>,
    sysfs: &Path,
    memory_step: Option<u64>,
) -> Option<Box<DeviceAttributes>> {
    let common = Attributes::default()
        .string("productName", &gpu.name)
        .int("index", i64::from(gpu.index))
        .int("minor", i64::from(gpu.minor))
        .pci(&gpu.bus_id, Some(sysfs));
    match mig {
        // A whole GPU shared through MPS: 100 cores (percent of its SMs) and its memory.
        None if memory_step.is_some() => common
            .string("type", "gpu")
            .string("uuid", &gpu.uuid)
            .shared(MPS_CORES, 100, CapacityRequestPolicy::steps_of(1))
            .shared(
                "memory",
                gpu.memory_bytes,
                CapacityRequestPolicy::steps_of(memory_step.unwrap_or(1)),
            ),
        None => common
            .string("type", "gpu")
            .string("uuid", &gpu.uuid)
            .capacity("memory", gpu.memory_bytes),
        Some(mig) => common
            .string("type", "mig")
            .string("uuid", &mig.uuid)
            .string("parentUUID", &gpu.uuid)
            .string("profile", &mig.profile)
            .capacity("memory", mig.memory_bytes),
    }
    .build()
}

/// The DRA attributes of a MIG partition that is created at allocation, named as for a MIG
/// device, plus where it is placed, and what it consumes of its GPU's counter set.
fn partition_attributes(
    gpu: &GpuInfo,
    part: &Partition,
    sysfs: &Path,
) -> Option<Box<DeviceAttributes>> {
    let mut attributes = Attributes::default()
        .string("productName", &gpu.name)
        .int("index", i64::from(gpu.index))
        .int("minor", i64::from(gpu.minor))
        .pci(&gpu.bus_id, Some(sysfs))
        .string("type", "mig")
        .string("parentUUID", &gpu.uuid)
        .string("profile", &part.name)
        .int("placementStart", i64::from(part.start))
        .int("placementSize", i64::from(part.size))
        .capacity("memory", part.profile.memory_mib.saturating_mul(1 << 20))
        .build()?;
    attributes.consumes.push(partition_consumes(gpu, part));
    Some(attributes)
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
    /// Why this resource serves less than it should (a MIG layout its strategy cannot serve,
    /// `mig-minors` unreadable), if so: the backend reports it as not ready.
    pub problem: Option<String>,
    /// The driver's user-space files every container with a GPU gets, if given.
    pub driver: Option<Arc<DriverFiles>>,
    /// The counter sets of GPUs served as MIG partitions (`mig_strategy: dynamic`).
    pub counter_sets: Vec<CounterSet>,
    /// The driver version NVML reports (`570.86.15`), for the node labels.
    pub driver_version: Option<String>,
    /// The newest CUDA version the driver supports, for the node labels.
    pub cuda_version: Option<(u32, u32)>,
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
    /// The GPU (or MIG device) served as `id`, or the error a request naming it gets.
    pub fn served(&self, id: &str) -> Result<&ServedGpu, devplug::AllocateError> {
        self.index
            .get(id)
            .and_then(|&i| self.gpus.get(i))
            .ok_or_else(|| {
                devplug::AllocateError::InvalidRequest(format!(
                    "device {id:?} is no longer present"
                ))
            })
    }

    /// Every device id with its GPU (the position in `gpus`) and NUMA node, for
    /// [`crate::replicas::prefer`].
    pub fn shares(&self) -> HashMap<String, ShareInfo> {
        self.index
            .iter()
            .filter_map(|(id, &g)| {
                let numa = self.gpus.get(g)?.numa;
                Some((id.clone(), ShareInfo { physical: g, numa }))
            })
            .collect()
    }

    /// The view of `snapshot` for a resource with these settings.
    pub fn build(settings: &NvidiaSettings, snapshot: &Snapshot) -> View {
        let addresses: Vec<&str> = snapshot.gpus.iter().map(|g| g.bus_id.as_str()).collect();
        let (mut units, mut problem) = match units(settings, snapshot) {
            Ok(u) => (u, None),
            Err(e) => (Vec::new(), Some(e)),
        };
        let minors = if units.iter().any(|u| u.mig.is_some()) {
            let path = settings.proc_root.join(MIG_MINORS);
            match std::fs::read_to_string(&path) {
                Ok(text) => parse_mig_minors(&text),
                Err(e) => {
                    problem = Some(format!(
                        "cannot read {}: {e}; MIG devices need their caps nodes",
                        path.display()
                    ));
                    units.retain(|u| u.mig.is_none());
                    HashMap::new()
                }
            }
        } else {
            HashMap::new()
        };
        let mut positions = Vec::new();
        let mut gpus = Vec::new();
        let mut index = HashMap::new();
        let mut shared = false;
        for unit in units {
            let p = unit.pos;
            let info = snapshot.gpus[p].clone();
            let kind = match &unit.mig {
                Some(mig) => match caps_nodes(&minors, &info, mig) {
                    Ok(caps) => UnitKind::Mig {
                        mig: mig.clone(),
                        caps,
                    },
                    Err(why) => {
                        tracing::warn!(mig = %mig.uuid, %why, "MIG device left out: its caps nodes are unknown");
                        continue;
                    }
                },
                None => UnitKind::Gpu,
            };
            let device = settings.sys_root.join("bus/pci/devices").join(&info.bus_id);
            let device = std::fs::canonicalize(&device).unwrap_or(device);
            let numa = numa_node(&settings.sys_root, &device);
            let memory_step = settings
                .share
                .as_ref()
                .and_then(|s| s.memory_step_bytes().ok());
            let attributes = dra_attributes(&info, unit.mig.as_ref(), &device, memory_step);
            let n = replicas_for(settings, &info);
            shared |= n > 1;
            let uuid = unit.mig.map_or_else(|| info.uuid.clone(), |m| m.uuid);
            let ids: Vec<String> = if n == 1 {
                vec![uuid]
            } else {
                (0..n).map(|k| format!("{uuid}::{k}")).collect()
            };
            for id in &ids {
                index.insert(id.clone(), gpus.len());
            }
            positions.push(p);
            gpus.push(ServedGpu {
                info,
                kind,
                numa,
                ids,
                attributes,
            });
        }
        let mut counter_sets = Vec::new();
        if settings.mig_strategy == MigStrategy::Dynamic {
            for (p, gpu) in snapshot.gpus.iter().enumerate() {
                if !gpu.mig_enabled || !selected(settings, gpu) {
                    continue;
                }
                let Some((set, parts)) = partitions_of(gpu) else {
                    problem = Some(format!(
                        "GPU {} ({}) is in MIG mode and NVML gave no MIG profiles for it: it \
                         serves no partitions",
                        gpu.index, gpu.uuid
                    ));
                    continue;
                };
                if counter_sets.len() >= MAX_COUNTER_SETS {
                    problem = Some(format!(
                        "GPU {} ({}) is left out: at most {MAX_COUNTER_SETS} GPUs in MIG mode \
                         can be partitioned by one resource (a ResourceSlice holds \
                         {MAX_COUNTER_SETS} counter sets); select fewer with models",
                        gpu.index, gpu.uuid
                    ));
                    continue;
                }
                counter_sets.push(set);
                let device = settings.sys_root.join("bus/pci/devices").join(&gpu.bus_id);
                let device = std::fs::canonicalize(&device).unwrap_or(device);
                let numa = numa_node(&settings.sys_root, &device);
                for part in parts {
                    let id = partition_id(gpu, &part.name, part.start);
                    index.insert(id.clone(), gpus.len());
                    positions.push(p);
                    gpus.push(ServedGpu {
                        info: gpu.clone(),
                        numa,
                        ids: vec![id],
                        attributes: partition_attributes(gpu, &part, &device),
                        kind: UnitKind::Partition(part),
                    });
                }
            }
        }
        let numa: Vec<Option<i64>> = gpus.iter().map(|g| g.numa).collect();
        let any_mig = gpus.iter().any(|g| match g.kind {
            UnitKind::Gpu => false,
            UnitKind::Mig { .. } | UnitKind::Partition(_) => true,
        });
        let matrix = PairMatrix::from_fn(numa, |a, b| {
            if any_mig {
                // MIG devices share their GPU's links; only NUMA tells them apart.
                return 0;
            }
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
            problem,
            driver: None,
            counter_sets,
            driver_version: None,
            cuda_version: None,
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

    /// The driver's files as mounts (none when not given).
    pub fn driver_mounts(&self) -> Vec<devplug::Mount> {
        self.driver.as_ref().map(|d| d.mounts()).unwrap_or_default()
    }

    /// The CDI spec: one device per GPU or MIG device (named by UUID) with its nodes (a MIG
    /// device: its GPU's node and its caps nodes), the control nodes as common edits.
    pub fn spec(&self, dev_root: &Path) -> Spec {
        let common = ContainerEdits {
            devices: Self::control_nodes(dev_root)
                .iter()
                .map(|n| dev_node(dev_root, n))
                .collect(),
            mounts: self.driver_mounts(),
            ..Default::default()
        };
        let mut spec = Spec::new(CDI_KIND).common(&common);
        // Partitions are not in it: their MIG devices exist only once created, and they are
        // given by their nodes then (`edits`).
        for gpu in &self.gpus {
            match gpu.kind {
                UnitKind::Gpu | UnitKind::Mig { .. } => {}
                UnitKind::Partition(_) => continue,
            }
            let edits = ContainerEdits {
                devices: gpu.nodes().iter().map(|n| dev_node(dev_root, n)).collect(),
                ..Default::default()
            };
            spec = spec.device(gpu.uuid().to_owned(), &edits);
        }
        spec
    }
}

#[cfg(test)]
mod tests;
