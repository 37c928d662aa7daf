//! The seam between the `nvidia` backend and NVML: a small trait over owned data (no
//! lifetimes, no NVML types), implemented by `nvml` with `nvml-wrapper`. Everything
//! else in the backend (discovery into devices, health, allocation) works on these types.

use std::time::Duration;

/// One GPU as NVML reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// NVML index.
    pub index: u32,
    /// `GPU-…` UUID: the device id, as NVIDIA's plugin uses.
    pub uuid: String,
    /// Product name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// Minor number: the node is `/dev/nvidia<minor>`.
    pub minor: u32,
    /// Total memory in bytes.
    pub memory_bytes: u64,
    /// PCI address as sysfs names it (`0000:3b:00.0`).
    pub bus_id: String,
    /// One entry per active NVLink: the PCI address at the other end (a GPU or an NVSwitch).
    pub nvlinks: Vec<String>,
    /// CUDA compute capability `(major, minor)`, e.g. `(9, 0)`; `None` where NVML does not say.
    pub compute_capability: Option<(u32, u32)>,
    /// Whether the GPU supports MIG (NVML answers its MIG mode), on or off.
    pub mig_capable: bool,
    /// Whether MIG mode is on (then, with `mig_strategy: none`, it is still served whole).
    pub mig_enabled: bool,
    /// Its MIG devices (empty when MIG is off).
    pub migs: Vec<MigInfo>,
    /// The GPU-instance profiles it offers and where each can be placed (read only with
    /// `mig_strategy: dynamic`, for a GPU in MIG mode; empty otherwise).
    pub mig_profiles: Vec<GiProfile>,
}

/// One GPU-instance profile of a GPU in MIG mode (`nvmlGpuInstanceProfileInfo_t`) with its
/// possible placements (`nvmlDeviceGetGpuInstancePossiblePlacements_v2`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GiProfile {
    /// NVML's profile id (`NVML_GPU_INSTANCE_PROFILE_1_SLICE` = 0, …).
    pub id: u32,
    /// Compute slices (`sliceCount`).
    pub slices: u32,
    /// Memory in MiB (`memorySizeMB`).
    pub memory_mib: u64,
    /// Where an instance can start and how many memory slices it spans, `(start, size)`.
    pub placements: Vec<(u32, u32)>,
}

/// One MIG device of a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigInfo {
    /// `MIG-…` UUID: the device id.
    pub uuid: String,
    /// Its profile as NVIDIA's plugin names it, e.g. `1g.5gb` or `1c.2g.10gb`.
    pub profile: String,
    /// GPU instance id (for the caps nodes).
    pub gi: u32,
    /// Compute instance id (for the caps nodes).
    pub ci: u32,
    /// Its memory in bytes.
    pub memory_bytes: u64,
    /// What the MIG device has of the GPU (`nvmlDeviceGetAttributes_v2`), for the node labels.
    pub attributes: MigAttributes,
}

/// A MIG device's share of its GPU as NVML reports it (`nvmlDeviceAttributes_t`): what GPU
/// Feature Discovery labels as `multiprocessors`, `slices.gi`, `slices.ci` and `engines.*`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MigAttributes {
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// GPU-instance slices.
    pub gi_slices: u32,
    /// Compute-instance slices.
    pub ci_slices: u32,
    /// Copy engines.
    pub copy_engines: u32,
    /// Video decoders.
    pub decoders: u32,
    /// Video encoders.
    pub encoders: u32,
    /// JPEG engines.
    pub jpeg_engines: u32,
    /// Optical-flow accelerators.
    pub ofa_engines: u32,
}

/// The profile name NVIDIA's plugin gives a MIG device (go-nvlib's rule): `<g>g.<m>gb` where
/// `g` is the GPU-instance slice count, or `<c>c.<g>g.<m>gb` when the compute instance has
/// fewer slices `c`; `m` is the device's share of the parent's memory, rounded up to eighths,
/// times the parent's memory in GiB (rounded up), rounded to the nearest GB.
pub fn mig_profile(gi_slices: u32, ci_slices: u32, memory_mib: u64, parent_bytes: u64) -> String {
    const MIB: u128 = 1 << 20;
    const GIB: u128 = 1 << 30;
    let total = u128::from(parent_bytes.max(1));
    let bytes = u128::from(memory_mib).saturating_mul(MIB);
    // ceil(bytes * 8 / total) eighths of the GPU.
    let eighths = bytes.saturating_mul(8).div_ceil(total);
    let total_gib = total.div_ceil(GIB);
    // round(eighths * total_gib / 8)
    let gb = eighths.saturating_mul(total_gib).saturating_add(4) / 8;
    if ci_slices != 0 && ci_slices < gi_slices {
        format!("{ci_slices}c.{gi_slices}g.{gb}gb")
    } else {
        format!("{gi_slices}g.{gb}gb")
    }
}

