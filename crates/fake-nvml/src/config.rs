//! The topology file: the YAML that `nvmlInit` reads (GPUs, their links, MIG devices, layouts
//! and GPU-instance profiles), with the checks `Config::parse` makes, and what the GPU
//! instances of a MIG layout hold (`Occupied`), which the checks and the state share.

use crate::abi::{GI_PROFILE_COUNT, MAX_INSTANCE_ID, MAX_LINKS, MAX_MIG_DEVICES, SMS_PER_SLICE};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::ffi::c_int;
use std::path::PathBuf;

/// The topology file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// What `nvmlSystemGetDriverVersion` answers.
    #[serde(default = "default_driver_version")]
    pub driver_version: String,
    /// What `nvmlSystemGetCudaDriverVersion_v2` answers, `<major>.<minor>` (default `12.8`,
    /// driver 570's).
    #[serde(default = "default_cuda_version")]
    pub cuda_version: String,
    /// The fault-injection file (relative paths are relative to the config file).
    #[serde(default)]
    pub control: Option<PathBuf>,
    /// A file that every successful `nvmlInit` appends a line to (relative paths are relative
    /// to the config file).
    #[serde(default)]
    pub init_log: Option<PathBuf>,
    /// While this file exists, NVML is broken as after a driver upgrade without a reboot:
    /// `nvmlInit` fails with `LIB_RM_VERSION_MISMATCH` and every other call with `UNKNOWN`
    /// (relative paths are relative to the config file). Unlike the control file's faults it
    /// outlives `nvmlShutdown`.
    #[serde(default)]
    pub broken_while: Option<PathBuf>,
    /// Whether the driver has the GPU recovery action (field 230 and event 0x8000).
    #[serde(default = "yes")]
    pub recovery_action: bool,
    /// The GPUs, in index order.
    pub gpus: Vec<GpuConfig>,
}

/// One GPU of the topology.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuConfig {
    /// `GPU-…` UUID.
    pub uuid: String,
    /// Product name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// Minor number (`/dev/nvidia<minor>`); default: the index.
    #[serde(default)]
    pub minor: Option<u32>,
    /// Memory in MiB.
    pub memory_mib: u64,
    /// CUDA compute capability `<major>.<minor>` (`nvmlDeviceGetCudaComputeCapability`);
    /// default: the capability of the model `name` names (V100 7.0, A100 8.0, L4 and L40S 8.9,
    /// H100 and H200 9.0, B200 10.0), else `NOT_SUPPORTED`.
    #[serde(default)]
    pub compute_capability: Option<String>,
    /// PCI bus id with an 8-hex domain, e.g. `00000000:06:00.0`.
    pub bus_id: String,
    /// NUMA node (for the PCIe level between GPUs; sysfs is what devplug reads).
    #[serde(default)]
    pub numa: i64,
    /// Host bridge id: GPUs under the same one are `HOSTBRIDGE` apart.
    #[serde(default)]
    pub host_bridge: Option<u32>,
    /// PCIe switch id: GPUs under the same one are `SINGLE` apart.
    #[serde(default)]
    pub switch: Option<u32>,
    /// One entry per NVLink: the index of the GPU at the other end.
    #[serde(default)]
    pub nvlinks: Vec<u32>,
    /// One entry per NVLink to an NVSwitch: the switch's PCI bus id.
    #[serde(default)]
    pub nvswitch_links: Vec<String>,
    /// MIG mode: absent = not supported, `false` = off, `true` = on.
    #[serde(default)]
    pub mig: Option<bool>,
    /// The MIG devices while MIG is on.
    #[serde(default)]
    pub mig_devices: Vec<MigDeviceConfig>,
    /// Layouts the control line `mig <gpu> <layout>` switches to.
    #[serde(default)]
    pub mig_layouts: BTreeMap<String, Vec<MigDeviceConfig>>,
    /// The GPU-instance profiles for creating MIG instances at run time (needs `mig`).
    #[serde(default)]
    pub mig_profiles: Vec<MigProfileConfig>,
    /// Compute slices that all GPU instances share; default: the most slices of a profile.
    #[serde(default)]
    pub compute_slices: Option<u32>,
    /// Memory slices that placements index; default: the furthest end of a placement.
    #[serde(default)]
    pub memory_slices: Option<u32>,
}

