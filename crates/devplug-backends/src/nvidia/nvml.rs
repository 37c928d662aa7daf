//! The real [`GpuDriver`]: NVML through `nvml-wrapper`, loaded at run time (`dlopen`), so the
//! binary starts and serves its other resources on a node without the library.
//!
//! `Nvml` lives on the stack of [`NvmlDriver::open`], on the backend's own thread, and the
//! session borrows it: no `'static` NVML, no leaked handle, and `nvmlShutdown` runs when the
//! session ends. `register_events` frees the event set on any error (nvml-wrapper's contract),
//! so a failed registration rebuilds the whole set.

use super::mig_ids::{instance_ids, InstanceEvents};
use super::mig_instances;
use super::seam::{
    mig_profile, DriverInfo, GiProfile, GpuDriver, GpuInfo, GpuSession, LostGpu, MigInfo,
    MigPartitioner, PcieLevel, RawEvent, RecoveryAction, SessionEnd, Snapshot, WaitError,
};
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::TopologyLevel;
use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::error::{Bits, NvmlError};
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper::{Device, Nvml};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

/// `NVML_NVLINK_MAX_LINKS`.
const MAX_LINKS: u32 = 18;
/// `NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`.
const FIELD_RECOVERY_ACTION: u32 = 230;
/// `nvmlEventTypeGpuRecoveryAction` (driver 565+; nvml-wrapper has no flag for it).
const EVENT_RECOVERY_ACTION: u64 = 0x8000;

/// Loads `libnvidia-ml.so.1` from the first candidate path that works.
pub struct NvmlDriver {
    candidates: Box<dyn Fn() -> Vec<PathBuf> + Send>,
    mig_profiles: bool,
}

impl NvmlDriver {
    /// A driver that tries the paths `candidates` returns (asked again at every attempt, as a
    /// driver container may appear later).
    pub fn new(candidates: impl Fn() -> Vec<PathBuf> + Send + 'static) -> Self {
        NvmlDriver {
            candidates: Box::new(candidates),
            mig_profiles: false,
        }
    }

    /// The same driver also reading the MIG profiles and placements of GPUs in MIG mode at
    /// discovery (`mig_strategy: dynamic`; other strategies have no use for them).
    pub fn with_mig_profiles(mut self, read: bool) -> Self {
        self.mig_profiles = read;
        self
    }
}

/// nvml-wrapper's PCI bus id (`00000000:3B:00.0`) as sysfs names it (`0000:3b:00.0`).
pub fn sysfs_bus_id(nvml: &str) -> String {
    let lower = nvml.to_ascii_lowercase();
    match lower.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => {
            match domain.get(domain.len().saturating_sub(4)..) {
                Some(short) => format!("{short}:{rest}"),
                None => lower.clone(),
            }
        }
        _ => lower,
    }
}

impl GpuDriver for NvmlDriver {
    fn open(
        &mut self,
        body: &mut dyn FnMut(&mut dyn GpuSession) -> SessionEnd,
    ) -> Result<SessionEnd, String> {
        let mut reasons = Vec::new();
        for path in (self.candidates)() {
            match Nvml::builder().lib_path(path.as_os_str()).init() {
                Ok(nvml) => {
                    tracing::info!(library = %path.display(), "NVML loaded");
                    let mut session = NvmlSession {
                        nvml: &nvml,
                        set: None,
                        library: path.is_absolute().then(|| path.clone()),
                        mig_profiles: self.mig_profiles,
                    };
                    let end = body(&mut session);
                    drop(session);
                    if let Err(err) = nvml.shutdown() {
                        tracing::debug!(%err, "nvmlShutdown failed");
                    }
                    return Ok(end);
                }
                Err(err) => reasons.push(format!("{}: {}", path.display(), describe(&err))),
            }
        }
        Err(reasons.join("; "))
    }
}

/// MIG partitions through NVML: a second `Nvml` of its own (NVML's init is reference counted
/// and thread safe), opened on first use from the same candidate paths as the backend's thread
/// and kept open, so that allocation never waits on that thread's event loop. It is dropped
/// (and opened again on next use) after a call fails with the driver gone.
pub struct NvmlPartitioner {
    candidates: Box<dyn Fn() -> Vec<PathBuf> + Send + Sync>,
    nvml: Mutex<Option<Nvml>>,
}

