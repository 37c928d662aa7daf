//! A fake `libnvidia-ml.so.1`: the NVML C functions that `nvml-wrapper` calls, answering from a
//! YAML topology instead of a GPU, so tests and demos run devplug's real NVML loading path
//! (dlopen, symbol lookup, init, events) on a machine without NVIDIA hardware.
//!
//! **Why `unsafe` is allowed here and nowhere else in the workspace:** this crate *is* a C
//! library. NVML's ABI hands us raw out-pointers (`unsigned int *count`, `char *name`,
//! `nvmlEventData_t *data`) and the exported functions must be `#[no_mangle] extern "C"`; writing
//! through those pointers cannot be done in safe Rust. Every `unsafe` block below only writes
//! one value of the caller's declared type through a pointer the caller passed, after a null
//! check, reads one such value (an in/out count, a placement), writes a bounded string into a
//! buffer of the caller's stated length, or writes a bounded list (placements, instance
//! handles) into an array the caller sized as NVML's contract says. The rest
//! of devplug talks to this library through `nvml-wrapper`'s safe API, exactly as it talks to
//! the real one.
//!
//! **Configuration.** The YAML file named in `FAKE_NVML_CONFIG`, or else `fake-nvml.yaml` next
//! to the loaded library (so tests that copy the library into a temporary driver root can run
//! in parallel, each with its own topology). See `topologies/*.yaml` for the shape. It is read
//! at `nvmlInit`; a missing or invalid file makes init fail with `DRIVER_NOT_LOADED` (the
//! message goes to stderr).
//!
//! **Faults at run time.** If the config names a `control` file, every complete line appended
//! to it is applied while a caller waits in `nvmlEventSetWait_v2` (it is read every 2 ms):
//!
//! | line | effect |
//! |---|---|
//! | `xid <gpu> <code> [action] [gi=<id>] [ci=<id>]` | a critical XID event; `action` sets the GPU recovery action; `gi=`/`ci=` fill the event's `gpuInstanceId`/`computeInstanceId` (else `0xFFFFFFFF`: not attributed to an instance) |
//! | `ecc <gpu> [action]` | a double-bit ECC event; `action` sets the GPU recovery action |
//! | `action <gpu> <n>` | sets the GPU recovery action (field 230) and sends its event (0x8000) |
//! | `lost <gpu>` | the GPU falls off the bus: its calls fail `GPU_IS_LOST`, waits fail once |
//! | `found <gpu>` | the GPU answers again |
//! | `events broken` | event waits and registrations fail with `UNKNOWN` (a sick driver) |
//! | `events ok` | they work again |
//! | `mig <gpu> <layout>` | MIG on with the devices of `mig_layouts.<layout>`; sends `nvmlEventMigConfigChange` (0x100) |
//! | `mig <gpu> off` | MIG off; sends the same event |
//!
//! **Counting inits.** If the config names an `init_log` file (relative paths as `control`),
//! every successful `nvmlInit` appends one line to it, so a test can tell how often NVML was
//! opened.
//!
//! **MIG.** A GPU with `mig: true` is in MIG mode with `mig_devices` (UUID, GPU- and
//! compute-instance ids, slice counts, memory). Their handles answer UUID, name, memory,
//! attributes (slices and memory, for the profile name), the is-MIG query, the parent handle and
//! the GI/CI ids; `nvmlDeviceGetMaxMigDeviceCount` is 7 and empty slots answer `NOT_FOUND`.
//! `mig: false` is MIG-capable but off; without `mig` the GPU answers `NOT_SUPPORTED`.
//!
//! **MIG instances at run time.** A MIG-capable GPU may list `mig_profiles` (GPU-instance
//! profiles: `id`, `slices`, `memory_mib`, `multiprocessors` (default 14 per slice), and
//! `placements` in memory slices), with `compute_slices` (default: the most slices of a
//! profile) and `memory_slices` (default: the furthest placement end); see
//! `topologies/a100-partitions.yaml`. Then these work as on an A100:
//!
//! | function | answer |
//! |---|---|
//! | `nvmlDeviceGetGpuInstanceProfileInfo`, `…InfoV` | the profile, MIG on or off; engine counts as an A100's |
//! | `nvmlDeviceGetGpuInstancePossiblePlacements_v2` | all its placements, taken or not, MIG on or off |
//! | `nvmlDeviceCreateGpuInstanceWithPlacement` | MIG on; one of the profile's placements; its memory slices free and the compute slices enough, else `INSUFFICIENT_RESOURCES`; GI id the lowest free from 1 |
//! | `nvmlDeviceGetGpuInstances`, `nvmlDeviceGetGpuInstanceById` | the created GPU instances |
//! | `nvmlGpuInstanceGetInfo` | parent GPU handle, id, profile, placement |
//! | `nvmlGpuInstanceGetComputeInstanceProfileInfo` | compute profiles 0-7 (1, 2, 3, 4, 7, 8, 6, 1 slices) up to the GI's slices, shared engine profile only |
//! | `nvmlGpuInstanceCreateComputeInstance` | the first free compute slices of the GI; CI id the lowest free from 0; a MIG device appears in the first free slot |
//! | `nvmlGpuInstanceGetComputeInstances`, `nvmlComputeInstanceGetInfo_v2` | the GI's compute instances; placement in compute slices |
//! | `nvmlComputeInstanceDestroy` | its MIG device leaves its slot (a hole, `NOT_FOUND`) |
//! | `nvmlGpuInstanceDestroy` | `IN_USE` while it has compute instances |
//!
//! Each create and destroy sends `nvmlEventMigConfigChange`. The MIG device of a compute
//! instance answers like a static one (name from the GI's slices and memory, attributes with
//! the CI's slices, GI/CI ids) with a UUID `MIG-d<gpu>-<gi>-4<ci>-8…-<n>` from the GPU's
//! creation count `n`, so a re-created instance has a new UUID. Instance handles encode the
//! GPU, the ids and that count, apart from device and MIG handles (see `gi_handle`); a destroyed
//! instance's handle answers `INVALID_ARGUMENT`. The static `mig_devices` (and layouts) hold
//! their GPU instances' compute slices, and with `start` their placement's memory slices too;
//! they have no instance handles, so they are neither listed nor destroyable here. A `mig`
//! control line drops the created instances with the old layout. Created instances outlive
//! the last `nvmlShutdown` of the process, as on a GPU: the next `nvmlInit` takes them back
//! (by GPU UUID) if MIG is on and they still fit the topology it reads.
//!
//! `<gpu>` is an index or a UUID. Events reach only the event sets that registered the GPU for
//! that event type, as in NVML.

use nvml_wrapper_sys::bindings::{
    nvmlComputeInstanceInfo_t, nvmlComputeInstancePlacement_t, nvmlComputeInstanceProfileInfo_t,
    nvmlComputeInstance_t, nvmlDeviceAttributes_t, nvmlDevice_t, nvmlEnableState_t,
    nvmlEventData_t, nvmlEventSet_t, nvmlFieldValue_t, nvmlGpuInstanceInfo_t,
    nvmlGpuInstancePlacement_t, nvmlGpuInstanceProfileInfo_t, nvmlGpuInstanceProfileInfo_v2_t,
    nvmlGpuInstance_t, nvmlGpuTopologyLevel_t, nvmlMemory_v2_t, nvmlPciInfo_t, nvmlReturn_t,
};
use serde::Deserialize;
use std::collections::{BTreeMap, VecDeque};
use std::ffi::{c_char, c_int, c_uint, c_ulonglong, CStr};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

const SUCCESS: nvmlReturn_t = 0;
const UNINITIALIZED: nvmlReturn_t = 1;
const INVALID_ARGUMENT: nvmlReturn_t = 2;
const NOT_SUPPORTED: nvmlReturn_t = 3;
const NOT_FOUND: nvmlReturn_t = 6;
const INSUFFICIENT_SIZE: nvmlReturn_t = 7;
const DRIVER_NOT_LOADED: nvmlReturn_t = 9;
const TIMEOUT: nvmlReturn_t = 10;
const GPU_IS_LOST: nvmlReturn_t = 15;
const IN_USE: nvmlReturn_t = 19;
const INSUFFICIENT_RESOURCES: nvmlReturn_t = 23;
const UNKNOWN: nvmlReturn_t = 999;

/// `NVML_NVLINK_MAX_LINKS`.
const MAX_LINKS: u32 = 18;
/// `NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`.
const FIELD_RECOVERY_ACTION: u32 = 230;
/// `nvmlEventTypeSingleBitEccError`.
const EVENT_SBE: u64 = 0x1;
/// `nvmlEventTypeDoubleBitEccError`.
const EVENT_DBE: u64 = 0x2;
/// `nvmlEventTypeXidCriticalError`.
const EVENT_XID: u64 = 0x8;
/// `nvmlEventMigConfigChange`.
const EVENT_MIG: u64 = 0x100;
/// `nvmlDeviceGetMaxMigDeviceCount` of a MIG-capable GPU (A100, H100).
const MAX_MIG_DEVICES: u32 = 7;
/// `nvmlEventTypeGpuRecoveryAction` (driver 565 and later).
const EVENT_RECOVERY_ACTION: u64 = 0x8000;
/// `NVML_GPU_INSTANCE_PROFILE_COUNT`.
const GI_PROFILE_COUNT: u32 = 17;
/// `NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED`, the only engine profile.
const CI_ENGINE_SHARED: u32 = 0;
/// Compute slices of the compute-instance profiles `NVML_COMPUTE_INSTANCE_PROFILE_*`, by id
/// (1, 2, 3, 4, 7, 8, 6 slices and 1 slice rev. 1).
const CI_SLICES: [u32; 8] = [1, 2, 3, 4, 7, 8, 6, 1];
/// Streaming multiprocessors per slice of an A100 (default of `multiprocessors`).
const SMS_PER_SLICE: u32 = 14;
/// The largest GPU- or compute-instance id a handle can hold (8 bits, see `gi_handle`).
const MAX_INSTANCE_ID: u32 = 0xff;
/// How often a waiting caller looks at the control file.
const CONTROL_POLL: Duration = Duration::from_millis(2);

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
    fn multiprocessors(&self) -> u32 {
        self.multiprocessors
            .unwrap_or(self.slices.saturating_mul(SMS_PER_SLICE))
    }
}

impl GpuConfig {
    fn profile(&self, id: u32) -> Option<&MigProfileConfig> {
        self.mig_profiles.iter().find(|p| p.id == id)
    }

    fn compute_slices(&self) -> u32 {
        self.compute_slices.unwrap_or_else(|| {
            self.mig_profiles
                .iter()
                .map(|p| p.slices)
                .max()
                .unwrap_or(0)
        })
    }

