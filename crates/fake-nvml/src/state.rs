//! The library's state while NVML is open: the GPUs with their MIG mode, MIG device slots and
//! the GPU and compute instances created at run time, the event sets and their queues, what
//! the control file has changed; the instances kept from one `nvmlShutdown` to the next
//! `nvmlInit`; how handles encode GPUs, MIG devices and instances; and `with_state`, the entry
//! of every exported function.

use crate::abi::{
    GI_PROFILE_COUNT, GPU_IS_LOST, INVALID_ARGUMENT, MAX_MIG_DEVICES, NOT_SUPPORTED, SUCCESS,
    UNINITIALIZED, UNKNOWN,
};
use crate::config::{
    static_occupied, Config, GpuConfig, MigDeviceConfig, MigProfileConfig, Occupied,
    PlacementConfig,
};
use nvml_wrapper_sys::bindings::{
    nvmlComputeInstance_t, nvmlDevice_t, nvmlGpuInstance_t, nvmlReturn_t,
};
use std::collections::{BTreeMap, VecDeque};
use std::ffi::c_uint;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

pub(crate) struct Event {
    pub(crate) device: usize,
    pub(crate) kind: u64,
    pub(crate) data: u64,
    /// `gpuInstanceId` and `computeInstanceId` of the event data (`u32::MAX`: none).
    pub(crate) gi: u32,
    pub(crate) ci: u32,
}

#[derive(Default)]
pub(crate) struct Set {
    pub(crate) events: VecDeque<Event>,
    /// A GPU was lost since the last wait: the next wait fails with `GPU_IS_LOST`.
    pub(crate) lost: bool,
}

pub(crate) struct Gpu {
    pub(crate) config: GpuConfig,
    /// MIG mode now (changed by `mig` control lines).
    pub(crate) mig_on: bool,
    /// MIG device slots now (`nvmlDeviceGetMigDeviceHandleByIndex`): the static devices first,
    /// then those of compute instances created at run time; a destroyed one leaves a hole.
    pub(crate) migs: Vec<Option<MigDeviceConfig>>,
    /// GPU instances created at run time, with their compute instances.
    pub(crate) gis: Vec<GpuInstance>,
    /// GPU and compute instances created on this GPU so far (in handles and MIG UUIDs).
    pub(crate) created: u64,
    pub(crate) lost: bool,
    pub(crate) recovery_action: u32,
    /// (set id, event mask) registrations.
    pub(crate) registered: Vec<(usize, u64)>,
}

/// A GPU instance created by `nvmlDeviceCreateGpuInstanceWithPlacement`.
#[derive(Debug, Clone)]
pub(crate) struct GpuInstance {
    pub(crate) id: u32,
    pub(crate) profile: u32,
    pub(crate) placement: PlacementConfig,
    pub(crate) slices: u32,
    pub(crate) memory_mib: u64,
    pub(crate) multiprocessors: u32,
    /// The GPU's creation count when it was made (stale handles do not match).
    pub(crate) serial: u64,
    pub(crate) cis: Vec<ComputeInstance>,
}

/// A compute instance created by `nvmlGpuInstanceCreateComputeInstance`; its MIG device is in
/// the GPU's `migs` with the same GI and CI ids.
#[derive(Debug, Clone)]
pub(crate) struct ComputeInstance {
    pub(crate) id: u32,
    pub(crate) profile: u32,
    /// First compute slice within the GPU instance.
    pub(crate) start: u32,
    pub(crate) slices: u32,
    pub(crate) serial: u64,
}