/// One GPU-instance profile (`NVML_GPU_INSTANCE_PROFILE_*`) of a MIG-capable GPU.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigProfileConfig {
    /// Profile id, below `NVML_GPU_INSTANCE_PROFILE_COUNT` (17), e.g. 0 for A100's 1g.5gb.
    pub id: u32,
    /// Compute slices of an instance (the `<g>` of `<g>g.<m>gb`).
    pub slices: u32,
    /// Memory of an instance in MiB.
    pub memory_mib: u64,
    /// Streaming multiprocessors of an instance; default: 14 per slice (A100).
    #[serde(default)]
    pub multiprocessors: Option<u32>,
    /// Where an instance may go, in memory slices (`nvmlDeviceGetGpuInstancePossiblePlacements`).
    pub placements: Vec<PlacementConfig>,
}

/// A GPU-instance placement: memory slices `[start, start + size)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlacementConfig {
    /// First memory slice.
    pub start: u32,
    /// Number of memory slices.
    pub size: u32,
}

impl MigProfileConfig {
    pub(crate) fn multiprocessors(&self) -> u32 {
        self.multiprocessors
            .unwrap_or(self.slices.saturating_mul(SMS_PER_SLICE))
    }
}

impl GpuConfig {
    pub(crate) fn profile(&self, id: u32) -> Option<&MigProfileConfig> {
        self.mig_profiles.iter().find(|p| p.id == id)
    }

    pub(crate) fn compute_slices(&self) -> u32 {
        self.compute_slices.unwrap_or_else(|| {
            self.mig_profiles
                .iter()
                .map(|p| p.slices)
                .max()
                .unwrap_or(0)
        })
    }

    pub(crate) fn memory_slices(&self) -> u32 {
        self.memory_slices.unwrap_or_else(|| {
            self.mig_profiles
                .iter()
                .flat_map(|p| &p.placements)
                .map(|pl| pl.start.saturating_add(pl.size))
                .max()
                .unwrap_or(0)
        })
    }

    /// The memory slices a static MIG device's GPU instance holds: the placement at its
    /// `start` of the profile with its slices and memory. `None` without `start`.
    pub(crate) fn static_placement(&self, dev: &MigDeviceConfig) -> Option<PlacementConfig> {
        let start = dev.start?;
        self.mig_profiles
            .iter()
            .filter(|p| p.slices == dev.slices && p.memory_mib == dev.memory_mib)
            .flat_map(|p| &p.placements)
            .find(|pl| pl.start == start)
            .copied()
    }
}

/// What the GPU instances of a MIG layout hold: compute slices, memory placements, GI ids.
#[derive(Default)]
pub(crate) struct Occupied {
    pub(crate) compute: u32,
    pub(crate) memory: Vec<PlacementConfig>,
    pub(crate) ids: Vec<u32>,
}

impl Occupied {
    /// Adds a GPU instance unless its id is already there (several compute instances of one
    /// GPU instance are several MIG devices).
    pub(crate) fn add(&mut self, id: u32, slices: u32, placement: Option<PlacementConfig>) {
        if self.ids.contains(&id) {
            return;
        }
        self.ids.push(id);
        self.compute = self.compute.saturating_add(slices);
        self.memory.extend(placement);
    }

    /// Whether a GPU instance of `slices` at `placement` fits next to these on `gpu`.
    pub(crate) fn fits(&self, gpu: &GpuConfig, slices: u32, placement: PlacementConfig) -> bool {
        let end = |p: &PlacementConfig| p.start.saturating_add(p.size);
        let overlaps = self
            .memory
            .iter()
            .any(|m| m.start < end(&placement) && placement.start < end(m));
        !overlaps && self.compute.saturating_add(slices) <= gpu.compute_slices()
    }