    fn memory_slices(&self) -> u32 {
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
    fn static_placement(&self, dev: &MigDeviceConfig) -> Option<PlacementConfig> {
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
struct Occupied {
    compute: u32,
    memory: Vec<PlacementConfig>,
    ids: Vec<u32>,
}

impl Occupied {
    /// Adds a GPU instance unless its id is already there (several compute instances of one
    /// GPU instance are several MIG devices).
    fn add(&mut self, id: u32, slices: u32, placement: Option<PlacementConfig>) {
        if self.ids.contains(&id) {
            return;
        }
        self.ids.push(id);
        self.compute = self.compute.saturating_add(slices);
        self.memory.extend(placement);
    }

    /// Whether a GPU instance of `slices` at `placement` fits next to these on `gpu`.
    fn fits(&self, gpu: &GpuConfig, slices: u32, placement: PlacementConfig) -> bool {
        let end = |p: &PlacementConfig| p.start.saturating_add(p.size);
        let overlaps = self
            .memory
            .iter()
            .any(|m| m.start < end(&placement) && placement.start < end(m));
        !overlaps && self.compute.saturating_add(slices) <= gpu.compute_slices()
    }

    /// The lowest GPU-instance id from 1 that is not taken.
    fn free_id(&self) -> u32 {
        (1..=MAX_INSTANCE_ID)
            .find(|id| !self.ids.contains(id))
            .unwrap_or(u32::MAX)
    }
}

/// What the static MIG devices `devices` hold on `gpu` (see `MigDeviceConfig::start`).
fn static_occupied<'a>(
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

fn default_driver_version() -> String {
    "570.86.15".to_owned()
}

fn default_cuda_version() -> String {
    "12.8".to_owned()
}

/// `<major>.<minor>` as two numbers.
fn version_pair(text: &str) -> Option<(c_int, c_int)> {
    let (major, minor) = text.trim().split_once('.')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

impl GpuConfig {
    /// The compute capability given, or that of the model the name names.
    fn compute_capability(&self) -> Option<(c_int, c_int)> {
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

fn yes() -> bool {
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
fn check_mig_profiles(gpu: &GpuConfig) -> Result<(), String> {
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

struct Event {
    device: usize,
    kind: u64,
    data: u64,
    /// `gpuInstanceId` and `computeInstanceId` of the event data (`u32::MAX`: none).
    gi: u32,
    ci: u32,
}

#[derive(Default)]
struct Set {
    events: VecDeque<Event>,
    /// A GPU was lost since the last wait: the next wait fails with `GPU_IS_LOST`.
    lost: bool,
}

struct Gpu {
    config: GpuConfig,
    /// MIG mode now (changed by `mig` control lines).
    mig_on: bool,
    /// MIG device slots now (`nvmlDeviceGetMigDeviceHandleByIndex`): the static devices first,
    /// then those of compute instances created at run time; a destroyed one leaves a hole.
    migs: Vec<Option<MigDeviceConfig>>,
    /// GPU instances created at run time, with their compute instances.
    gis: Vec<GpuInstance>,
    /// GPU and compute instances created on this GPU so far (in handles and MIG UUIDs).
    created: u64,
    lost: bool,
    recovery_action: u32,
    /// (set id, event mask) registrations.
    registered: Vec<(usize, u64)>,
}

/// A GPU instance created by `nvmlDeviceCreateGpuInstanceWithPlacement`.
#[derive(Debug, Clone)]
struct GpuInstance {
    id: u32,
    profile: u32,
    placement: PlacementConfig,
    slices: u32,
    memory_mib: u64,
    multiprocessors: u32,
    /// The GPU's creation count when it was made (stale handles do not match).
    serial: u64,
    cis: Vec<ComputeInstance>,
}

/// A compute instance created by `nvmlGpuInstanceCreateComputeInstance`; its MIG device is in
/// the GPU's `migs` with the same GI and CI ids.
#[derive(Debug, Clone)]
struct ComputeInstance {
    id: u32,
    profile: u32,
    /// First compute slice within the GPU instance.
    start: u32,
    slices: u32,
    serial: u64,
}

impl Gpu {
    fn new(config: &GpuConfig) -> Gpu {
        Gpu {
            config: config.clone(),
            mig_on: config.mig == Some(true),
            migs: config.mig_devices.iter().cloned().map(Some).collect(),
            gis: Vec::new(),
            created: 0,
            lost: false,
            recovery_action: 0,
            registered: Vec::new(),
        }
    }

    /// The MIG devices in their slots, without the holes.
    fn mig_devices(&self) -> impl Iterator<Item = &MigDeviceConfig> {
        self.migs.iter().flatten()
    }

    /// What all GPU instances hold now: the static devices' and the created ones.
    fn occupied(&self) -> Occupied {
        let created = |d: &&MigDeviceConfig| self.gis.iter().any(|g| g.id == d.gi);
        let mut occupied =
            static_occupied(&self.config, self.mig_devices().filter(|d| !created(d)));
        for gi in &self.gis {
            occupied.add(gi.id, gi.slices, Some(gi.placement));
        }
        occupied
    }

    /// Puts a MIG device in the first free slot; `false` if all are taken.
    fn add_mig_device(&mut self, device: MigDeviceConfig) -> bool {
        if let Some(slot) = self.migs.iter_mut().find(|m| m.is_none()) {
            *slot = Some(device);
            return true;
        }
        if self.migs.len() >= MAX_MIG_DEVICES as usize {
            return false;
        }
        self.migs.push(Some(device));
        true
    }

    /// Forgets the instances created at run time (their MIG devices go with the layout).
    fn drop_created(&mut self) {
        self.gis.clear();
    }
}

/// What a GPU's created instances were at the last `nvmlShutdown` of the process, by GPU
/// UUID: a real GPU keeps its MIG instances while no one has NVML open.
struct Kept {
    created: u64,
    gis: Vec<GpuInstance>,
    /// (slot, MIG device) of their compute instances.
    slots: Vec<(usize, MigDeviceConfig)>,
}

static KEPT: Mutex<BTreeMap<String, Kept>> = Mutex::new(BTreeMap::new());

/// Locked after `STATE`, never before.
fn kept() -> MutexGuard<'static, BTreeMap<String, Kept>> {
    KEPT.lock().unwrap_or_else(|e| e.into_inner())
}

impl Gpu {
    fn keep(&self) -> Option<Kept> {
        if self.created == 0 {
            return None;
        }
        let ids: Vec<u32> = self.gis.iter().map(|g| g.id).collect();
        let slots = self
            .migs
            .iter()
            .enumerate()
            .filter_map(|(i, m)| Some((i, m.as_ref()?)))
            .filter(|(_, m)| ids.contains(&m.gi))
            .map(|(i, m)| (i, m.clone()))
            .collect();
        Some(Kept {
            created: self.created,
            gis: self.gis.clone(),
            slots,
        })
    }

    /// Takes back the instances kept at the last shutdown, if MIG is on and all of them still
    /// fit this GPU's topology (else they are dropped, with a message on stderr).
    fn restore(&mut self, kept: Kept) {
        self.created = kept.created;
        if kept.gis.is_empty() {
            return;
        }
        let fits = self.mig_on && {
            let mut occupied = self.occupied();
            kept.gis.iter().all(|gi| {
                let known = self.config.profile(gi.profile).is_some_and(|p| {
                    p.slices == gi.slices
                        && p.memory_mib == gi.memory_mib
                        && p.placements.contains(&gi.placement)
                });
                let ok = known
                    && !occupied.ids.contains(&gi.id)
                    && occupied.fits(&self.config, gi.slices, gi.placement);
                occupied.add(gi.id, gi.slices, Some(gi.placement));
                ok
            }) && kept.slots.iter().all(|(slot, _)| {
                *slot < MAX_MIG_DEVICES as usize && self.migs.get(*slot).is_none_or(|m| m.is_none())
            })
        };
        if !fits {
            eprintln!(
                "fake-nvml: {}: the MIG instances created before nvmlShutdown do not fit the \
                 topology now; dropped",
                self.config.uuid
            );
            return;
        }
        self.gis = kept.gis;
        for (slot, device) in kept.slots {
            if self.migs.len() <= slot {
                self.migs.resize(slot.saturating_add(1), None);
            }
            if let Some(place) = self.migs.get_mut(slot) {
                *place = Some(device);
            }
        }
    }
}

struct State {
    config: Config,
    gpus: Vec<Gpu>,
    sets: Vec<Option<Set>>,
    control: Option<PathBuf>,
    control_offset: usize,
    /// Where each `nvmlInit` is logged (`init_log`).
    init_log: Option<PathBuf>,
    users: u32,
    /// `events broken`: waits and registrations fail.
    events_broken: bool,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

fn lock() -> MutexGuard<'static, Option<State>> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Where this library was loaded from (the mapping that holds one of its functions).
fn own_path() -> Option<PathBuf> {
    let here = nvmlInit_v2 as *const () as usize;
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|line| {
        let mut parts = line.split_whitespace();
        let (start, end) = parts.next()?.split_once('-')?;
        let (start, end) = (
            usize::from_str_radix(start, 16).ok()?,
            usize::from_str_radix(end, 16).ok()?,
        );
        let path = parts.nth(4)?;
        (start <= here && here < end && path.starts_with('/')).then(|| PathBuf::from(path))
    })
}

fn config_path() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("FAKE_NVML_CONFIG") {
        return Some(PathBuf::from(path));
    }
    Some(own_path()?.parent()?.join("fake-nvml.yaml"))
}

fn load() -> Result<State, String> {
    let path = config_path().ok_or("cannot tell where the config is")?;
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let config = Config::parse(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let beside = |c: &PathBuf| {
        if c.is_absolute() {
            c.clone()
        } else {
            path.parent().unwrap_or(Path::new("/")).join(c)
        }
    };
    let control = config.control.as_ref().map(beside);
    let init_log = config.init_log.as_ref().map(beside);
    let control_offset = control
        .as_ref()
        .and_then(|c| std::fs::metadata(c).ok())
        .map_or(0, |m| usize::try_from(m.len()).unwrap_or(usize::MAX));
    let mut state = State::new(config, control, control_offset);
    state.init_log = init_log;
    Ok(state)
}

impl State {
    /// The state of a freshly loaded topology, with the instances kept at the last shutdown.
    fn new(config: Config, control: Option<PathBuf>, control_offset: usize) -> State {
        let mut kept = kept();
        let gpus = config
            .gpus
            .iter()
            .map(|g| {
                let mut gpu = Gpu::new(g);
                if let Some(k) = kept.remove(&g.uuid) {
                    gpu.restore(k);
                }
                gpu
            })
            .collect();
        State {
            config,
            gpus,
            sets: Vec::new(),
            control,
            control_offset,
            init_log: None,
            users: 0,
            events_broken: false,
        }
    }

    fn gpu(&self, device: nvmlDevice_t) -> Result<&Gpu, nvmlReturn_t> {
        let gpu = (device as usize)
            .checked_sub(1)
            .and_then(|i| self.gpus.get(i))
            .ok_or(INVALID_ARGUMENT)?;
        if gpu.lost {
            return Err(GPU_IS_LOST);
        }
        Ok(gpu)
    }

    /// The index of a GPU handle's GPU (errors as `gpu`).
    fn gpu_index(&self, device: nvmlDevice_t) -> Result<usize, nvmlReturn_t> {
        self.gpu(device)?;
        Ok((device as usize).saturating_sub(1))
    }

    /// A MIG-capable GPU and its GPU-instance profile `profile`: `INVALID_ARGUMENT` for an id
    /// beyond NVML's, `NOT_SUPPORTED` without MIG or for a profile this GPU lacks. MIG may be
    /// on or off.
    fn gi_profile(
        &self,
        device: nvmlDevice_t,
        profile: c_uint,
    ) -> Result<(usize, &MigProfileConfig), nvmlReturn_t> {
        let index = self.gpu_index(device)?;
        let gpu = self.gpu(device)?;
        if profile >= GI_PROFILE_COUNT {
            return Err(INVALID_ARGUMENT);
        }
        if gpu.config.mig.is_none() {
            return Err(NOT_SUPPORTED);
        }
        Ok((index, gpu.config.profile(profile).ok_or(NOT_SUPPORTED)?))
    }

    /// The GPU (index and state) an instance handle of kind `tag` (`GI_TAG`, `CI_TAG`) names:
    /// `INVALID_ARGUMENT` for another kind or no such GPU, `GPU_IS_LOST` for a lost one.
    fn instance_gpu(&self, raw: u64, tag: u64) -> Result<(usize, &Gpu), nvmlReturn_t> {
        if raw & TAG_MASK != tag {
            return Err(INVALID_ARGUMENT);
        }
        let gpu = usize::try_from((raw >> 40) & 0xffff)
            .ok()
            .and_then(|g| g.checked_sub(1))
            .ok_or(INVALID_ARGUMENT)?;
        let g = self.gpus.get(gpu).ok_or(INVALID_ARGUMENT)?;
        if g.lost {
            return Err(GPU_IS_LOST);
        }
        Ok((gpu, g))
    }

    /// The GPU index and position in its `gis` of a GPU-instance handle: `INVALID_ARGUMENT`
    /// for anything else, a destroyed instance included.
    fn gi_find(&self, handle: nvmlGpuInstance_t) -> Result<(usize, usize), nvmlReturn_t> {
        let (gpu, g) = self.instance_gpu(handle as usize as u64, GI_TAG)?;
        let at = g
            .gis
            .iter()
            .position(|gi| gi_handle(gpu, gi) == handle)
            .ok_or(INVALID_ARGUMENT)?;
        Ok((gpu, at))
    }

    /// The GPU index and GPU instance of a GPU-instance handle (errors as `gi_find`).
    fn gi_ref(&self, handle: nvmlGpuInstance_t) -> Result<(usize, &GpuInstance), nvmlReturn_t> {
        let (gpu, at) = self.gi_find(handle)?;
        let gi = self
            .gpus
            .get(gpu)
            .and_then(|g| g.gis.get(at))
            .ok_or(INVALID_ARGUMENT)?;
        Ok((gpu, gi))
    }

    /// The GPU index and positions (GPU instance, compute instance) of a compute-instance
    /// handle: `INVALID_ARGUMENT` for anything else, a destroyed instance included.
    fn ci_find(
        &self,
        handle: nvmlComputeInstance_t,
    ) -> Result<(usize, usize, usize), nvmlReturn_t> {
        let (gpu, g) = self.instance_gpu(handle as usize as u64, CI_TAG)?;
        g.gis
            .iter()
            .enumerate()
            .find_map(|(i, gi)| {
                let j = gi
                    .cis
                    .iter()
                    .position(|ci| ci_handle(gpu, gi, ci) == handle)?;
                Some((gpu, i, j))
            })
            .ok_or(INVALID_ARGUMENT)
    }

    /// The GPU and MIG device of a MIG handle (`handle(gpu) << 16 | slot + 1`).
    fn mig(&self, device: nvmlDevice_t) -> Result<(&Gpu, &MigDeviceConfig), nvmlReturn_t> {
        let raw = device as usize;
        let (gpu, slot) = (raw >> 16, raw & 0xffff);
        let gpu = gpu
            .checked_sub(1)
            .and_then(|i| self.gpus.get(i))
            .ok_or(INVALID_ARGUMENT)?;
        if gpu.lost {
            return Err(GPU_IS_LOST);
        }
        let mig = slot
            .checked_sub(1)
            .filter(|_| gpu.mig_on)
            .and_then(|j| gpu.migs.get(j))
            .and_then(Option::as_ref)
            .ok_or(INVALID_ARGUMENT)?;
        Ok((gpu, mig))
    }

    fn find(&self, which: &str) -> Option<usize> {
        if let Ok(i) = which.parse::<usize>() {
            return (i < self.gpus.len()).then_some(i);
        }
        self.gpus.iter().position(|g| g.config.uuid == which)
    }

    fn send(&mut self, device: usize, kind: u64, data: u64) {
        self.send_to_instance(device, kind, data, (u32::MAX, u32::MAX));
    }

    /// Sends an event that NVML attributes to GPU instance `gi`, compute instance `ci`
    /// (`u32::MAX`: not attributed).
    fn send_to_instance(&mut self, device: usize, kind: u64, data: u64, (gi, ci): (u32, u32)) {
        let Some(gpu) = self.gpus.get(device) else {
            return;
        };
        for &(set, mask) in &gpu.registered {
            if mask & kind != 0 {
                if let Some(Some(set)) = self.sets.get_mut(set) {
                    set.events.push_back(Event {
                        device,
                        kind,
                        data,
                        gi,
                        ci,
                    });
                }
            }
        }
    }

    /// Applies the complete lines appended to the control file since the last look.
    fn poll_control(&mut self) {
        let Some(path) = &self.control else {
            return;
        };
        let Ok(text) = std::fs::read_to_string(path) else {
            return;
        };
        let Some(new) = text.get(self.control_offset..) else {
            // Truncated or rewritten: start over from its end.
            self.control_offset = text.len();
            return;
        };
        let Some(end) = new.rfind('\n') else {
            return;
        };
        let lines: Vec<String> = new[..end].lines().map(str::to_owned).collect();
        self.control_offset = self.control_offset.saturating_add(end + 1);
        for line in lines {
            if let Err(err) = self.apply(&line) {
                eprintln!("fake-nvml: control line {line:?}: {err}");
            }
        }
    }

    fn apply(&mut self, line: &str) -> Result<(), String> {
        let words: Vec<&str> = line.split_whitespace().collect();
        let Some((&verb, args)) = words.split_first() else {
            return Ok(());
        };
        if verb == "mig" {
            let gpu = args
                .first()
                .and_then(|w| self.find(w))
                .ok_or("no such GPU")?;
            let layout = args.get(1).ok_or("mig <gpu> <layout>|off")?;
            let g = &mut self.gpus[gpu];
            if g.config.mig.is_none() {
                return Err("this GPU has no MIG".into());
            }
            if *layout == "off" {
                g.mig_on = false;
                g.migs.clear();
            } else {
                g.migs = g
                    .config
                    .mig_layouts
                    .get(*layout)
                    .ok_or_else(|| format!("no MIG layout {layout:?}"))?
                    .iter()
                    .cloned()
                    .map(Some)
                    .collect();
                g.mig_on = true;
            }
            // The new layout replaces every instance, created ones too.
            g.drop_created();
            self.send(gpu, EVENT_MIG, 0);
            return Ok(());
        }
        if verb == "events" {
            self.events_broken = match args.first() {
                Some(&"broken") => true,
                Some(&"ok") => false,
                _ => return Err("events broken|ok".into()),
            };
            return Ok(());
        }
        let gpu = args
            .first()
            .and_then(|w| self.find(w))
            .ok_or("no such GPU")?;
        let number = |i: usize| -> Result<u64, String> {
            args.get(i)
                .ok_or_else(|| format!("argument {i} missing"))?
                .parse::<u64>()
                .map_err(|e| e.to_string())
        };
        match verb {
            "xid" => {
                let code = number(1)?;
                // `gi=<id>` and `ci=<id>` anywhere after the code; the rest is positional.
                let (mut gi, mut ci) = (u32::MAX, u32::MAX);
                let mut positional = 0usize;
                for (i, word) in args.iter().enumerate().skip(2) {
                    let id = |v: &str| v.parse::<u32>().map_err(|e| format!("{word}: {e}"));
                    if let Some(v) = word.strip_prefix("gi=") {
                        gi = id(v)?;
                    } else if let Some(v) = word.strip_prefix("ci=") {
                        ci = id(v)?;
                    } else if positional == 0 {
                        positional = i;
                    } else {
                        return Err(format!("unexpected {word:?}"));
                    }
                }
                if positional != 0 {
                    let action = u32::try_from(number(positional)?).map_err(|e| e.to_string())?;
                    self.gpus[gpu].recovery_action = action;
                }
                self.send_to_instance(gpu, EVENT_XID, code, (gi, ci));
            }
            "ecc" => {
                if args.len() > 1 {
                    let action = u32::try_from(number(1)?).map_err(|e| e.to_string())?;
                    self.gpus[gpu].recovery_action = action;
                }
                self.send(gpu, EVENT_DBE, 0);
            }
            "action" => {
                self.gpus[gpu].recovery_action =
                    u32::try_from(number(1)?).map_err(|e| e.to_string())?;
                if self.config.recovery_action {
                    self.send(
                        gpu,
                        EVENT_RECOVERY_ACTION,
                        u64::from(self.gpus[gpu].recovery_action),
                    );
                }
            }
            "lost" => {
                self.gpus[gpu].lost = true;
                let sets: Vec<usize> = self.gpus[gpu].registered.iter().map(|r| r.0).collect();
                for set in sets {
                    if let Some(Some(set)) = self.sets.get_mut(set) {
                        set.lost = true;
                    }
                }
            }
            "found" => self.gpus[gpu].lost = false,
            other => return Err(format!("unknown verb {other:?}")),
        }
        Ok(())
    }
}

/// Runs `f` on the initialised state (after applying new control lines), or answers
/// `UNINITIALIZED`.
fn with_state(f: impl FnOnce(&mut State) -> Result<(), nvmlReturn_t>) -> nvmlReturn_t {
    let mut guard = lock();
    match guard.as_mut() {
        None => UNINITIALIZED,
        Some(state) => {
            state.poll_control();
            match f(state) {
                Ok(()) => SUCCESS,
                Err(code) => code,
            }
        }
    }
}

/// Writes `value` through `out` after a null check.
fn put<T>(out: *mut T, value: T) -> Result<(), nvmlReturn_t> {
    if out.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: `out` is non-null and, per the NVML contract, points to a writable `T` that the
    // caller owns for the duration of the call.
    unsafe { out.write(value) };
    Ok(())
}

/// Reads the value the caller passed through `ptr` after a null check.
fn get<T: Copy>(ptr: *const T) -> Result<T, nvmlReturn_t> {
    if ptr.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: `ptr` is non-null and, per the NVML contract, points to an initialised `T` that
    // the caller owns for the duration of the call.
    Ok(unsafe { ptr.read() })
}

/// Writes `values` into the caller's array, which has room for `room` of them.
fn put_array<T: Copy>(out: *mut T, room: usize, values: &[T]) -> Result<(), nvmlReturn_t> {
    if out.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    if values.len() > room {
        return Err(INSUFFICIENT_SIZE);
    }
    // SAFETY: `out` is non-null and the caller's array holds `room >= values.len()` elements
    // of `T` (for the instance lists, NVML's contract: room for the profile's instance count).
    unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), out, values.len()) };
    Ok(())
}

/// Copies `text` and a NUL into the caller's buffer of `length` bytes.
fn put_str(buf: *mut c_char, length: c_uint, text: &str) -> Result<(), nvmlReturn_t> {
    if buf.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    let bytes = text.as_bytes();
    if bytes.len() >= length as usize {
        return Err(INSUFFICIENT_SIZE);
    }
    // SAFETY: `buf` is non-null and the caller says it holds `length` bytes; we write
    // `bytes.len() + 1 <= length` of them.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), buf, bytes.len());
        buf.add(bytes.len()).write(0);
    }
    Ok(())
}

/// The caller's array of `count` field values (non-null, checked by the caller).
fn field_values<'a>(values: *mut nvmlFieldValue_t, count: usize) -> &'a mut [nvmlFieldValue_t] {
    // SAFETY: NVML's contract for nvmlDeviceGetFieldValues: `values` points to `count`
    // initialised field values owned by the caller for the duration of the call.
    unsafe { std::slice::from_raw_parts_mut(values, count) }
}

fn handle(index: usize) -> nvmlDevice_t {
    index.saturating_add(1) as nvmlDevice_t
}

// Handles are integers in pointers. GPU: `index + 1`; MIG device: `(index + 1) << 16 | slot + 1`
// (below 2^32); GPU instance: `0xA << 60 | (index + 1) << 40 | GI id << 32 | serial & 0xffff_ffff`;
// compute instance: `0xC << 60 | (index + 1) << 40 | GI id << 32 | CI id << 24 |
// serial & 0xff_ffff`, where serial is the GPU's creation count when the instance was made (so
// the handle of a destroyed instance does not name one made later with the same ids). The top
// nibble keeps the four kinds apart; they need 64-bit pointers.
const _: () = assert!(usize::BITS == 64, "instance handles need 64-bit pointers");
const GI_TAG: u64 = 0xa << 60;
const CI_TAG: u64 = 0xc << 60;
const TAG_MASK: u64 = 0xf << 60;

fn gpu_bits(gpu: usize) -> u64 {
    ((gpu as u64).saturating_add(1) & 0xffff) << 40
}

fn gi_handle(gpu: usize, gi: &GpuInstance) -> nvmlGpuInstance_t {
    let raw = GI_TAG | gpu_bits(gpu) | (u64::from(gi.id) & 0xff) << 32 | (gi.serial & 0xffff_ffff);
    raw as usize as nvmlGpuInstance_t
}

fn ci_handle(gpu: usize, gi: &GpuInstance, ci: &ComputeInstance) -> nvmlComputeInstance_t {
    let raw = CI_TAG
        | gpu_bits(gpu)
        | (u64::from(gi.id) & 0xff) << 32
        | (u64::from(ci.id) & 0xff) << 24
        | (ci.serial & 0xff_ffff);
    raw as usize as nvmlComputeInstance_t
}

/// The UUID of the MIG device of a created compute instance: from the GPU index, the GI and
/// CI ids and the GPU's creation count, so that a re-created instance gets a new one.
fn mig_uuid(gpu: usize, gi: u32, ci: u32, serial: u64) -> String {
    format!(
        "MIG-d{:07x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        gpu & 0xfff_ffff,
        gi & 0xffff,
        ci & 0xfff,
        (serial >> 48) & 0xfff,
        serial & 0xffff_ffff_ffff
    )
}

/// Copy engines, decoders, encoders, JPEG decoders and optical-flow accelerators of a GPU
/// instance of `slices` slices, as on an A100 (7 slices: 7, 5, 0, 1, 1).
fn engines(slices: u32) -> [u32; 5] {
    let seventh = slices / 7;
    [slices, slices.saturating_mul(5) / 7, 0, seventh, seventh]
}

fn gi_profile_info(p: &MigProfileConfig) -> nvmlGpuInstanceProfileInfo_t {
    let [copy, decoders, encoders, jpegs, ofas] = engines(p.slices);
    nvmlGpuInstanceProfileInfo_t {
        id: p.id,
        isP2pSupported: 0,
        sliceCount: p.slices,
        instanceCount: c_uint::try_from(p.placements.len()).unwrap_or(c_uint::MAX),
        multiprocessorCount: p.multiprocessors(),
        copyEngineCount: copy,
        decoderCount: decoders,
        encoderCount: encoders,
        jpegCount: jpegs,
        ofaCount: ofas,
        memorySizeMB: p.memory_mib,
    }
}

/// `text` as a NUL-terminated C string in a fixed array (cut to fit).
fn c_string<const N: usize>(text: &str) -> [c_char; N] {
    let mut out = [0; N];
    for (dst, src) in out.iter_mut().zip(text.bytes().take(N.saturating_sub(1))) {
        *dst = src as c_char;
    }
    out
}

/// The slices of compute-instance profile `profile` in `gi`: `INVALID_ARGUMENT` for an id
/// beyond NVML's, `NOT_SUPPORTED` for an engine profile other than shared or a profile larger
/// than the GPU instance.
fn ci_slices(gi: &GpuInstance, profile: c_uint, engines: c_uint) -> Result<u32, nvmlReturn_t> {
    let slices = usize::try_from(profile)
        .ok()
        .and_then(|p| CI_SLICES.get(p))
        .copied()
        .ok_or(INVALID_ARGUMENT)?;
    if engines != CI_ENGINE_SHARED || slices > gi.slices {
        return Err(NOT_SUPPORTED);
    }
    Ok(slices)
}

fn pci_info(bus_id: &str) -> nvmlPciInfo_t {
    let mut info = nvmlPciInfo_t {
        busIdLegacy: [0; 16],
        domain: 0,
        bus: 0,
        device: 0,
        pciDeviceId: 0x20b010de,
        pciSubSystemId: 0,
        busId: [0; 32],
    };
    // "00000000:06:00.0": domain, bus, device.function.
    let mut parts = bus_id.split([':', '.']);
    let mut next = || u32::from_str_radix(parts.next().unwrap_or("0"), 16).unwrap_or(0);
    info.domain = next();
    info.bus = next();
    info.device = next();
    for (dst, src) in info.busId.iter_mut().zip(bus_id.bytes().take(31)) {
        *dst = src as c_char;
    }
    for (dst, src) in info.busIdLegacy.iter_mut().zip(bus_id.bytes().take(15)) {
        *dst = src as c_char;
    }
    info
}

/// `nvmlInit_v2`: reads the topology.
#[no_mangle]
pub extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    let mut guard = lock();
    if guard.is_none() {
        match load() {
            Ok(state) => *guard = Some(state),
            Err(err) => {
                eprintln!("fake-nvml: {err}");
                return DRIVER_NOT_LOADED;
            }
        }
    }
    if let Some(state) = guard.as_mut() {
        state.users = state.users.saturating_add(1);
        if let Some(path) = &state.init_log {
            let logged = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .and_then(|mut f| std::io::Write::write_all(&mut f, b"init\n"));
            if let Err(err) = logged {
                eprintln!("fake-nvml: {}: {err}", path.display());
            }
        }
    }
    SUCCESS
}

/// `nvmlInitWithFlags`: as `nvmlInit_v2`.
#[no_mangle]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nvmlReturn_t {
    nvmlInit_v2()
}

/// `nvmlShutdown`: the last user's shutdown forgets the state.
#[no_mangle]
pub extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    let mut guard = lock();
    let Some(state) = guard.as_mut() else {
        return UNINITIALIZED;
    };
    state.users = state.users.saturating_sub(1);
    if state.users == 0 {
        // Created MIG instances outlive the state, as on a GPU (see `Kept`).
        let mut kept = kept();
        for gpu in &state.gpus {
            if let Some(k) = gpu.keep() {
                kept.insert(gpu.config.uuid.clone(), k);
            }
        }
        drop(kept);
        *guard = None;
    }
    SUCCESS
}