impl Gpu {
    pub(crate) fn new(config: &GpuConfig) -> Gpu {
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
    pub(crate) fn mig_devices(&self) -> impl Iterator<Item = &MigDeviceConfig> {
        self.migs.iter().flatten()
    }

    /// What all GPU instances hold now: the static devices' and the created ones.
    pub(crate) fn occupied(&self) -> Occupied {
        let created = |d: &&MigDeviceConfig| self.gis.iter().any(|g| g.id == d.gi);
        let mut occupied =
            static_occupied(&self.config, self.mig_devices().filter(|d| !created(d)));
        for gi in &self.gis {
            occupied.add(gi.id, gi.slices, Some(gi.placement));
        }
        occupied
    }

    /// Puts a MIG device in the first free slot; `false` if all are taken.
    pub(crate) fn add_mig_device(&mut self, device: MigDeviceConfig) -> bool {
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
    pub(crate) fn drop_created(&mut self) {
        self.gis.clear();
    }
}

/// What a GPU's created instances were at the last `nvmlShutdown` of the process, by GPU
/// UUID: a real GPU keeps its MIG instances while no one has NVML open.
pub(crate) struct Kept {
    pub(crate) created: u64,
    pub(crate) gis: Vec<GpuInstance>,
    /// (slot, MIG device) of their compute instances.
    pub(crate) slots: Vec<(usize, MigDeviceConfig)>,
}

static KEPT: Mutex<BTreeMap<String, Kept>> = Mutex::new(BTreeMap::new());

/// Locked after `STATE`, never before.
pub(crate) fn kept() -> MutexGuard<'static, BTreeMap<String, Kept>> {
    KEPT.lock().unwrap_or_else(|e| e.into_inner())
}

impl Gpu {
    pub(crate) fn keep(&self) -> Option<Kept> {
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
    pub(crate) fn restore(&mut self, kept: Kept) {
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

pub(crate) struct State {
    pub(crate) config: Config,
    pub(crate) gpus: Vec<Gpu>,
    pub(crate) sets: Vec<Option<Set>>,
    pub(crate) control: Option<PathBuf>,
    pub(crate) control_offset: usize,
    /// Where each `nvmlInit` is logged (`init_log`).
    pub(crate) init_log: Option<PathBuf>,
    pub(crate) users: u32,
    /// `events broken`: waits and registrations fail.
    pub(crate) events_broken: bool,
    /// `broken_while`: every call fails while this file exists.
    pub(crate) broken_while: Option<PathBuf>,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

pub(crate) fn lock() -> MutexGuard<'static, Option<State>> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

impl State {
    /// The state of a freshly loaded topology, with the instances kept at the last shutdown.
    pub(crate) fn new(config: Config, control: Option<PathBuf>, control_offset: usize) -> State {
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
            broken_while: None,
        }
    }

    /// Whether the `broken_while` file exists.
    pub(crate) fn broken(&self) -> bool {
        self.broken_while.as_ref().is_some_and(|p| p.exists())
    }

    pub(crate) fn gpu(&self, device: nvmlDevice_t) -> Result<&Gpu, nvmlReturn_t> {
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
    pub(crate) fn gpu_index(&self, device: nvmlDevice_t) -> Result<usize, nvmlReturn_t> {
        self.gpu(device)?;
        Ok((device as usize).saturating_sub(1))
    }

    /// A MIG-capable GPU and its GPU-instance profile `profile`: `INVALID_ARGUMENT` for an id
    /// beyond NVML's, `NOT_SUPPORTED` without MIG or for a profile this GPU lacks. MIG may be
    /// on or off.
    pub(crate) fn gi_profile(
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
    pub(crate) fn instance_gpu(&self, raw: u64, tag: u64) -> Result<(usize, &Gpu), nvmlReturn_t> {
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
    pub(crate) fn gi_find(
        &self,
        handle: nvmlGpuInstance_t,
    ) -> Result<(usize, usize), nvmlReturn_t> {
        let (gpu, g) = self.instance_gpu(handle as usize as u64, GI_TAG)?;
        let at = g
            .gis
            .iter()
            .position(|gi| gi_handle(gpu, gi) == handle)
            .ok_or(INVALID_ARGUMENT)?;
        Ok((gpu, at))
    }

    /// The GPU index and GPU instance of a GPU-instance handle (errors as `gi_find`).
    pub(crate) fn gi_ref(
        &self,
        handle: nvmlGpuInstance_t,
    ) -> Result<(usize, &GpuInstance), nvmlReturn_t> {
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
    pub(crate) fn ci_find(
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
    pub(crate) fn mig(
        &self,
        device: nvmlDevice_t,
    ) -> Result<(&Gpu, &MigDeviceConfig), nvmlReturn_t> {
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

    pub(crate) fn find(&self, which: &str) -> Option<usize> {
        if let Ok(i) = which.parse::<usize>() {
            return (i < self.gpus.len()).then_some(i);
        }
        self.gpus.iter().position(|g| g.config.uuid == which)
    }

    pub(crate) fn send(&mut self, device: usize, kind: u64, data: u64) {
        self.send_to_instance(device, kind, data, (u32::MAX, u32::MAX));
    }

    /// Sends an event that NVML attributes to GPU instance `gi`, compute instance `ci`
    /// (`u32::MAX`: not attributed).
    pub(crate) fn send_to_instance(
        &mut self,
        device: usize,
        kind: u64,
        data: u64,
        (gi, ci): (u32, u32),
    ) {
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
}

/// Runs `f` on the initialised state (after applying new control lines), or answers
/// `UNINITIALIZED`.
pub(crate) fn with_state(f: impl FnOnce(&mut State) -> Result<(), nvmlReturn_t>) -> nvmlReturn_t {
    let mut guard = lock();
    match guard.as_mut() {
        None => UNINITIALIZED,
        Some(state) => {
            if state.broken() {
                return UNKNOWN;
            }
            state.poll_control();
            match f(state) {
                Ok(()) => SUCCESS,
                Err(code) => code,
            }
        }
    }
}

pub(crate) fn handle(index: usize) -> nvmlDevice_t {
    index.saturating_add(1) as nvmlDevice_t
}

// Handles are integers in pointers. GPU: `index + 1`; MIG device: `(index + 1) << 16 | slot + 1`
// (below 2^32); GPU instance: `0xA << 60 | (index + 1) << 40 | GI id << 32 | serial & 0xffff_ffff`;
// compute instance: `0xC << 60 | (index + 1) << 40 | GI id << 32 | CI id << 24 |
// serial & 0xff_ffff`, where serial is the GPU's creation count when the instance was made (so
// the handle of a destroyed instance does not name one made later with the same ids). The top
// nibble keeps the four kinds apart; they need 64-bit pointers.
const _: () = assert!(usize::BITS == 64, "instance handles need 64-bit pointers");
pub(crate) const GI_TAG: u64 = 0xa << 60;
pub(crate) const CI_TAG: u64 = 0xc << 60;
pub(crate) const TAG_MASK: u64 = 0xf << 60;

pub(crate) fn gpu_bits(gpu: usize) -> u64 {
    ((gpu as u64).saturating_add(1) & 0xffff) << 40
}

pub(crate) fn gi_handle(gpu: usize, gi: &GpuInstance) -> nvmlGpuInstance_t {
    let raw = GI_TAG | gpu_bits(gpu) | (u64::from(gi.id) & 0xff) << 32 | (gi.serial & 0xffff_ffff);
    raw as usize as nvmlGpuInstance_t
}

pub(crate) fn ci_handle(
    gpu: usize,
    gi: &GpuInstance,
    ci: &ComputeInstance,
) -> nvmlComputeInstance_t {
    let raw = CI_TAG
        | gpu_bits(gpu)
        | (u64::from(gi.id) & 0xff) << 32
        | (u64::from(ci.id) & 0xff) << 24
        | (ci.serial & 0xff_ffff);
    raw as usize as nvmlComputeInstance_t
}