/// NVML's PCIe common-ancestor level between two GPUs, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum PcieLevel {
    /// The same board (e.g. two GPUs of one card).
    Internal,
    /// One PCIe switch between them.
    Single,
    /// Several PCIe switches, no host bridge.
    Multiple,
    /// The same host bridge.
    HostBridge,
    /// The same NUMA node.
    Node,
    /// Across the CPU interconnect.
    System,
}

impl PcieLevel {
    /// go-gpuallocator's score for the level (higher is better).
    pub fn score(self) -> u32 {
        match self {
            PcieLevel::Internal => 60,
            PcieLevel::Single => 50,
            PcieLevel::Multiple => 40,
            PcieLevel::HostBridge => 30,
            PcieLevel::Node => 20,
            PcieLevel::System => 10,
        }
    }
}

/// Everything discovery learns in one pass.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Snapshot {
    /// The GPUs, in index order.
    pub gpus: Vec<GpuInfo>,
    /// `pcie[i][j]`: the level between GPUs `i` and `j` (by position in `gpus`); `None` where
    /// NVML could not tell.
    pub pcie: Vec<Vec<Option<PcieLevel>>>,
    /// The GPUs NVML counts but could not read (lost: fallen off the bus), not in `gpus`.
    pub lost: Vec<LostGpu>,
}

/// A GPU NVML counts but could not read at discovery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LostGpu {
    /// Its NVML index.
    pub index: u32,
    /// What could not be read, and why.
    pub reason: String,
}

impl Snapshot {
    /// The snapshot with `known` (the GPUs an earlier discovery served) in the places of its
    /// lost GPUs of the same index, in index order, their PCIe levels unknown, so that they stay
    /// listed (and found lost by the health watch) while the others are served. A lost GPU that
    /// `known` lacks is left out: the earlier discovery did not serve it either. With nothing
    /// known (a first discovery) a lost GPU fails discovery, which is retried: it may be one
    /// this resource serves.
    pub fn with_lost_as_known(self, known: &[GpuInfo]) -> Result<Snapshot, String> {
        let mut carried = Vec::new();
        for lost in &self.lost {
            match known.iter().find(|g| g.index == lost.index) {
                Some(g) => carried.push(g.clone()),
                None if known.is_empty() => return Err(lost.reason.clone()),
                None => {}
            }
        }
        if carried.is_empty() {
            return Ok(self);
        }
        // Every GPU with its old position (None: carried), in index order.
        let mut all: Vec<(GpuInfo, Option<usize>)> = self
            .gpus
            .into_iter()
            .enumerate()
            .map(|(i, g)| (g, Some(i)))
            .chain(carried.into_iter().map(|g| (g, None)))
            .collect();
        all.sort_by_key(|(g, _)| g.index);
        let pcie = all
            .iter()
            .map(|(_, a)| {
                all.iter()
                    .map(|(_, b)| {
                        let (a, b) = ((*a)?, (*b)?);
                        self.pcie.get(a)?.get(b).copied().flatten()
                    })
                    .collect()
            })
            .collect();
        Ok(Snapshot {
            gpus: all.into_iter().map(|(g, _)| g).collect(),
            pcie,
            lost: self.lost,
        })
    }
}

/// An event NVML delivered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RawEvent {
    /// A critical XID on a GPU.
    Xid {
        /// The GPU's UUID.
        uuid: String,
        /// The XID.
        xid: u64,
        /// The GPU instance NVML attributes it to (`gpuInstanceId`; `None` for
        /// `0xFFFFFFFF`, not attributed: the whole GPU).
        gi: Option<u32>,
        /// The compute instance NVML attributes it to (`computeInstanceId`; `None` for
        /// `0xFFFFFFFF`).
        ci: Option<u32>,
    },
    /// A double-bit ECC error.
    DoubleBitEcc {
        /// The GPU's UUID.
        uuid: String,
    },
    /// The GPU's MIG layout changed (`nvmlEventMigConfigChange`): discover again.
    MigChanged {
        /// The (parent) GPU's UUID.
        uuid: String,
    },
    /// Anything else about a GPU, e.g. a change of its recovery action (event 0x8000, which
    /// nvml-wrapper hands over with an empty type): look at the GPU again.
    Other {
        /// The GPU's UUID.
        uuid: String,
    },
}

/// Why a wait ended without an event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WaitError {
    /// Nothing happened before the timeout.
    Timeout,
    /// A GPU fell off the bus; which one is not said.
    GpuLost,
    /// NVML failed; the event set must be rebuilt.
    Failed(String),
}

/// NVML's GPU recovery action (field 230).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecoveryAction {
    /// Nothing to do: the GPU is usable.
    None,
    /// Reset the GPU.
    GpuReset,
    /// Reboot the node.
    NodeReboot,
    /// Drain peer-to-peer traffic.
    DrainP2p,
    /// Drain, then reset.
    DrainAndReset,
    /// A value this code does not know.
    Other(u32),
}