/// `nvmlErrorString`.
#[no_mangle]
pub extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    let text: &'static CStr = match result {
        SUCCESS => c"Success",
        UNINITIALIZED => c"Uninitialized",
        INVALID_ARGUMENT => c"Invalid Argument",
        NOT_SUPPORTED => c"Not Supported",
        NOT_FOUND => c"Not Found",
        IN_USE => c"In use by another client",
        INSUFFICIENT_RESOURCES => c"Ran out of critical resources, other than memory",
        INSUFFICIENT_SIZE => c"Insufficient Size",
        DRIVER_NOT_LOADED => c"Driver Not Loaded",
        TIMEOUT => c"Timeout",
        GPU_IS_LOST => c"GPU is lost",
        _ => c"Unknown Error",
    };
    text.as_ptr()
}

/// `nvmlSystemGetDriverVersion`.
#[no_mangle]
pub extern "C" fn nvmlSystemGetDriverVersion(version: *mut c_char, length: c_uint) -> nvmlReturn_t {
    with_state(|s| put_str(version, length, &s.config.driver_version))
}

/// `nvmlSystemGetCudaDriverVersion_v2`: `1000 * major + 10 * minor`.
#[no_mangle]
pub extern "C" fn nvmlSystemGetCudaDriverVersion_v2(version: *mut c_int) -> nvmlReturn_t {
    with_state(|s| {
        let (major, minor) = version_pair(&s.config.cuda_version).ok_or(UNKNOWN)?;
        put(
            version,
            major
                .saturating_mul(1000)
                .saturating_add(minor.saturating_mul(10)),
        )
    })
}

