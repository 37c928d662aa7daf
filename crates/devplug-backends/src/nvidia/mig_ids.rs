//! MIG identities NVML knows and nvml-wrapper 0.13 has no safe getter for:
//!
//! - a MIG device's GPU-instance and compute-instance ids (the caps nodes
//!   `/dev/nvidia-caps/nvidia-cap<m>` a MIG device needs are looked up by them in
//!   `/proc/driver/nvidia-caps/mig-minors`): [`instance_ids`];
//! - the GPU instance and compute instance an event is attributed to
//!   (`nvmlEventData_t::gpuInstanceId`, `computeInstanceId`), which nvml-wrapper's
//!   `EventSet::wait` drops: [`InstanceEvents`], an event set whose wait keeps them.
//!
//! **Why `unsafe` is allowed here, and nowhere else in devplug's own crates** (the workspace
//! lint is `deny`, not `forbid`, for this module alone): the NVML calls
//! `nvmlDeviceGetGpuInstanceId`, `nvmlDeviceGetComputeInstanceId` and `nvmlEventSetWait_v2` are
//! reached through nvml-wrapper's raw function table (`Nvml::lib()`), with raw handles of a
//! `Device` (`Device::handle()`) or an `EventSet` (`EventSet::handle()`), both `unsafe`, and
//! the device an event names is wrapped with `Device::new`, also `unsafe`. They are sound
//! because:
//!
//! - the `Nvml` is live: a `Device<'n>` or `InstanceEvents<'n>` borrows it (neither can
//!   outlive its `Nvml`), so `nvmlShutdown` has not run;
//! - each handle comes from that same `Nvml`: for [`instance_ids`] we take `nvml` from
//!   `device.nvml()`, never from the caller; an [`InstanceEvents`] is only made by
//!   [`InstanceEvents::new`] from the `Nvml` it keeps, which creates the set itself, and the
//!   set is only ever registered through nvml-wrapper, so the set handle is one that `Nvml`
//!   gave out and the set is freed only by its `EventSet`'s `Drop`, after its last use;
//! - the device handle of an event is one NVML wrote for a device of that same `Nvml`; it is
//!   valid until shutdown, which the returned `Device<'n>`'s borrow of the `Nvml` rules out;
//! - the only pointers passed are out-pointers to locals on this stack frame (`u32` ids, one
//!   `nvmlEventData_t` of nvml-wrapper-sys's exact layout), which NVML writes once and does
//!   not keep;
//! - the function pointers are the ones nvml-wrapper resolved from the loaded library with
//!   these exact C signatures (nvml-wrapper-sys's bindings of `nvml.h`); a symbol the library
//!   lacks is an error here, not the raw table's `expect` panic.
//!
//! The safe API is [`instance_ids`] and [`InstanceEvents`]; nothing else may use `unsafe`.
#![allow(unsafe_code)]

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::error::{nvml_sym, nvml_try, NvmlError};
use nvml_wrapper::{Device, EventSet, Nvml};
use nvml_wrapper_sys::bindings::nvmlEventData_t;

/// The (GPU instance, compute instance) ids of a MIG device handle.
pub(crate) fn instance_ids(device: &Device<'_>) -> Result<(u32, u32), NvmlError> {
    let lib = device.nvml().lib();
    let gi_sym = nvml_sym(lib.nvmlDeviceGetGpuInstanceId.as_ref())?;
    let ci_sym = nvml_sym(lib.nvmlDeviceGetComputeInstanceId.as_ref())?;
    let mut gi: u32 = 0;
    let mut ci: u32 = 0;
    // SAFETY: see the module comment: a live Nvml (borrowed by `device`), a handle from that
    // Nvml, symbols resolved by nvml-wrapper with these signatures, and out-pointers to the
    // two locals above.
    unsafe {
        let handle = device.handle();
        nvml_try(gi_sym(handle, &mut gi))?;
        nvml_try(ci_sym(handle, &mut ci))?;
    }
    Ok((gi, ci))
}

/// NVML's "not attributed to an instance" (`gpuInstanceId`, `computeInstanceId`).
const NO_INSTANCE: u32 = 0xFFFF_FFFF;

/// One event as `nvmlEventSetWait_v2` delivers it, the instance ids included.
pub(crate) struct InstanceEvent<'n> {
    /// The (parent) GPU the event is about.
    pub(crate) device: Device<'n>,
    /// `eventType`, every bit kept (also those nvml-wrapper has no flag for, e.g. 0x8000).
    pub(crate) event_type: u64,
    /// `eventData`: the XID for an XID event (999: unknown).
    pub(crate) data: u64,
    /// The GPU instance it is attributed to; `None` for `0xFFFFFFFF` (the whole GPU).
    pub(crate) gi: Option<u32>,
    /// The compute instance it is attributed to; `None` for `0xFFFFFFFF`.
    pub(crate) ci: Option<u32>,
}

/// An NVML event set together with the `Nvml` that created it, so that its wait can be the
/// raw one that keeps the GPU- and compute-instance ids.
pub(crate) struct InstanceEvents<'n> {
    nvml: &'n Nvml,
    set: EventSet<'n>,
}

impl<'n> InstanceEvents<'n> {
    /// A new, empty event set of `nvml`.
    pub(crate) fn new(nvml: &'n Nvml) -> Result<Self, NvmlError> {
        Ok(InstanceEvents {
            nvml,
            set: nvml.create_event_set()?,
        })
    }

    /// Registers `device` for `types`. On an error the set is gone (nvml-wrapper frees it),
    /// as with `Device::register_events`.
    pub(crate) fn register(
        self,
        device: &Device<'n>,
        types: EventTypes,
    ) -> Result<Self, NvmlError> {
        let nvml = self.nvml;
        let set = device
            .register_events(types, self.set)
            .map_err(|e| e.error)?;
        Ok(InstanceEvents { nvml, set })
    }

    /// Waits up to `timeout_ms` for one event.
    pub(crate) fn wait(&self, timeout_ms: u32) -> Result<InstanceEvent<'n>, NvmlError> {
        let sym = nvml_sym(self.nvml.lib().nvmlEventSetWait_v2.as_ref())?;
        let mut data = nvmlEventData_t {
            device: std::ptr::null_mut(),
            eventType: 0,
            eventData: 0,
            gpuInstanceId: NO_INSTANCE,
            computeInstanceId: NO_INSTANCE,
        };
        // SAFETY: see the module comment: a live Nvml (borrowed by `self`), a set that Nvml
        // created and that is still alive (owned by `self`), the symbol nvml-wrapper resolved
        // with this signature, and an out-pointer to the local above; the device handle NVML
        // wrote is one of that same Nvml, wrapped with its lifetime.
        let device = unsafe {
            nvml_try(sym(self.set.handle(), &mut data, timeout_ms))?;
            Device::new(data.device, self.nvml)
        };
        let id = |raw: u32| (raw != NO_INSTANCE).then_some(raw);
        Ok(InstanceEvent {
            device,
            event_type: data.eventType,
            data: data.eventData,
            gi: id(data.gpuInstanceId),
            ci: id(data.computeInstanceId),
        })
    }
}