    /// The lowest GPU-instance id from 1 that is not taken.
    pub(crate) fn free_id(&self) -> u32 {
        (1..=MAX_INSTANCE_ID)
            .find(|id| !self.ids.contains(id))
            .unwrap_or(u32::MAX)
    }
}

/// What the static MIG devices `devices` hold on `gpu` (see `MigDeviceConfig::start`).
pub(crate) fn static_occupied<'a>(
    gpu: &GpuConfig,
    devices: impl IntoIterator<Item = &'a MigDeviceConfig>,
) -> Occupied {
    let mut occupied = Occupied::default();
    for dev in devices {
        occupied.add(dev.gi, dev.slices, gpu.static_placement(dev));
    }
    occupied
}

/// One MIG device.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigDeviceConfig {
    /// `MIG-…` UUID.
    pub uuid: String,
    /// GPU instance id.
    pub gi: u32,
    /// Compute instance id.
    #[serde(default)]
    pub ci: u32,
    /// GPU-instance slices (the `<g>` of `<g>g.<m>gb`).
    pub slices: u32,
    /// Compute-instance slices; default: all of the GPU instance's.
    #[serde(default)]
    pub ci_slices: Option<u32>,
    /// Memory in MiB.
    pub memory_mib: u64,
    /// First memory slice of its GPU instance (needs a `mig_profiles` entry with its slices
    /// and memory and a placement there). With it, the GPU instance holds that placement's
    /// memory slices; without it, only its compute slices count against instances created at
    /// run time.
    #[serde(default)]
    pub start: Option<u32>,
}

pub(crate) fn default_driver_version() -> String {
    "570.86.15".to_owned()
}

pub(crate) fn default_cuda_version() -> String {
    "12.8".to_owned()
}