/// `nvmlSystemGetCudaDriverVersion`: as `_v2`.
#[no_mangle]
pub extern "C" fn nvmlSystemGetCudaDriverVersion(version: *mut c_int) -> nvmlReturn_t {
    nvmlSystemGetCudaDriverVersion_v2(version)
}

/// `nvmlDeviceGetCudaComputeCapability`.
#[no_mangle]
pub extern "C" fn nvmlDeviceGetCudaComputeCapability(
    device: nvmlDevice_t,
    major: *mut c_int,
    minor: *mut c_int,
) -> nvmlReturn_t {
    with_state(|s| {
        let gpu = s.gpu(device)?;
        let (ma, mi) = gpu.config.compute_capability().ok_or(NOT_SUPPORTED)?;
        put(major, ma)?;
        put(minor, mi)
    })
}

/// `nvmlDeviceGetCount_v2`.
#[no_mangle]
pub extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> nvmlReturn_t {
    with_state(|s| put(count, c_uint::try_from(s.gpus.len()).unwrap_or(c_uint::MAX)))
}

/// `nvmlDeviceGetHandleByIndex_v2`.
#[no_mangle]
pub extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    with_state(|s| {
        let i = index as usize;
        let gpu = s.gpus.get(i).ok_or(INVALID_ARGUMENT)?;
        if gpu.lost {
            return Err(GPU_IS_LOST);
        }
        put(device, handle(i))
    })
}

/// `nvmlDeviceGetHandleByUUID`: a GPU by its `GPU-…` UUID (MIG UUIDs are not looked up).
///
/// # Safety
/// `uuid` is null or a NUL-terminated string, as nvml.h's `const char *uuid` says.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    if uuid.is_null() {
        return INVALID_ARGUMENT;
    }
    // SAFETY: the caller passes a NUL-terminated string (nvml.h: `const char *uuid`), checked
    // for null above; it is only read, before this call returns.
    let wanted = unsafe { CStr::from_ptr(uuid) }
        .to_string_lossy()
        .into_owned();
    with_state(|s| {
        let i = s
            .gpus
            .iter()
            .position(|g| g.config.uuid == wanted)
            .ok_or(NOT_FOUND)?;
        if s.gpus.get(i).is_some_and(|g| g.lost) {
            return Err(GPU_IS_LOST);
        }
        put(device, handle(i))
    })
}

/// `nvmlDeviceGetIndex`.
#[no_mangle]
pub extern "C" fn nvmlDeviceGetIndex(device: nvmlDevice_t, index: *mut c_uint) -> nvmlReturn_t {
    with_state(|s| {
        s.gpu(device)?;
        put(index, (device as usize).saturating_sub(1) as c_uint)
    })
}

/// `nvmlDeviceGetUUID`.
#[no_mangle]
pub extern "C" fn nvmlDeviceGetUUID(
    device: nvmlDevice_t,
    uuid: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    with_state(|s| match s.mig(device) {
        Ok((_, mig)) => put_str(uuid, length, &mig.uuid),
        Err(_) => put_str(uuid, length, &s.gpu(device)?.config.uuid),
    })
}

/// `nvmlDeviceGetName`.
#[no_mangle]
pub extern "C" fn nvmlDeviceGetName(
    device: nvmlDevice_t,
    name: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    with_state(|s| match s.mig(device) {
        Ok((gpu, mig)) => put_str(
            name,
            length,
            &format!(
                "{} MIG {}g.{}gb",
                gpu.config.name,
                mig.slices,
                mig.memory_mib.div_ceil(1024)
            ),
        ),
        Err(_) => put_str(name, length, &s.gpu(device)?.config.name),
    })
}

/// `nvmlDeviceGetMinorNumber`.
#[no_mangle]
pub extern "C" fn nvmlDeviceGetMinorNumber(
    device: nvmlDevice_t,
    minor: *mut c_uint,
) -> nvmlReturn_t {
    with_state(|s| {
        let gpu = s.gpu(device)?;
        let index = (device as usize).saturating_sub(1) as c_uint;
        put(minor, gpu.config.minor.unwrap_or(index))
    })
}

/// `nvmlDeviceGetMemoryInfo_v2`.
#[no_mangle]
pub extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    with_state(|s| {
        let mib = match s.mig(device) {
            Ok((_, mig)) => mig.memory_mib,
            Err(_) => s.gpu(device)?.config.memory_mib,
        };
        let total = mib.saturating_mul(1 << 20);
        put(
            memory,
            nvmlMemory_v2_t {
                version: (std::mem::size_of::<nvmlMemory_v2_t>() | (2 << 24)) as c_uint,
                total,
                reserved: 0,
                free: total,
                used: 0,
            },
        )
    })
}

/// `nvmlDeviceGetPciInfo_v3`.
#[no_mangle]
pub extern "C" fn nvmlDeviceGetPciInfo_v3(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    with_state(|s| put(pci, pci_info(&s.gpu(device)?.config.bus_id)))
}

/// `nvmlDeviceGetMigMode`: from `mig` (and `mig` control lines); `NOT_SUPPORTED` without.
#[no_mangle]
pub extern "C" fn nvmlDeviceGetMigMode(
    device: nvmlDevice_t,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> nvmlReturn_t {
    with_state(|s| {
        let gpu = s.gpu(device)?;
        if gpu.config.mig.is_none() {
            return Err(NOT_SUPPORTED);
        }
        put(current, c_uint::from(gpu.mig_on))?;
        put(pending, c_uint::from(gpu.mig_on))
    })
}

/// `nvmlDeviceGetMaxMigDeviceCount`.
#[no_mangle]
pub extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    device: nvmlDevice_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    with_state(|s| {
        let gpu = s.gpu(device)?;
        if gpu.config.mig.is_none() {
            return Err(NOT_SUPPORTED);
        }
        put(count, MAX_MIG_DEVICES)
    })
}

/// `nvmlDeviceGetMigDeviceHandleByIndex`: `NOT_FOUND` for an empty slot.
#[no_mangle]
pub extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    device: nvmlDevice_t,
    index: c_uint,
    mig: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    with_state(|s| {
        let gpu = s.gpu(device)?;
        if gpu.config.mig.is_none() {
            return Err(NOT_SUPPORTED);
        }
        if index >= MAX_MIG_DEVICES {
            return Err(INVALID_ARGUMENT);
        }
        let filled = gpu.migs.get(index as usize).is_some_and(Option::is_some);
        if !gpu.mig_on || !filled {
            return Err(NOT_FOUND);
        }
        let raw = ((device as usize) << 16) | (index as usize).saturating_add(1);
        put(mig, raw as nvmlDevice_t)
    })
}

/// `nvmlDeviceIsMigDeviceHandle`.
#[no_mangle]
pub extern "C" fn nvmlDeviceIsMigDeviceHandle(
    device: nvmlDevice_t,
    is_mig: *mut c_uint,
) -> nvmlReturn_t {
    with_state(|s| {
        if s.mig(device).is_ok() {
            return put(is_mig, 1);
        }
        s.gpu(device)?;
        put(is_mig, 0)
    })
}

/// `nvmlDeviceGetDeviceHandleFromMigDeviceHandle`.
#[no_mangle]
pub extern "C" fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
    mig: nvmlDevice_t,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    with_state(|s| {
        s.mig(mig)?;
        put(device, ((mig as usize) >> 16) as nvmlDevice_t)
    })
}