impl NvmlPartitioner {
    /// A partitioner that loads NVML from the first of `candidates` that works.
    pub fn new(candidates: impl Fn() -> Vec<PathBuf> + Send + Sync + 'static) -> Self {
        NvmlPartitioner {
            candidates: Box::new(candidates),
            nvml: Mutex::new(None),
        }
    }

    /// Runs `body` on the GPU `uuid` of the open NVML (opening it first if needed).
    fn with_gpu<T>(
        &self,
        uuid: &str,
        body: impl FnOnce(&Device<'_>) -> Result<T, NvmlError>,
    ) -> Result<T, String> {
        let mut slot = self.nvml.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            let mut reasons = Vec::new();
            for path in (self.candidates)() {
                match Nvml::builder().lib_path(path.as_os_str()).init() {
                    Ok(nvml) => {
                        *slot = Some(nvml);
                        break;
                    }
                    Err(err) => reasons.push(format!("{}: {}", path.display(), describe(&err))),
                }
            }
            if slot.is_none() {
                return Err(format!("NVML cannot be loaded: {}", reasons.join("; ")));
            }
        }
        let Some(nvml) = slot.as_ref() else {
            return Err("NVML is not open".into());
        };
        let result = nvml.device_by_uuid(uuid).and_then(|device| body(&device));
        match result {
            Ok(v) => Ok(v),
            Err(err) => {
                let gone = matches!(
                    err,
                    NvmlError::Uninitialized | NvmlError::DriverNotLoaded | NvmlError::GpuLost
                );
                let why = describe_mig(&err);
                if gone {
                    *slot = None;
                }
                Err(why)
            }
        }
    }
}

/// An NVML error of a MIG call, in words (nvml-wrapper has no variant for
/// `NVML_ERROR_INSUFFICIENT_RESOURCES`, 23).
fn describe_mig(err: &NvmlError) -> String {
    match err {
        NvmlError::UnexpectedVariant(23) => "insufficient resources: the placement overlaps a \
             MIG instance that is already there, or the GPU's slices are used up"
            .into(),
        NvmlError::NoPermission => "no permission: creating MIG instances needs root (or \
             CAP_SYS_ADMIN and the nvidia-caps config node)"
            .into(),
        other => describe(other),
    }
}

impl MigPartitioner for NvmlPartitioner {
    fn create(
        &self,
        gpu: &str,
        profile: &GiProfile,
        start: u32,
        size: u32,
    ) -> Result<MigInfo, String> {
        self.with_gpu(gpu, |device| {
            let gi = mig_instances::create(device, profile.id, profile.slices, start, size)?;
            let bytes = device.memory_info().map(|m| m.total).unwrap_or(0);
            mig_devices(device, gpu, bytes)
                .into_iter()
                .find(|m| m.gi == gi)
                .ok_or(NvmlError::NotFound)
        })
    }

    fn destroy(&self, gpu: &str, profile: u32, start: u32) -> Result<bool, String> {
        self.with_gpu(gpu, |device| mig_instances::destroy(device, profile, start))
    }
}