/// `<major>.<minor>` as two numbers.
pub(crate) fn version_pair(text: &str) -> Option<(c_int, c_int)> {
    let (major, minor) = text.trim().split_once('.')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

impl GpuConfig {
    /// The compute capability given, or that of the model the name names.
    pub(crate) fn compute_capability(&self) -> Option<(c_int, c_int)> {
        if let Some(given) = &self.compute_capability {
            return version_pair(given);
        }
        const MODELS: [(&str, (c_int, c_int)); 7] = [
            ("V100", (7, 0)),
            ("A100", (8, 0)),
            ("L40S", (8, 9)),
            ("L4", (8, 9)),
            ("H100", (9, 0)),
            ("H200", (9, 0)),
            ("B200", (10, 0)),
        ];
        MODELS
            .iter()
            .find(|(model, _)| self.name.contains(model))
            .map(|(_, cc)| *cc)
    }
}

pub(crate) fn yes() -> bool {
    true
}

impl Config {
    /// Parses a topology file's text.
    pub fn parse(text: &str) -> Result<Config, String> {
        let config: Config = serde_saphyr::from_str(text).map_err(|e| e.to_string())?;
        for (i, gpu) in config.gpus.iter().enumerate() {
            let links = gpu.nvlinks.len().saturating_add(gpu.nvswitch_links.len());
            if links > MAX_LINKS as usize {
                return Err(format!("gpus[{i}]: {links} NVLinks, at most {MAX_LINKS}"));
            }
            let layouts = std::iter::once(&gpu.mig_devices).chain(gpu.mig_layouts.values());
            if let Some(layout) = layouts
                .into_iter()
                .find(|l| l.len() > MAX_MIG_DEVICES as usize)
            {
                return Err(format!(
                    "gpus[{i}]: {} MIG devices, at most {MAX_MIG_DEVICES}",
                    layout.len()
                ));
            }
            if gpu.mig != Some(true) && !gpu.mig_devices.is_empty() {
                return Err(format!("gpus[{i}]: mig_devices without mig: true"));
            }
            check_mig_profiles(gpu).map_err(|e| format!("gpus[{i}]: {e}"))?;
            if let Some(bad) = gpu
                .nvlinks
                .iter()
                .find(|&&r| r as usize >= config.gpus.len())
            {
                return Err(format!("gpus[{i}].nvlinks: no GPU {bad}"));
            }
        }
        Ok(config)
    }
}

/// Checks `mig_profiles`, `compute_slices`, `memory_slices` and the static devices' `start`.
pub(crate) fn check_mig_profiles(gpu: &GpuConfig) -> Result<(), String> {
    let layouts: Vec<&Vec<MigDeviceConfig>> = std::iter::once(&gpu.mig_devices)
        .chain(gpu.mig_layouts.values())
        .collect();
    if gpu.mig_profiles.is_empty() {
        if gpu.compute_slices.is_some() || gpu.memory_slices.is_some() {
            return Err("compute_slices or memory_slices without mig_profiles".into());
        }
        if let Some(dev) = layouts
            .iter()
            .flat_map(|l| l.iter())
            .find(|d| d.start.is_some())
        {
            return Err(format!(
                "MIG device {}: start without mig_profiles",
                dev.uuid
            ));
        }
        return Ok(());
    }
    if gpu.mig.is_none() {
        return Err("mig_profiles without mig".into());
    }
    let (compute, memory) = (gpu.compute_slices(), gpu.memory_slices());
    for (n, profile) in gpu.mig_profiles.iter().enumerate() {
        let id = profile.id;
        if id >= GI_PROFILE_COUNT {
            return Err(format!(
                "mig_profiles[{n}]: id {id}, at most {}",
                GI_PROFILE_COUNT - 1
            ));
        }
        if gpu.mig_profiles[..n].iter().any(|p| p.id == id) {
            return Err(format!("mig_profiles[{n}]: id {id} twice"));
        }
        if profile.slices == 0 || profile.slices > compute {
            return Err(format!(
                "mig_profiles[{n}]: {} slices, not in 1..={compute} (compute_slices)",
                profile.slices
            ));
        }
        for pl in &profile.placements {
            let end = pl.start.checked_add(pl.size);
            if pl.size == 0 || end.is_none_or(|end| end > memory) {
                return Err(format!(
                    "mig_profiles[{n}]: placement {{start: {}, size: {}}} beyond memory_slices {memory}",
                    pl.start, pl.size
                ));
            }
        }
    }
    for layout in layouts {
        if let Some(dev) = layout
            .iter()
            .find(|d| d.start.is_some() && gpu.static_placement(d).is_none())
        {
            return Err(format!(
                "MIG device {}: start {:?} is no placement of a profile with {} slices and {} MiB",
                dev.uuid, dev.start, dev.slices, dev.memory_mib
            ));
        }
        // The layout's GPU instances must fit the GPU as created ones would.
        let mut occupied = Occupied::default();
        for dev in layout {
            if occupied.ids.contains(&dev.gi) {
                continue;
            }
            let placement = gpu.static_placement(dev);
            let fits = match placement {
                Some(pl) => occupied.fits(gpu, dev.slices, pl),
                None => occupied.compute.saturating_add(dev.slices) <= compute,
            };
            if !fits {
                return Err(format!(
                    "MIG device {}: its GPU instance does not fit next to the others \
                     ({compute} compute slices, memory placements may not overlap)",
                    dev.uuid
                ));
            }
            occupied.add(dev.gi, dev.slices, placement);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::path::Path;

    #[test]
    fn shipped_topologies_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("topologies");
        let mut names = Vec::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let config = Config::parse(&std::fs::read_to_string(&path).unwrap())
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            // Links are symmetric: i lists j as often as j lists i.
            for (i, gpu) in config.gpus.iter().enumerate() {
                for &j in &gpu.nvlinks {
                    let there = config.gpus[j as usize]
                        .nvlinks
                        .iter()
                        .filter(|&&k| k as usize == i)
                        .count();
                    let here = gpu.nvlinks.iter().filter(|&&k| k == j).count();
                    assert_eq!(here, there, "{}: links {i}-{j}", path.display());
                }
            }
            names.push(path.file_name().unwrap().to_string_lossy().into_owned());
        }
        names.sort();
        assert_eq!(
            names,
            [
                "a100-mig.yaml",
                "a100-partitions.yaml",
                "dgx-h100.yaml",
                "dgx1-v100.yaml",
                "pcie-4gpu.yaml"
            ]
        );
    }

    #[test]
    fn too_many_links_or_a_missing_peer_are_refused() {
        let many = format!(
            "gpus:\n  - {{uuid: GPU-a, name: x, memory_mib: 1, bus_id: '00000000:01:00.0', nvlinks: [{}]}}\n",
            ["0"; 19].join(",")
        );
        assert!(Config::parse(&many).unwrap_err().contains("at most 18"));
        let missing = "gpus:\n  - {uuid: GPU-a, name: x, memory_mib: 1, bus_id: '00000000:01:00.0', nvlinks: [3]}\n";
        assert!(Config::parse(missing).unwrap_err().contains("no GPU 3"));
    }

    #[test]
    fn mig_devices_need_mig_on_and_fit_in_seven_slots() {
        let one = "{uuid: MIG-a, gi: 7, slices: 1, memory_mib: 4864}";
        let off = format!(
            "gpus:\n  - {{uuid: GPU-a, name: x, memory_mib: 1, bus_id: '00000000:01:00.0', mig: false, mig_devices: [{one}]}}\n"
        );
        assert!(Config::parse(&off)
            .unwrap_err()
            .contains("without mig: true"));
        let eight = format!(
            "gpus:\n  - {{uuid: GPU-a, name: x, memory_mib: 1, bus_id: '00000000:01:00.0', mig: true, mig_layouts: {{big: [{}]}}}}\n",
            [one; 8].join(",")
        );
        assert!(Config::parse(&eight).unwrap_err().contains("at most 7"));
        let ok = format!(
            "gpus:\n  - {{uuid: GPU-a, name: x, memory_mib: 1, bus_id: '00000000:01:00.0', mig: true, mig_devices: [{one}]}}\n"
        );
        let config = Config::parse(&ok).unwrap();
        assert_eq!(config.gpus[0].mig_devices[0].ci_slices, None);
    }

    #[test]
    fn bad_mig_profiles_are_refused() {
        let gpu = |extra: &str| {
            format!(
                "gpus:\n  - {{uuid: GPU-a, name: x, memory_mib: 1, bus_id: '00000000:01:00.0', {extra}}}\n"
            )
        };
        let one = "{id: 0, slices: 1, memory_mib: 10, placements: [{start: 0, size: 1}]}";
        let err = |extra: &str| Config::parse(&gpu(extra)).unwrap_err();
        assert!(err(&format!("mig_profiles: [{one}]")).contains("mig_profiles without mig"));
        assert!(err(&format!("mig: true, mig_profiles: [{one}, {one}]")).contains("id 0 twice"));
        assert!(err(&format!(
            "mig: true, memory_slices: 0, mig_profiles: [{one}]"
        ))
        .contains("beyond memory_slices 0"));
        assert!(err(
            "mig: true, mig_profiles: [{id: 17, slices: 1, memory_mib: 1, placements: []}]"
        )
        .contains("at most 16"));
        assert!(err(&format!(
            "mig: true, compute_slices: 0, mig_profiles: [{one}]"
        ))
        .contains("not in 1..=0"));
        assert!(err("mig: true, compute_slices: 7").contains("without mig_profiles"));
        let dev = "{uuid: MIG-a, gi: 1, slices: 1, memory_mib: 10, start: 3}";
        assert!(err(&format!(
            "mig: true, mig_profiles: [{one}], mig_devices: [{dev}]"
        ))
        .contains("no placement"));
        let dev = "{uuid: MIG-a, gi: 1, slices: 1, memory_mib: 10, start: 0}";
        let twice = format!("{dev}, {}", dev.replace("gi: 1", "gi: 2"));
        assert!(err(&format!(
            "mig: true, compute_slices: 2, mig_profiles: [{one}], mig_devices: [{twice}]"
        ))
        .contains("does not fit"));
        Config::parse(&gpu(&format!(
            "mig: true, mig_profiles: [{one}], mig_devices: [{dev}]"
        )))
        .unwrap();
    }
}