/// `nvmlDeviceGetGpuInstanceId` (MIG handles only).
#[no_mangle]
pub extern "C" fn nvmlDeviceGetGpuInstanceId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    with_state(|s| put(id, s.mig(device)?.1.gi))
}

/// `nvmlDeviceGetComputeInstanceId` (MIG handles only).
#[no_mangle]
pub extern "C" fn nvmlDeviceGetComputeInstanceId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    with_state(|s| put(id, s.mig(device)?.1.ci))
}

/// `nvmlDeviceGetAttributes_v2` (MIG handles only): slice counts and memory.
#[no_mangle]
pub extern "C" fn nvmlDeviceGetAttributes_v2(
    device: nvmlDevice_t,
    attributes: *mut nvmlDeviceAttributes_t,
) -> nvmlReturn_t {
    with_state(|s| {
        let (_, mig) = match s.mig(device) {
            Ok(found) => found,
            Err(_) => {
                s.gpu(device)?;
                return Err(NOT_SUPPORTED);
            }
        };
        put(
            attributes,
            nvmlDeviceAttributes_t {
                multiprocessorCount: mig.slices.saturating_mul(14),
                sharedCopyEngineCount: mig.slices,
                sharedDecoderCount: 0,
                sharedEncoderCount: 0,
                sharedJpegCount: 0,
                sharedOfaCount: 0,
                gpuInstanceSliceCount: mig.slices,
                computeInstanceSliceCount: mig.ci_slices.unwrap_or(mig.slices),
                memorySizeMB: mig.memory_mib,
            },
        )
    })
}

/// `nvmlDeviceGetGpuInstanceProfileInfo`: a profile of `mig_profiles`, MIG on or off.
#[no_mangle]
pub extern "C" fn nvmlDeviceGetGpuInstanceProfileInfo(
    device: nvmlDevice_t,
    profile: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_t,
) -> nvmlReturn_t {
    with_state(|s| put(info, gi_profile_info(s.gi_profile(device, profile)?.1)))
}

/// `nvmlDeviceGetGpuInstanceProfileInfoV`: as `nvmlDeviceGetGpuInstanceProfileInfo`, with the
/// version-2 struct (its `version` is written, not checked) and a name like `MIG 1g.5gb`.
#[no_mangle]
pub extern "C" fn nvmlDeviceGetGpuInstanceProfileInfoV(
    device: nvmlDevice_t,
    profile: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    with_state(|s| {
        let p = s.gi_profile(device, profile)?.1;
        let v1 = gi_profile_info(p);
        let name = format!("MIG {}g.{}gb", p.slices, p.memory_mib.div_ceil(1024));
        put(
            info,
            nvmlGpuInstanceProfileInfo_v2_t {
                version: (std::mem::size_of::<nvmlGpuInstanceProfileInfo_v2_t>() | (2 << 24))
                    as c_uint,
                id: v1.id,
                isP2pSupported: v1.isP2pSupported,
                sliceCount: v1.sliceCount,
                instanceCount: v1.instanceCount,
                multiprocessorCount: v1.multiprocessorCount,
                copyEngineCount: v1.copyEngineCount,
                decoderCount: v1.decoderCount,
                encoderCount: v1.encoderCount,
                jpegCount: v1.jpegCount,
                ofaCount: v1.ofaCount,
                memorySizeMB: v1.memorySizeMB,
                name: c_string(&name),
            },
        )
    })
}

/// `nvmlDeviceGetGpuInstancePossiblePlacements_v2`: all the profile's placements, whether
/// taken or not, MIG on or off (as NVML documents it).
#[no_mangle]
pub extern "C" fn nvmlDeviceGetGpuInstancePossiblePlacements_v2(
    device: nvmlDevice_t,
    profile_id: c_uint,
    placements: *mut nvmlGpuInstancePlacement_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    with_state(|s| {
        let p = s.gi_profile(device, profile_id)?.1;
        let n = c_uint::try_from(p.placements.len()).unwrap_or(c_uint::MAX);
        if placements.is_null() {
            return put(count, n);
        }
        let room = get(count)?;
        if room < n {
            put(count, n)?;
            return Err(INSUFFICIENT_SIZE);
        }
        let list: Vec<nvmlGpuInstancePlacement_t> = p
            .placements
            .iter()
            .map(|pl| nvmlGpuInstancePlacement_t {
                start: pl.start,
                size: pl.size,
            })
            .collect();
        put_array(placements, room as usize, &list)?;
        put(count, n)
    })
}

/// `nvmlDeviceCreateGpuInstanceWithPlacement`: MIG must be on (else `NOT_SUPPORTED`), the
/// placement one of the profile's (else `INVALID_ARGUMENT`), its memory slices free and the
/// GPU's compute slices enough (else `INSUFFICIENT_RESOURCES`). The GI id is the lowest free
/// one from 1; sends `nvmlEventMigConfigChange`.
#[no_mangle]
pub extern "C" fn nvmlDeviceCreateGpuInstanceWithPlacement(
    device: nvmlDevice_t,
    profile_id: c_uint,
    placement: *const nvmlGpuInstancePlacement_t,
    gpu_instance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    with_state(|s| {
        let (gpu, p) = s.gi_profile(device, profile_id)?;
        let p = p.clone();
        if gpu_instance.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let wanted = get(placement)?;
        let wanted = PlacementConfig {
            start: wanted.start,
            size: wanted.size,
        };
        let g = s.gpus.get_mut(gpu).ok_or(INVALID_ARGUMENT)?;
        if !g.mig_on {
            return Err(NOT_SUPPORTED);
        }
        if !p.placements.contains(&wanted) {
            return Err(INVALID_ARGUMENT);
        }
        let occupied = g.occupied();
        let id = occupied.free_id();
        if !occupied.fits(&g.config, p.slices, wanted) || id > MAX_INSTANCE_ID {
            return Err(INSUFFICIENT_RESOURCES);
        }
        g.created = g.created.saturating_add(1);
        let gi = GpuInstance {
            id,
            profile: p.id,
            placement: wanted,
            slices: p.slices,
            memory_mib: p.memory_mib,
            multiprocessors: p.multiprocessors(),
            serial: g.created,
            cis: Vec::new(),
        };
        let made = gi_handle(gpu, &gi);
        g.gis.push(gi);
        s.send(gpu, EVENT_MIG, 0);
        put(gpu_instance, made)
    })
}

/// `nvmlDeviceGetGpuInstances`: the created GPU instances of a profile, by id, into an array
/// with room for the profile's instance count (static `mig_devices` are not listed).
#[no_mangle]
pub extern "C" fn nvmlDeviceGetGpuInstances(
    device: nvmlDevice_t,
    profile_id: c_uint,
    gpu_instances: *mut nvmlGpuInstance_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    with_state(|s| {
        let (gpu, p) = s.gi_profile(device, profile_id)?;
        let room = p.placements.len();
        if gpu_instances.is_null() || count.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let g = s.gpus.get(gpu).ok_or(INVALID_ARGUMENT)?;
        if !g.mig_on {
            return Err(NOT_SUPPORTED);
        }
        let mut mine: Vec<&GpuInstance> =
            g.gis.iter().filter(|gi| gi.profile == profile_id).collect();
        mine.sort_by_key(|gi| gi.id);
        let list: Vec<nvmlGpuInstance_t> = mine.iter().map(|gi| gi_handle(gpu, gi)).collect();
        put_array(gpu_instances, room, &list)?;
        put(count, c_uint::try_from(list.len()).unwrap_or(c_uint::MAX))
    })
}

/// `nvmlDeviceGetGpuInstanceById`: a created GPU instance; `NOT_FOUND` for any other id
/// (static `mig_devices` included).
#[no_mangle]
pub extern "C" fn nvmlDeviceGetGpuInstanceById(
    device: nvmlDevice_t,
    id: c_uint,
    gpu_instance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    with_state(|s| {
        let gpu = s.gpu_index(device)?;
        let g = s.gpu(device)?;
        if g.config.mig.is_none() || !g.mig_on {
            return Err(NOT_SUPPORTED);
        }
        let gi = g.gis.iter().find(|gi| gi.id == id).ok_or(NOT_FOUND)?;
        put(gpu_instance, gi_handle(gpu, gi))
    })
}

/// `nvmlGpuInstanceGetInfo`.
#[no_mangle]
pub extern "C" fn nvmlGpuInstanceGetInfo(
    gpu_instance: nvmlGpuInstance_t,
    info: *mut nvmlGpuInstanceInfo_t,
) -> nvmlReturn_t {
    with_state(|s| {
        let (gpu, gi) = s.gi_ref(gpu_instance)?;
        put(
            info,
            nvmlGpuInstanceInfo_t {
                device: handle(gpu),
                id: gi.id,
                profileId: gi.profile,
                placement: nvmlGpuInstancePlacement_t {
                    start: gi.placement.start,
                    size: gi.placement.size,
                },
            },
        )
    })
}

/// `nvmlGpuInstanceGetComputeInstanceProfileInfo`: compute-instance profiles up to the GPU
/// instance's slices, shared engines only.
#[no_mangle]
pub extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfo(
    gpu_instance: nvmlGpuInstance_t,
    profile: c_uint,
    eng_profile: c_uint,
    info: *mut nvmlComputeInstanceProfileInfo_t,
) -> nvmlReturn_t {
    with_state(|s| {
        let (_, gi) = s.gi_ref(gpu_instance)?;
        let slices = ci_slices(gi, profile, eng_profile)?;
        let per_slice = gi
            .multiprocessors
            .checked_div(gi.slices)
            .unwrap_or(SMS_PER_SLICE);
        let [copy, decoders, encoders, jpegs, ofas] = engines(gi.slices);
        put(
            info,
            nvmlComputeInstanceProfileInfo_t {
                id: profile,
                sliceCount: slices,
                instanceCount: gi.slices.checked_div(slices).unwrap_or(0),
                multiprocessorCount: per_slice.saturating_mul(slices),
                sharedCopyEngineCount: copy,
                sharedDecoderCount: decoders,
                sharedEncoderCount: encoders,
                sharedJpegCount: jpegs,
                sharedOfaCount: ofas,
            },
        )
    })
}

/// `nvmlGpuInstanceCreateComputeInstance`: at the first free compute slices of the GPU
/// instance (else `INSUFFICIENT_RESOURCES`), CI id the lowest free one from 0. Its MIG device
/// takes the first free slot of the GPU (none free: `INSUFFICIENT_RESOURCES`) with a new
/// UUID; sends `nvmlEventMigConfigChange`.
#[no_mangle]
pub extern "C" fn nvmlGpuInstanceCreateComputeInstance(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    compute_instance: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    with_state(|s| {
        let (gpu, at) = s.gi_find(gpu_instance)?;
        if compute_instance.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let g = s.gpus.get_mut(gpu).ok_or(INVALID_ARGUMENT)?;
        let gi = g.gis.get(at).ok_or(INVALID_ARGUMENT)?;
        let slices = ci_slices(gi, profile_id, CI_ENGINE_SHARED)?;
        let used = gi
            .cis
            .iter()
            .fold(0u32, |sum, ci| sum.saturating_add(ci.slices));
        if used.saturating_add(slices) > gi.slices {
            return Err(INSUFFICIENT_RESOURCES);
        }
        let free = |start: &u32| {
            let end = start.saturating_add(slices);
            gi.cis
                .iter()
                .all(|ci| end <= ci.start || ci.start.saturating_add(ci.slices) <= *start)
        };
        let start = (0..=gi.slices.saturating_sub(slices))
            .find(free)
            .ok_or(INSUFFICIENT_RESOURCES)?;
        let id = (0..=MAX_INSTANCE_ID)
            .find(|id| gi.cis.iter().all(|ci| ci.id != *id))
            .ok_or(INSUFFICIENT_RESOURCES)?;
        let serial = g.created.saturating_add(1);
        let device = MigDeviceConfig {
            uuid: mig_uuid(gpu, gi.id, id, serial),
            gi: gi.id,
            ci: id,
            slices: gi.slices,
            ci_slices: Some(slices),
            memory_mib: gi.memory_mib,
            start: None,
        };
        if !g.add_mig_device(device) {
            return Err(INSUFFICIENT_RESOURCES);
        }
        g.created = serial;
        let gi = g.gis.get_mut(at).ok_or(INVALID_ARGUMENT)?;
        let ci = ComputeInstance {
            id,
            profile: profile_id,
            start,
            slices,
            serial,
        };
        let made = ci_handle(gpu, gi, &ci);
        gi.cis.push(ci);
        s.send(gpu, EVENT_MIG, 0);
        put(compute_instance, made)
    })
}