/// The MIG devices of a GPU in MIG mode. `nvmlDeviceGetMaxMigDeviceCount` is the number of
/// slots, not of devices: empty slots (NOT_FOUND, INVALID_ARGUMENT) are skipped, as NVIDIA's
/// plugin does. A device whose UUID, attributes or instance ids cannot be read is left out
/// with a warning (without its GI/CI ids its caps nodes are unknown, so it cannot be given).
fn mig_devices(gpu: &Device<'_>, parent: &str, parent_bytes: u64) -> Vec<MigInfo> {
    let slots = match gpu.mig_device_count() {
        Ok(n) => n,
        Err(err) => {
            tracing::warn!(gpu = %parent, %err, "MIG is on but its device count cannot be read");
            return Vec::new();
        }
    };
    let mut out = Vec::new();
    for slot in 0..slots {
        let mig = match gpu.mig_device_by_index(slot) {
            Ok(d) => d,
            Err(NvmlError::NotFound) | Err(NvmlError::InvalidArg) => continue,
            Err(err) => {
                tracing::warn!(gpu = %parent, slot, %err, "MIG device left out");
                continue;
            }
        };
        let read = || -> Result<MigInfo, NvmlError> {
            let uuid = mig.uuid()?;
            let attrs = mig.attributes()?;
            let (gi, ci) = instance_ids(&mig)?;
            Ok(MigInfo {
                uuid,
                profile: mig_profile(
                    attrs.gpu_instance_slice_count,
                    attrs.compute_instance_slice_count,
                    attrs.memory_size_mb,
                    parent_bytes,
                ),
                gi,
                ci,
                memory_bytes: attrs.memory_size_mb.saturating_mul(1 << 20),
                attributes: super::seam::MigAttributes {
                    multiprocessors: attrs.multiprocessor_count,
                    gi_slices: attrs.gpu_instance_slice_count,
                    ci_slices: attrs.compute_instance_slice_count,
                    copy_engines: attrs.shared_copy_engine_count,
                    decoders: attrs.shared_decoder_count,
                    encoders: attrs.shared_encoder_count,
                    jpeg_engines: attrs.shared_jpeg_count,
                    ofa_engines: attrs.shared_ofa_count,
                },
            })
        };
        match read() {
            Ok(info) => out.push(info),
            Err(err) => tracing::warn!(gpu = %parent, slot, %err, "MIG device left out"),
        }
    }
    out
}

fn describe(err: &NvmlError) -> String {
    match err {
        NvmlError::LibloadingError(e) => format!("library not loadable ({e})"),
        NvmlError::DriverNotLoaded => "the NVIDIA driver is not loaded".into(),
        NvmlError::LibRmVersionMismatch => {
            "NVML and the kernel driver differ in version (a driver update in progress?)".into()
        }
        other => other.to_string(),
    }
}

struct NvmlSession<'n> {
    nvml: &'n Nvml,
    /// The event set; its wait keeps the GPU- and compute-instance ids of events.
    set: Option<InstanceEvents<'n>>,
    library: Option<PathBuf>,
    /// Whether discovery reads the MIG profiles of GPUs in MIG mode.
    mig_profiles: bool,
}

/// One GPU as discovery reads it, with its handle (for the PCIe levels); an error names the GPU
/// and what could not be read.
fn read_gpu(nvml: &Nvml, index: u32, read_profiles: bool) -> Result<(GpuInfo, Device<'_>), String> {
    let device = nvml
        .device_by_index(index)
        .map_err(|e| format!("GPU {index}: {e}"))?;
    let field = |what: &str, e: NvmlError| format!("GPU {index}: {what}: {e}");
    let uuid = device.uuid().map_err(|e| field("uuid", e))?;
    let name = device.name().map_err(|e| field("name", e))?;
    let minor = device
        .minor_number()
        .map_err(|e| field("minor number", e))?;
    let memory_bytes = device.memory_info().map(|m| m.total).unwrap_or(0);
    let bus_id = sysfs_bus_id(&device.pci_info().map_err(|e| field("PCI info", e))?.bus_id);
    let mut nvlinks = Vec::new();
    for link in 0..MAX_LINKS {
        let wrapper = device.link_wrapper_for(link);
        match wrapper.is_active() {
            Ok(true) => {
                if let Ok(remote) = wrapper.remote_pci_info() {
                    nvlinks.push(sysfs_bus_id(&remote.bus_id));
                }
            }
            Ok(false) => {}
            // No NVLink on this GPU, or no more links.
            Err(_) => break,
        }
    }
    let mig_mode = device.mig_mode();
    let mig_capable = mig_mode.is_ok();
    let mig_enabled = mig_mode.is_ok_and(|m| m.current == 1);
    let compute_capability = device
        .cuda_compute_capability()
        .ok()
        .and_then(|c| Some((u32::try_from(c.major).ok()?, u32::try_from(c.minor).ok()?)));
    let (migs, mig_profiles) = if mig_enabled {
        let profiles = if !read_profiles {
            Vec::new()
        } else {
            mig_instances::profiles(&device).unwrap_or_else(|err| {
            tracing::warn!(gpu = %uuid, %err, "cannot read the GPU's MIG profiles: no partitions of it are offered");
            Vec::new()
        })
        };
        (mig_devices(&device, &uuid, memory_bytes), profiles)
    } else {
        (Vec::new(), Vec::new())
    };
    let info = GpuInfo {
        index,
        uuid,
        name,
        minor,
        memory_bytes,
        bus_id,
        nvlinks,
        compute_capability,
        mig_capable,
        mig_enabled,
        migs,
        mig_profiles,
    };
    Ok((info, device))
}