impl RecoveryAction {
    /// From the raw field value.
    pub fn from_raw(v: u32) -> Self {
        match v {
            0 => RecoveryAction::None,
            1 => RecoveryAction::GpuReset,
            2 => RecoveryAction::NodeReboot,
            3 => RecoveryAction::DrainP2p,
            4 => RecoveryAction::DrainAndReset,
            other => RecoveryAction::Other(other),
        }
    }

    /// NVML's name for it.
    pub fn name(self) -> String {
        match self {
            RecoveryAction::None => "NONE".into(),
            RecoveryAction::GpuReset => "GPU_RESET".into(),
            RecoveryAction::NodeReboot => "NODE_REBOOT".into(),
            RecoveryAction::DrainP2p => "DRAIN_P2P".into(),
            RecoveryAction::DrainAndReset => "DRAIN_AND_RESET".into(),
            RecoveryAction::Other(v) => format!("unknown ({v})"),
        }
    }
}

/// An open NVML: what the backend asks of it. All answers are owned data.
pub trait GpuSession {
    /// Enumerates the GPUs with their links and PCIe levels.
    fn snapshot(&mut self) -> Result<Snapshot, String>;
    /// The GPU's recovery action; `Ok(None)` where the driver does not have it.
    fn recovery_action(&mut self, index: u32) -> Result<Option<RecoveryAction>, String>;
    /// True if the GPU at `index` answers with this UUID (a probe a lost GPU fails).
    fn probe(&mut self, index: u32, uuid: &str) -> bool;
    /// (Re)builds the event set for these GPUs, for health events if `health`, and for MIG
    /// layout changes if `mig`; returns the UUIDs left out of it (no events
    /// supported, not answering, registration refused) with the reason, so that one bad GPU
    /// never blinds the others. An error means no events at all.
    fn arm(
        &mut self,
        gpus: &[GpuInfo],
        health: bool,
        mig: bool,
    ) -> Result<Vec<(String, String)>, String>;
    /// Waits up to `timeout` for one event.
    fn wait(&mut self, timeout: Duration) -> Result<RawEvent, WaitError>;
    /// The library this session loaded (an absolute path, when it was loaded by one) and the
    /// driver version it reports, for finding the driver's other files.
    fn driver(&mut self) -> DriverInfo {
        DriverInfo::default()
    }
}

/// Where the driver is and which version it is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DriverInfo {
    /// The `libnvidia-ml.so.1` loaded, if loaded by an absolute path.
    pub library: Option<std::path::PathBuf>,
    /// The driver version (`550.54.15`).
    pub version: Option<String>,
    /// The newest CUDA version the driver supports `(major, minor)`, e.g. `(12, 4)`
    /// (`nvmlSystemGetCudaDriverVersion_v2`).
    pub cuda_version: Option<(u32, u32)>,
}

/// Opens NVML and runs a session on it. `Err` means the driver is not there or not ready,
/// with the reason.
pub trait GpuDriver: Send + 'static {
    /// Loads the library and initialises NVML, then hands the session to `body` and returns
    /// what it returns (NVML is shut down after).
    fn open(
        &mut self,
        body: &mut dyn FnMut(&mut dyn GpuSession) -> SessionEnd,
    ) -> Result<SessionEnd, String>;
}

/// Makes and removes MIG partitions (`mig_strategy: dynamic`): a GPU instance of a profile at
/// a placement, with the compute instance that spans it. Called from allocation, on any thread.
pub trait MigPartitioner: Send + Sync + 'static {
    /// Creates the partition of `profile` at memory slice `start` (span `size`) on GPU `gpu`
    /// (its UUID), or takes the one already there, and returns its MIG device.
    fn create(
        &self,
        gpu: &str,
        profile: &GiProfile,
        start: u32,
        size: u32,
    ) -> Result<MigInfo, String>;
    /// Destroys the partition of `profile` at memory slice `start` on GPU `gpu`; `Ok(false)`
    /// when there is none (already gone).
    fn destroy(&self, gpu: &str, profile: u32, start: u32) -> Result<bool, String>;
}

/// Why a session ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionEnd {
    /// The backend is stopping.
    Stop,
    /// Start again (re-open NVML), for this reason.
    Reopen(String),
}

#[cfg(test)]
mod tests {
    use super::mig_profile;

    #[test]
    fn mig_profiles_are_named_as_nvidia_names_them() {
        let a100_40 = 40_960u64 << 20;
        assert_eq!(mig_profile(1, 1, 4864, a100_40), "1g.5gb");
        assert_eq!(mig_profile(2, 2, 9856, a100_40), "2g.10gb");
        assert_eq!(mig_profile(3, 3, 19_968, a100_40), "3g.20gb");
        assert_eq!(mig_profile(7, 7, 40_192, a100_40), "7g.40gb");
        assert_eq!(mig_profile(3, 1, 19_968, a100_40), "1c.3g.20gb");
        let h100_80 = 81_559u64 << 20;
        assert_eq!(mig_profile(1, 1, 9984, h100_80), "1g.10gb");
        assert_eq!(mig_profile(4, 4, 40_192, h100_80), "4g.40gb");
    }
}