/// `nvmlGpuInstanceGetComputeInstances`: a profile's compute instances, by id, into an array
/// with room for the profile's instance count in this GPU instance.
#[no_mangle]
pub extern "C" fn nvmlGpuInstanceGetComputeInstances(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    compute_instances: *mut nvmlComputeInstance_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    with_state(|s| {
        let (gpu, gi) = s.gi_ref(gpu_instance)?;
        let slices = ci_slices(gi, profile_id, CI_ENGINE_SHARED)?;
        if compute_instances.is_null() || count.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let room = gi.slices.checked_div(slices).unwrap_or(0) as usize;
        let mut mine: Vec<&ComputeInstance> = gi
            .cis
            .iter()
            .filter(|ci| ci.profile == profile_id)
            .collect();
        mine.sort_by_key(|ci| ci.id);
        let list: Vec<nvmlComputeInstance_t> =
            mine.iter().map(|ci| ci_handle(gpu, gi, ci)).collect();
        put_array(compute_instances, room, &list)?;
        put(count, c_uint::try_from(list.len()).unwrap_or(c_uint::MAX))
    })
}

/// `nvmlComputeInstanceGetInfo_v2`: the placement is in compute slices of the GPU instance.
#[no_mangle]
pub extern "C" fn nvmlComputeInstanceGetInfo_v2(
    compute_instance: nvmlComputeInstance_t,
    info: *mut nvmlComputeInstanceInfo_t,
) -> nvmlReturn_t {
    with_state(|s| {
        let (gpu, i, j) = s.ci_find(compute_instance)?;
        let gi = s
            .gpus
            .get(gpu)
            .and_then(|g| g.gis.get(i))
            .ok_or(INVALID_ARGUMENT)?;
        let ci = gi.cis.get(j).ok_or(INVALID_ARGUMENT)?;
        put(
            info,
            nvmlComputeInstanceInfo_t {
                device: handle(gpu),
                gpuInstance: gi_handle(gpu, gi),
                id: ci.id,
                profileId: ci.profile,
                placement: nvmlComputeInstancePlacement_t {
                    start: ci.start,
                    size: ci.slices,
                },
            },
        )
    })
}

/// `nvmlComputeInstanceDestroy`: its MIG device leaves its slot; sends
/// `nvmlEventMigConfigChange`.
#[no_mangle]
pub extern "C" fn nvmlComputeInstanceDestroy(
    compute_instance: nvmlComputeInstance_t,
) -> nvmlReturn_t {
    with_state(|s| {
        let (gpu, i, j) = s.ci_find(compute_instance)?;
        let g = s.gpus.get_mut(gpu).ok_or(INVALID_ARGUMENT)?;
        let gi = g.gis.get_mut(i).ok_or(INVALID_ARGUMENT)?;
        if j >= gi.cis.len() {
            return Err(INVALID_ARGUMENT);
        }
        let ci = gi.cis.remove(j);
        let gi_id = gi.id;
        for slot in &mut g.migs {
            if slot
                .as_ref()
                .is_some_and(|m| m.gi == gi_id && m.ci == ci.id)
            {
                *slot = None;
            }
        }
        while g.migs.last().is_some_and(Option::is_none) {
            g.migs.pop();
        }
        s.send(gpu, EVENT_MIG, 0);
        Ok(())
    })
}

/// `nvmlGpuInstanceDestroy`: `IN_USE` while it has compute instances; sends
/// `nvmlEventMigConfigChange`. Only created GPU instances have handles, so static
/// `mig_devices` cannot be destroyed.
#[no_mangle]
pub extern "C" fn nvmlGpuInstanceDestroy(gpu_instance: nvmlGpuInstance_t) -> nvmlReturn_t {
    with_state(|s| {
        let (gpu, at) = s.gi_find(gpu_instance)?;
        let g = s.gpus.get_mut(gpu).ok_or(INVALID_ARGUMENT)?;
        if g.gis.get(at).is_none_or(|gi| !gi.cis.is_empty()) {
            return Err(IN_USE);
        }
        g.gis.remove(at);
        s.send(gpu, EVENT_MIG, 0);
        Ok(())
    })
}

/// `nvmlDeviceGetTopologyCommonAncestor`: from the switch, host bridge and NUMA ids.
#[no_mangle]
pub extern "C" fn nvmlDeviceGetTopologyCommonAncestor(
    device1: nvmlDevice_t,
    device2: nvmlDevice_t,
    path: *mut nvmlGpuTopologyLevel_t,
) -> nvmlReturn_t {
    with_state(|s| {
        let a = &s.gpu(device1)?.config;
        let b = &s.gpu(device2)?.config;
        let same = |x: Option<u32>, y: Option<u32>| x.is_some() && x == y;
        let level = if device1 == device2 {
            0 // INTERNAL
        } else if same(a.switch, b.switch) {
            10 // SINGLE
        } else if same(a.host_bridge, b.host_bridge) {
            30 // HOSTBRIDGE
        } else if a.numa == b.numa {
            40 // NODE
        } else {
            50 // SYSTEM
        };
        put(path, level)
    })
}

fn link_remote(gpu: &GpuConfig, link: c_uint) -> Option<Result<u32, String>> {
    let l = link as usize;
    if let Some(&remote) = gpu.nvlinks.get(l) {
        return Some(Ok(remote));
    }
    gpu.nvswitch_links
        .get(l.checked_sub(gpu.nvlinks.len())?)
        .map(|bus| Err(bus.clone()))
}

/// `nvmlDeviceGetNvLinkState`.
#[no_mangle]
pub extern "C" fn nvmlDeviceGetNvLinkState(
    device: nvmlDevice_t,
    link: c_uint,
    active: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    with_state(|s| {
        if link >= MAX_LINKS {
            return Err(INVALID_ARGUMENT);
        }
        let gpu = &s.gpu(device)?.config;
        put(active, u32::from(link_remote(gpu, link).is_some()))
    })
}

/// `nvmlDeviceGetNvLinkRemotePciInfo_v2`.
#[no_mangle]
pub extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo_v2(
    device: nvmlDevice_t,
    link: c_uint,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    with_state(|s| {
        if link >= MAX_LINKS {
            return Err(INVALID_ARGUMENT);
        }
        let gpu = &s.gpu(device)?.config;
        let bus_id = match link_remote(gpu, link).ok_or(NOT_SUPPORTED)? {
            Ok(remote) => s
                .gpus
                .get(remote as usize)
                .ok_or(INVALID_ARGUMENT)?
                .config
                .bus_id
                .clone(),
            Err(switch) => switch,
        };
        put(pci, pci_info(&bus_id))
    })
}

/// `nvmlDeviceGetFieldValues`: only field 230, the GPU recovery action.
#[no_mangle]
pub extern "C" fn nvmlDeviceGetFieldValues(
    device: nvmlDevice_t,
    count: c_int,
    values: *mut nvmlFieldValue_t,
) -> nvmlReturn_t {
    with_state(|s| {
        let gpu = s.gpu(device)?;
        let count = usize::try_from(count).map_err(|_| INVALID_ARGUMENT)?;
        if values.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        for value in field_values(values, count) {
            if value.fieldId == FIELD_RECOVERY_ACTION && s.config.recovery_action {
                value.valueType = 1; // unsigned int
                value.nvmlReturn = SUCCESS;
                value.value.uiVal = gpu.recovery_action;
            } else {
                value.nvmlReturn = NOT_SUPPORTED;
            }
        }
        Ok(())
    })
}

/// `nvmlDeviceGetSupportedEventTypes`.
#[no_mangle]
pub extern "C" fn nvmlDeviceGetSupportedEventTypes(
    device: nvmlDevice_t,
    types: *mut c_ulonglong,
) -> nvmlReturn_t {
    with_state(|s| {
        let gpu = s.gpu(device)?;
        let mut mask = EVENT_SBE | EVENT_DBE | EVENT_XID;
        if gpu.config.mig.is_some() {
            mask |= EVENT_MIG;
        }
        if s.config.recovery_action {
            mask |= EVENT_RECOVERY_ACTION;
        }
        put(types, mask)
    })
}

/// `nvmlEventSetCreate`.
#[no_mangle]
pub extern "C" fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) -> nvmlReturn_t {
    with_state(|s| {
        s.sets.push(Some(Set::default()));
        put(set, s.sets.len() as nvmlEventSet_t)
    })
}

fn set_index(s: &State, set: nvmlEventSet_t) -> Result<usize, nvmlReturn_t> {
    let i = (set as usize).checked_sub(1).ok_or(INVALID_ARGUMENT)?;
    match s.sets.get(i) {
        Some(Some(_)) => Ok(i),
        _ => Err(INVALID_ARGUMENT),
    }
}

/// `nvmlDeviceRegisterEvents`.
#[no_mangle]
pub extern "C" fn nvmlDeviceRegisterEvents(
    device: nvmlDevice_t,
    types: c_ulonglong,
    set: nvmlEventSet_t,
) -> nvmlReturn_t {
    with_state(|s| {
        s.gpu(device)?;
        if s.events_broken {
            return Err(UNKNOWN);
        }
        let set = set_index(s, set)?;
        let index = (device as usize).saturating_sub(1);
        if let Some(gpu) = s.gpus.get_mut(index) {
            gpu.registered.retain(|r| r.0 != set);
            gpu.registered.push((set, types));
        }
        Ok(())
    })
}

/// `nvmlEventSetFree`.
#[no_mangle]
pub extern "C" fn nvmlEventSetFree(set: nvmlEventSet_t) -> nvmlReturn_t {
    with_state(|s| {
        let i = set_index(s, set)?;
        s.sets[i] = None;
        for gpu in &mut s.gpus {
            gpu.registered.retain(|r| r.0 != i);
        }
        Ok(())
    })
}