fn level(l: TopologyLevel) -> PcieLevel {
    match l {
        TopologyLevel::Internal => PcieLevel::Internal,
        TopologyLevel::Single => PcieLevel::Single,
        TopologyLevel::Multiple => PcieLevel::Multiple,
        TopologyLevel::HostBridge => PcieLevel::HostBridge,
        TopologyLevel::Node => PcieLevel::Node,
        TopologyLevel::System => PcieLevel::System,
    }
}

/// NVML's CUDA version number (`1000 * major + 10 * minor`, e.g. 12040) as `(major, minor)`.
fn cuda_version(raw: i32) -> Option<(u32, u32)> {
    let raw = u32::try_from(raw).ok()?;
    Some((raw / 1000, (raw % 1000) / 10))
}

impl GpuSession for NvmlSession<'_> {
    fn driver(&mut self) -> DriverInfo {
        DriverInfo {
            library: self.library.clone(),
            version: self.nvml.sys_driver_version().ok(),
            cuda_version: self
                .nvml
                .sys_cuda_driver_version()
                .ok()
                .and_then(cuda_version),
        }
    }

    fn snapshot(&mut self) -> Result<Snapshot, String> {
        let nvml = self.nvml;
        let count = nvml
            .device_count()
            .map_err(|e| format!("device count: {e}"))?;
        let mut gpus = Vec::new();
        let mut devices = Vec::new();
        let mut lost = Vec::new();
        for index in 0..count {
            match read_gpu(nvml, index, self.mig_profiles) {
                Ok((info, device)) => {
                    gpus.push(info);
                    devices.push(device);
                }
                // One GPU that does not answer (lost, fallen off the bus) leaves the others
                // readable: discovery keeps it as it was last seen where it can.
                Err(reason) => lost.push(LostGpu { index, reason }),
            }
        }
        let n = devices.len();
        let mut pcie = vec![vec![None; n]; n];
        for i in 0..n {
            for j in (i + 1)..n {
                let other = nvml.device_by_index(gpus[j].index);
                let l = other
                    .and_then(|o| devices[i].topology_common_ancestor(o))
                    .ok()
                    .map(level);
                pcie[i][j] = l;
                pcie[j][i] = l;
            }
        }
        Ok(Snapshot { gpus, pcie, lost })
    }

    fn recovery_action(&mut self, index: u32) -> Result<Option<RecoveryAction>, String> {
        let device = self
            .nvml
            .device_by_index(index)
            .map_err(|e| e.to_string())?;
        let values = match device.field_values_for(&[FieldId(FIELD_RECOVERY_ACTION)]) {
            Ok(values) => values,
            Err(NvmlError::NotSupported) | Err(NvmlError::FailedToLoadSymbol(_)) => {
                return Ok(None)
            }
            Err(e) => return Err(e.to_string()),
        };
        match values.into_iter().next() {
            Some(Ok(sample)) => match sample.value {
                Ok(SampleValue::U32(v)) => Ok(Some(RecoveryAction::from_raw(v))),
                Ok(SampleValue::U64(v)) => Ok(Some(RecoveryAction::from_raw(
                    u32::try_from(v).unwrap_or(u32::MAX),
                ))),
                Ok(_) => Ok(None),
                Err(NvmlError::NotSupported) => Ok(None),
                Err(e) => Err(e.to_string()),
            },
            Some(Err(NvmlError::NotSupported)) | None => Ok(None),
            Some(Err(e)) => Err(e.to_string()),
        }
    }

    fn probe(&mut self, index: u32, uuid: &str) -> bool {
        self.nvml
            .device_by_index(index)
            .and_then(|d| {
                d.pci_info()?;
                d.uuid()
            })
            .is_ok_and(|u| u == uuid)
    }

    fn arm(
        &mut self,
        gpus: &[GpuInfo],
        health: bool,
        mig: bool,
    ) -> Result<Vec<(String, String)>, String> {
        self.set = None;
        let mut wanted = 0;
        if health {
            wanted |= EventTypes::CRITICAL_XID_ERROR.bits()
                | EventTypes::DOUBLE_BIT_ECC_ERROR.bits()
                | EVENT_RECOVERY_ACTION;
        }
        if mig {
            wanted |= EventTypes::MIG_CONFIG_CHANGE.bits();
        }
        // A GPU that cannot be asked (lost, or no events) is left out, so that one bad GPU
        // never blinds the others. register_events frees the set on any error, so a GPU whose
        // registration fails is left out and the set is built again without it.
        let mut unmonitored: Vec<(String, String)> = Vec::new();
        let mut masks = Vec::new();
        for gpu in gpus {
            let device = match self.nvml.device_by_index(gpu.index) {
                Ok(d) => d,
                Err(e) => {
                    unmonitored.push((gpu.uuid.clone(), e.to_string()));
                    continue;
                }
            };
            // The strict call reports bits nvml-wrapper has no flag for (0x8000) as an error
            // that carries them.
            let supported = match device.supported_event_types_strict() {
                Ok(types) => types.bits(),
                Err(NvmlError::IncorrectBits(Bits::U64(raw))) => raw,
                Err(NvmlError::NotSupported) => 0,
                Err(e) => {
                    unmonitored.push((gpu.uuid.clone(), format!("supported events: {e}")));
                    continue;
                }
            };
            let mask = supported & wanted;
            if mask == 0 {
                unmonitored.push((
                    gpu.uuid.clone(),
                    "NVML has none of the wanted events for it".into(),
                ));
                continue;
            }
            masks.push((gpu, mask));
        }
        'build: for _ in 0..=masks.len() {
            let mut set = InstanceEvents::new(self.nvml).map_err(|e| format!("event set: {e}"))?;
            for (i, (gpu, mask)) in masks.iter().enumerate() {
                let registered = self
                    .nvml
                    .device_by_index(gpu.index)
                    .map_err(|e| e.to_string())
                    .and_then(|device| {
                        set.register(&device, EventTypes::from_bits_retain(*mask))
                            .map_err(|e| e.to_string())
                    });
                match registered {
                    Ok(next) => set = next,
                    Err(e) => {
                        unmonitored.push((gpu.uuid.clone(), format!("register events: {e}")));
                        masks.remove(i);
                        continue 'build;
                    }
                }
            }
            self.set = Some(set);
            return Ok(unmonitored);
        }
        Err("no GPU could be registered for events".into())
    }

    fn wait(&mut self, timeout: Duration) -> Result<RawEvent, WaitError> {
        let Some(set) = &self.set else {
            std::thread::sleep(timeout);
            return Err(WaitError::Timeout);
        };
        let ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
        match set.wait(ms) {
            Ok(event) => {
                let Ok(uuid) = event.device.uuid() else {
                    return Err(WaitError::GpuLost);
                };
                let is = |t: EventTypes| event.event_type & t.bits() != 0;
                if is(EventTypes::MIG_CONFIG_CHANGE) {
                    Ok(RawEvent::MigChanged { uuid })
                } else if is(EventTypes::CRITICAL_XID_ERROR) {
                    // `eventData` is the XID (999 where the driver does not know it).
                    Ok(RawEvent::Xid {
                        uuid,
                        xid: event.data,
                        gi: event.gi,
                        ci: event.ci,
                    })
                } else if is(EventTypes::DOUBLE_BIT_ECC_ERROR) {
                    Ok(RawEvent::DoubleBitEcc { uuid })
                } else {
                    Ok(RawEvent::Other { uuid })
                }
            }
            Err(NvmlError::Timeout) => Err(WaitError::Timeout),
            Err(NvmlError::GpuLost) => Err(WaitError::GpuLost),
            Err(e) => {
                self.set = None;
                Err(WaitError::Failed(e.to_string()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_become_sysfs_names() {
        assert_eq!(sysfs_bus_id("00000000:3B:00.0"), "0000:3b:00.0");
        assert_eq!(sysfs_bus_id("0000:3b:00.0"), "0000:3b:00.0");
        // Not ASCII (a broken answer): no panic, passed through.
        assert_eq!(sysfs_bus_id("0000é000:3b:00.0"), "0000é000:3b:00.0");
    }
}