/// `nvmlEventSetWait_v2`: applies control lines and delivers queued events, polling every
/// 2 ms until the timeout.
#[no_mangle]
pub extern "C" fn nvmlEventSetWait_v2(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeout_ms: c_uint,
) -> nvmlReturn_t {
    let deadline = Instant::now() + Duration::from_millis(u64::from(timeout_ms));
    loop {
        let mut found = None;
        let code = with_state(|s| {
            if s.events_broken {
                return Err(UNKNOWN);
            }
            let i = set_index(s, set)?;
            let Some(Some(queue)) = s.sets.get_mut(i) else {
                return Err(INVALID_ARGUMENT);
            };
            if queue.lost {
                queue.lost = false;
                return Err(GPU_IS_LOST);
            }
            found = queue.events.pop_front();
            Ok(())
        });
        if code != SUCCESS {
            return code;
        }
        if let Some(event) = found {
            return match put(
                data,
                nvmlEventData_t {
                    device: handle(event.device),
                    eventType: event.kind,
                    eventData: event.data,
                    gpuInstanceId: event.gi,
                    computeInstanceId: event.ci,
                },
            ) {
                Ok(()) => SUCCESS,
                Err(code) => code,
            };
        }
        let now = Instant::now();
        if now >= deadline {
            return TIMEOUT;
        }
        std::thread::sleep(CONTROL_POLL.min(deadline - now));
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::collections::BTreeSet;

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
    fn pci_info_splits_the_bus_id() {
        let info = pci_info("00000000:3B:00.0");
        assert_eq!((info.domain, info.bus, info.device), (0, 0x3b, 0));
        let text = unsafe { CStr::from_ptr(info.busId.as_ptr()) };
        assert_eq!(text.to_str().unwrap(), "00000000:3B:00.0");
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

    // The extern functions, called in-process. They share the library's global state, so each
    // test holds `SERIAL` while it installs its own topology and uses it.

    static SERIAL: Mutex<()> = Mutex::new(());
    const PARTITIONS: &str = include_str!("../topologies/a100-partitions.yaml");

    /// Installs `yaml` as an initialised state with nothing kept from earlier tests.
    fn install(yaml: &str) -> MutexGuard<'static, ()> {
        let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        kept().clear();
        reload(yaml);
        guard
    }

    /// As `nvmlInit` with `yaml` as the topology (takes back what the last shutdown kept).
    fn reload(yaml: &str) {
        let mut state = State::new(Config::parse(yaml).unwrap(), None, 0);
        state.users = 1;
        *lock() = Some(state);
    }

    fn gpu(i: u32) -> nvmlDevice_t {
        let mut d = std::ptr::null_mut();
        assert_eq!(nvmlDeviceGetHandleByIndex_v2(i, &mut d), SUCCESS);
        d
    }

    fn place(start: u32, size: u32) -> nvmlGpuInstancePlacement_t {
        nvmlGpuInstancePlacement_t { start, size }
    }

    fn create_gi(
        dev: nvmlDevice_t,
        profile: u32,
        start: u32,
        size: u32,
    ) -> Result<nvmlGpuInstance_t, nvmlReturn_t> {
        let mut gi = std::ptr::null_mut();
        match nvmlDeviceCreateGpuInstanceWithPlacement(dev, profile, &place(start, size), &mut gi) {
            SUCCESS => Ok(gi),
            code => Err(code),
        }
    }

    fn create_ci(
        gi: nvmlGpuInstance_t,
        profile: u32,
    ) -> Result<nvmlComputeInstance_t, nvmlReturn_t> {
        let mut ci = std::ptr::null_mut();
        match nvmlGpuInstanceCreateComputeInstance(gi, profile, &mut ci) {
            SUCCESS => Ok(ci),
            code => Err(code),
        }
    }

    fn text(f: impl FnOnce(*mut c_char, c_uint) -> nvmlReturn_t) -> String {
        let mut buf = [0 as c_char; 96];
        assert_eq!(f(buf.as_mut_ptr(), 96), SUCCESS);
        unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_str()
            .unwrap()
            .to_owned()
    }

    /// The MIG devices in the GPU's slots: (UUID, GI id, CI id, name).
    fn mig_devices(dev: nvmlDevice_t) -> Vec<(String, u32, u32, String)> {
        let mut out = Vec::new();
        for slot in 0..MAX_MIG_DEVICES {
            let mut mig = std::ptr::null_mut();
            match nvmlDeviceGetMigDeviceHandleByIndex(dev, slot, &mut mig) {
                SUCCESS => {}
                NOT_FOUND => continue,
                code => panic!("slot {slot}: {code}"),
            }
            let (mut gi, mut ci) = (0, 0);
            assert_eq!(nvmlDeviceGetGpuInstanceId(mig, &mut gi), SUCCESS);
            assert_eq!(nvmlDeviceGetComputeInstanceId(mig, &mut ci), SUCCESS);
            let uuid = text(|b, l| nvmlDeviceGetUUID(mig, b, l));
            let name = text(|b, l| nvmlDeviceGetName(mig, b, l));
            out.push((uuid, gi, ci, name));
        }
        out
    }

    fn is_mig_uuid(uuid: &str) -> bool {
        let parts: Vec<&str> = uuid.split('-').collect();
        let hex = |p: &str| p.chars().all(|c| c.is_ascii_hexdigit());
        parts.len() == 6
            && parts[0] == "MIG"
            && [8, 4, 4, 4, 12]
                .iter()
                .zip(&parts[1..])
                .all(|(&n, p)| p.len() == n && hex(p))
            && parts[3].starts_with('4')
            && parts[4].starts_with('8')
    }

    #[test]
    fn profiles_and_placements_answer_from_the_config() {
        let _serial = install(PARTITIONS);
        let dev = gpu(0);
        let mut info: nvmlGpuInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
        assert_eq!(
            nvmlDeviceGetGpuInstanceProfileInfo(dev, 4, &mut info),
            SUCCESS
        );
        assert_eq!(
            (
                info.id,
                info.sliceCount,
                info.instanceCount,
                info.multiprocessorCount
            ),
            (4, 7, 1, 98)
        );
        assert_eq!((info.memorySizeMB, info.copyEngineCount), (40192, 7));
        assert_eq!(
            nvmlDeviceGetGpuInstanceProfileInfo(dev, 0, &mut info),
            SUCCESS
        );
        assert_eq!(
            (info.sliceCount, info.instanceCount, info.memorySizeMB),
            (1, 7, 4864)
        );
        // Not an A100 40GB profile; beyond NVML's ids.
        assert_eq!(
            nvmlDeviceGetGpuInstanceProfileInfo(dev, 5, &mut info),
            NOT_SUPPORTED
        );
        assert_eq!(
            nvmlDeviceGetGpuInstanceProfileInfo(dev, 17, &mut info),
            INVALID_ARGUMENT
        );
        let mut v2: nvmlGpuInstanceProfileInfo_v2_t = unsafe { std::mem::zeroed() };
        assert_eq!(
            nvmlDeviceGetGpuInstanceProfileInfoV(dev, 7, &mut v2),
            SUCCESS
        );
        let name = unsafe { CStr::from_ptr(v2.name.as_ptr()) };
        assert_eq!((name.to_str().unwrap(), v2.sliceCount), ("MIG 1g.10gb", 1));

        // The count query, too small an array, then the list.
        let mut count = 0;
        let none = std::ptr::null_mut();
        assert_eq!(
            nvmlDeviceGetGpuInstancePossiblePlacements_v2(dev, 0, none, &mut count),
            SUCCESS
        );
        assert_eq!(count, 7);
        let mut list = [place(99, 99); 7];
        count = 3;
        assert_eq!(
            nvmlDeviceGetGpuInstancePossiblePlacements_v2(dev, 0, list.as_mut_ptr(), &mut count),
            INSUFFICIENT_SIZE
        );
        assert_eq!((count, list[0].start), (7, 99));
        count = 7;
        assert_eq!(
            nvmlDeviceGetGpuInstancePossiblePlacements_v2(dev, 2, list.as_mut_ptr(), &mut count),
            SUCCESS
        );
        assert_eq!(count, 2);
        let got: Vec<(u32, u32)> = list[..2].iter().map(|p| (p.start, p.size)).collect();
        assert_eq!(got, [(0, 4), (4, 4)]);
        assert_eq!(
            nvmlDeviceGetGpuInstancePossiblePlacements_v2(dev, 5, none, &mut count),
            NOT_SUPPORTED
        );

        // MIG capable but off: profiles and placements answer, creating does not. No MIG:
        // NOT_SUPPORTED.
        let yaml = PARTITIONS.replacen("mig: true", "mig: false", 1);
        drop(_serial);
        let _serial = install(&yaml);
        let dev = gpu(0);
        assert_eq!(
            nvmlDeviceGetGpuInstanceProfileInfo(dev, 1, &mut info),
            SUCCESS
        );
        assert_eq!(
            nvmlDeviceGetGpuInstancePossiblePlacements_v2(dev, 1, none, &mut count),
            SUCCESS
        );
        assert_eq!(count, 3);
        assert_eq!(create_gi(dev, 1, 0, 2), Err(NOT_SUPPORTED));
        assert!(create_gi(gpu(1), 1, 0, 2).is_ok());
        drop(_serial);
        let _serial = install(
            "gpus:\n  - {uuid: GPU-a, name: x, memory_mib: 1, bus_id: '00000000:01:00.0'}\n",
        );
        assert_eq!(
            nvmlDeviceGetGpuInstanceProfileInfo(gpu(0), 0, &mut info),
            NOT_SUPPORTED
        );
        assert_eq!(
            nvmlDeviceGetGpuInstancePossiblePlacements_v2(gpu(0), 0, none, &mut count),
            NOT_SUPPORTED
        );
    }

    #[test]
    fn gpu_instances_may_not_overlap_in_memory_or_exceed_the_compute_slices() {
        let _serial = install(PARTITIONS);
        let dev = gpu(0);
        let one = create_gi(dev, 0, 0, 1).unwrap();
        // 2g.10gb at 0 covers memory slice 0; 7g.40gb needs the whole GPU.
        assert_eq!(create_gi(dev, 1, 0, 2), Err(INSUFFICIENT_RESOURCES));
        assert_eq!(create_gi(dev, 4, 0, 8), Err(INSUFFICIENT_RESOURCES));
        // Not one of 2g.10gb's placements.
        assert_eq!(create_gi(dev, 1, 1, 2), Err(INVALID_ARGUMENT));
        assert_eq!(create_gi(dev, 1, 0, 1), Err(INVALID_ARGUMENT));
        let two = create_gi(dev, 1, 2, 2).unwrap();
        let mut info: nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
        assert_eq!(nvmlGpuInstanceGetInfo(one, &mut info), SUCCESS);
        assert_eq!((info.device, info.id, info.profileId), (dev, 1, 0));
        assert_eq!(nvmlGpuInstanceGetInfo(two, &mut info), SUCCESS);
        assert_eq!((info.id, info.profileId), (2, 1));
        assert_eq!((info.placement.start, info.placement.size), (2, 2));
        // 3g at 4: 1 + 2 + 3 = 6 compute slices; a second 3g does not fit memory, a 1g at
        // memory slice 1 is the seventh compute slice.
        let three = create_gi(dev, 2, 4, 4).unwrap();
        assert_eq!(create_gi(dev, 2, 0, 4), Err(INSUFFICIENT_RESOURCES));
        let last = create_gi(dev, 0, 1, 1).unwrap();
        // Lists and ids.
        let mut list = [std::ptr::null_mut(); 7];
        let mut count = 0;
        assert_eq!(
            nvmlDeviceGetGpuInstances(dev, 0, list.as_mut_ptr(), &mut count),
            SUCCESS
        );
        assert_eq!(&list[..count as usize], [one, last]);
        assert_eq!(
            nvmlDeviceGetGpuInstances(dev, 0, std::ptr::null_mut(), &mut count),
            INVALID_ARGUMENT
        );
        let mut found = std::ptr::null_mut();
        assert_eq!(nvmlDeviceGetGpuInstanceById(dev, 3, &mut found), SUCCESS);
        assert_eq!(found, three);
        assert_eq!(nvmlDeviceGetGpuInstanceById(dev, 9, &mut found), NOT_FOUND);
        // The other GPU is untouched; handles of the four kinds differ.
        assert!(create_gi(gpu(1), 4, 0, 8).is_ok());
        let kinds = [dev as usize, one as usize, gpu(1) as usize];
        assert_eq!(kinds.iter().collect::<BTreeSet<_>>().len(), 3);

        // Compute slices run out while memory is free: a static 4g device without `start`
        // holds 4 compute slices and no memory.
        let yaml = PARTITIONS.replacen(
            "    compute_slices: 7\n",
            "    compute_slices: 7\n    mig_devices: [{uuid: MIG-s, gi: 1, slices: 4, memory_mib: 19968}]\n",
            1,
        );
        drop(_serial);
        let _serial = install(&yaml);
        let dev = gpu(0);
        let big = create_gi(dev, 2, 4, 4).unwrap();
        let mut info: nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
        assert_eq!(nvmlGpuInstanceGetInfo(big, &mut info), SUCCESS);
        assert_eq!(info.id, 2, "the static device's GI id 1 is taken");
        assert_eq!(create_gi(dev, 0, 0, 1), Err(INSUFFICIENT_RESOURCES));
        assert_eq!(nvmlGpuInstanceDestroy(big), SUCCESS);
        assert!(create_gi(dev, 0, 0, 1).is_ok());
        // With `start: 0` it holds memory slices 0-3 as well.
        let yaml = yaml.replace("memory_mib: 19968}]", "memory_mib: 19968, start: 0}]");
        drop(_serial);
        let _serial = install(&yaml);
        assert_eq!(create_gi(gpu(0), 0, 3, 1), Err(INSUFFICIENT_RESOURCES));
        let kept = create_gi(gpu(0), 0, 4, 1).unwrap();
        // A `mig` control line: the layout replaces the created instances.
        assert_eq!(
            with_state(|s| s.apply("mig 0 off").map_err(|_| UNKNOWN)),
            SUCCESS
        );
        let mut count = 0;
        let mut list = [std::ptr::null_mut(); 7];
        assert_eq!(
            nvmlDeviceGetGpuInstances(gpu(0), 0, list.as_mut_ptr(), &mut count),
            NOT_SUPPORTED
        );
        let mut info: nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
        assert_eq!(nvmlGpuInstanceGetInfo(kept, &mut info), INVALID_ARGUMENT);
    }

    #[test]
    fn compute_instances_make_mig_devices_and_block_their_gpu_instance() {
        let _serial = install(PARTITIONS);
        let dev = gpu(0);
        assert!(mig_devices(dev).is_empty());
        let gi = create_gi(dev, 2, 4, 4).unwrap();
        let mut info: nvmlComputeInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
        assert_eq!(
            nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 2, 0, &mut info),
            SUCCESS
        );
        assert_eq!(
            (
                info.sliceCount,
                info.instanceCount,
                info.multiprocessorCount
            ),
            (3, 1, 42)
        );
        assert_eq!(
            nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 0, 0, &mut info),
            SUCCESS
        );
        assert_eq!((info.sliceCount, info.instanceCount), (1, 3));
        assert_eq!(
            nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 3, 0, &mut info),
            NOT_SUPPORTED
        );
        assert_eq!(
            nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 2, 1, &mut info),
            NOT_SUPPORTED
        );
        assert_eq!(
            nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 8, 0, &mut info),
            INVALID_ARGUMENT
        );

        let ci = create_ci(gi, 2).unwrap();
        let devices = mig_devices(dev);
        assert_eq!(devices.len(), 1);
        let (uuid, gi_id, ci_id, name) = devices[0].clone();
        assert!(is_mig_uuid(&uuid), "{uuid}");
        assert_eq!((gi_id, ci_id), (1, 0));
        assert_eq!(name, "NVIDIA A100-SXM4-40GB MIG 3g.20gb");
        let mut mig = std::ptr::null_mut();
        assert_eq!(
            nvmlDeviceGetMigDeviceHandleByIndex(dev, 0, &mut mig),
            SUCCESS
        );
        let mut attrs: nvmlDeviceAttributes_t = unsafe { std::mem::zeroed() };
        assert_eq!(nvmlDeviceGetAttributes_v2(mig, &mut attrs), SUCCESS);
        assert_eq!(
            (
                attrs.gpuInstanceSliceCount,
                attrs.computeInstanceSliceCount,
                attrs.memorySizeMB
            ),
            (3, 3, 19968)
        );
        let mut parent = std::ptr::null_mut();
        assert_eq!(
            nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig, &mut parent),
            SUCCESS
        );
        assert_eq!(parent, dev);
        let mut ci_info: nvmlComputeInstanceInfo_t = unsafe { std::mem::zeroed() };
        assert_eq!(nvmlComputeInstanceGetInfo_v2(ci, &mut ci_info), SUCCESS);
        assert_eq!(
            (
                ci_info.device,
                ci_info.gpuInstance,
                ci_info.id,
                ci_info.profileId
            ),
            (dev, gi, 0, 2)
        );
        assert_eq!((ci_info.placement.start, ci_info.placement.size), (0, 3));
        // The GI's compute slices are all taken.
        assert_eq!(create_ci(gi, 0), Err(INSUFFICIENT_RESOURCES));
        let mut list = [std::ptr::null_mut(); 1];
        let mut count = 0;
        assert_eq!(
            nvmlGpuInstanceGetComputeInstances(gi, 2, list.as_mut_ptr(), &mut count),
            SUCCESS
        );
        assert_eq!((count, list[0]), (1, ci));

        // Not while it has a compute instance; then the CI, then the GI.
        assert_eq!(nvmlGpuInstanceDestroy(gi), IN_USE);
        assert_eq!(nvmlComputeInstanceDestroy(ci), SUCCESS);
        assert!(mig_devices(dev).is_empty());
        assert_eq!(nvmlComputeInstanceDestroy(ci), INVALID_ARGUMENT);
        assert_eq!(
            nvmlComputeInstanceGetInfo_v2(ci, &mut ci_info),
            INVALID_ARGUMENT
        );
        assert_eq!(nvmlGpuInstanceDestroy(gi), SUCCESS);
        assert_eq!(nvmlGpuInstanceDestroy(gi), INVALID_ARGUMENT);
        let mut found = std::ptr::null_mut();
        assert_eq!(nvmlDeviceGetGpuInstanceById(dev, 1, &mut found), NOT_FOUND);

        // Re-created with the same ids: new handles, a new UUID.
        let again = create_gi(dev, 2, 4, 4).unwrap();
        assert_ne!(again, gi);
        let ci_again = create_ci(again, 2).unwrap();
        assert_ne!(ci_again, ci);
        // The old handles do not name the new instances.
        let mut gi_info: nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
        assert_eq!(nvmlGpuInstanceGetInfo(gi, &mut gi_info), INVALID_ARGUMENT);
        assert_eq!(
            nvmlComputeInstanceGetInfo_v2(ci, &mut ci_info),
            INVALID_ARGUMENT
        );
        assert_eq!(nvmlGpuInstanceGetInfo(again, &mut gi_info), SUCCESS);
        let devices = mig_devices(dev);
        assert_eq!(devices.len(), 1);
        assert_eq!((devices[0].1, devices[0].2), (1, 0));
        assert!(is_mig_uuid(&devices[0].0));
        assert_ne!(devices[0].0, uuid);

        // Several compute instances in a 7g GPU instance (on the other GPU): 4 + 2 + 1, then
        // nothing; one destroyed leaves a hole in the slots that the next one fills.
        let whole = create_gi(gpu(1), 4, 0, 8).unwrap();
        let four = create_ci(whole, 3).unwrap();
        let two = create_ci(whole, 1).unwrap();
        let one = create_ci(whole, 0).unwrap();
        assert_eq!(create_ci(whole, 0), Err(INSUFFICIENT_RESOURCES));
        let ids: Vec<(u32, u32)> = mig_devices(gpu(1)).iter().map(|d| (d.1, d.2)).collect();
        assert_eq!(ids, [(1, 0), (1, 1), (1, 2)]);
        assert_eq!(nvmlComputeInstanceGetInfo_v2(one, &mut ci_info), SUCCESS);
        assert_eq!((ci_info.placement.start, ci_info.placement.size), (6, 1));
        assert_eq!(nvmlComputeInstanceDestroy(two), SUCCESS);
        assert_eq!(
            nvmlDeviceGetMigDeviceHandleByIndex(gpu(1), 1, &mut mig),
            NOT_FOUND
        );
        let two_again = create_ci(whole, 1).unwrap();
        let ids: Vec<(u32, u32)> = mig_devices(gpu(1)).iter().map(|d| (d.1, d.2)).collect();
        assert_eq!(ids, [(1, 0), (1, 1), (1, 2)]);
        for ci in [four, two_again, one] {
            assert_eq!(nvmlComputeInstanceDestroy(ci), SUCCESS);
        }
        assert_eq!(nvmlGpuInstanceDestroy(whole), SUCCESS);
        assert!(mig_devices(gpu(1)).is_empty());
    }

    #[test]
    fn xid_lines_carry_the_instance_ids_they_name_and_none_otherwise() {
        let _serial = install(PARTITIONS);
        let mut set = std::ptr::null_mut();
        assert_eq!(nvmlEventSetCreate(&mut set), SUCCESS);
        assert_eq!(nvmlDeviceRegisterEvents(gpu(0), EVENT_XID, set), SUCCESS);
        let apply = |line: &str| lock().as_mut().unwrap().apply(line);
        let mut data: nvmlEventData_t = unsafe { std::mem::zeroed() };
        apply("xid 0 79 1 gi=9 ci=0").unwrap();
        assert_eq!(nvmlEventSetWait_v2(set, &mut data, 0), SUCCESS);
        assert_eq!(
            (data.eventData, data.gpuInstanceId, data.computeInstanceId),
            (79, 9, 0)
        );
        assert_eq!(lock().as_ref().unwrap().gpus[0].recovery_action, 1);
        // The ids go anywhere after the code; without them, not attributed.
        apply("xid 0 48 gi=3 2").unwrap();
        assert_eq!(nvmlEventSetWait_v2(set, &mut data, 0), SUCCESS);
        assert_eq!((data.gpuInstanceId, data.computeInstanceId), (3, u32::MAX));
        assert_eq!(lock().as_ref().unwrap().gpus[0].recovery_action, 2);
        apply("xid 0 13").unwrap();
        assert_eq!(nvmlEventSetWait_v2(set, &mut data, 0), SUCCESS);
        assert_eq!(
            (data.eventData, data.gpuInstanceId, data.computeInstanceId),
            (13, u32::MAX, u32::MAX)
        );
        assert!(apply("xid 0 13 gi=x").is_err());
        assert!(apply("xid 0 13 1 2").is_err());
        assert_eq!(nvmlEventSetWait_v2(set, &mut data, 0), TIMEOUT);
    }

    #[test]
    fn creating_and_destroying_send_the_mig_event_to_the_gpu_registered() {
        let _serial = install(PARTITIONS);
        let mut set = std::ptr::null_mut();
        assert_eq!(nvmlEventSetCreate(&mut set), SUCCESS);
        assert_eq!(nvmlDeviceRegisterEvents(gpu(0), EVENT_MIG, set), SUCCESS);
        let mut data: nvmlEventData_t = unsafe { std::mem::zeroed() };
        let gi = create_gi(gpu(1), 0, 0, 1).unwrap();
        assert_eq!(nvmlGpuInstanceDestroy(gi), SUCCESS);
        assert_eq!(nvmlEventSetWait_v2(set, &mut data, 0), TIMEOUT);
        let gi = create_gi(gpu(0), 0, 0, 1).unwrap();
        let ci = create_ci(gi, 0).unwrap();
        assert_eq!(nvmlComputeInstanceDestroy(ci), SUCCESS);
        assert_eq!(nvmlGpuInstanceDestroy(gi), SUCCESS);
        for _ in 0..4 {
            assert_eq!(nvmlEventSetWait_v2(set, &mut data, 0), SUCCESS);
            assert_eq!((data.device, data.eventType), (gpu(0), EVENT_MIG));
        }
        assert_eq!(nvmlEventSetWait_v2(set, &mut data, 0), TIMEOUT);
    }

    #[test]
    fn created_instances_outlive_shutdown_and_init() {
        let _serial = install(PARTITIONS);
        let gi = create_gi(gpu(0), 1, 2, 2).unwrap();
        create_ci(gi, 1).unwrap();
        let before = mig_devices(gpu(0));
        assert_eq!(nvmlShutdown(), SUCCESS);
        assert_eq!(nvmlGpuInstanceDestroy(gi), UNINITIALIZED);
        reload(PARTITIONS);
        assert_eq!(mig_devices(gpu(0)), before);
        let mut found = std::ptr::null_mut();
        assert_eq!(nvmlDeviceGetGpuInstanceById(gpu(0), 1, &mut found), SUCCESS);
        assert_eq!(found, gi);
        assert_eq!(create_gi(gpu(0), 1, 2, 2), Err(INSUFFICIENT_RESOURCES));
        // The creation count goes on: the next UUID is new.
        let other = create_gi(gpu(0), 1, 4, 2).unwrap();
        create_ci(other, 1).unwrap();
        let uuids: BTreeSet<String> = mig_devices(gpu(0)).into_iter().map(|d| d.0).collect();
        assert_eq!(uuids.len(), 2);
        // Reloaded with MIG off, they are gone.
        assert_eq!(nvmlShutdown(), SUCCESS);
        reload(&PARTITIONS.replacen("mig: true", "mig: false", 1));
        let mut count = 0;
        let mut list = [std::ptr::null_mut(); 3];
        assert_eq!(
            nvmlDeviceGetGpuInstances(gpu(0), 1, list.as_mut_ptr(), &mut count),
            NOT_SUPPORTED
        );
        assert_eq!(nvmlShutdown(), SUCCESS);
        reload(PARTITIONS);
        assert!(mig_devices(gpu(0)).is_empty());
    }

    #[test]
    fn static_mig_devices_still_answer_as_before() {
        let _serial = install(include_str!("../topologies/a100-mig.yaml"));
        let devices = mig_devices(gpu(0));
        let ids: Vec<(u32, u32)> = devices.iter().map(|d| (d.1, d.2)).collect();
        assert_eq!(ids, [(2, 0), (3, 0), (9, 0), (10, 0)]);
        assert_eq!(devices[0].0, "MIG-a1000000-0000-4000-8000-000000000000");
        let mut mig = std::ptr::null_mut();
        assert_eq!(
            nvmlDeviceGetMigDeviceHandleByIndex(gpu(0), 4, &mut mig),
            NOT_FOUND
        );
        assert_eq!(
            nvmlDeviceGetMigDeviceHandleByIndex(gpu(2), 0, &mut mig),
            NOT_FOUND
        );
        // No mig_profiles here: no instances to create.
        let mut info: nvmlGpuInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
        assert_eq!(
            nvmlDeviceGetGpuInstanceProfileInfo(gpu(0), 0, &mut info),
            NOT_SUPPORTED
        );
        assert_eq!(
            with_state(|s| s.apply("mig 2 all-1g").map_err(|_| UNKNOWN)),
            SUCCESS
        );
        assert_eq!(mig_devices(gpu(2)).len(), 7);
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
