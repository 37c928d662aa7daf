//! A MIG device's GPU-instance and compute-instance ids, which nvml-wrapper 0.13 has no safe
//! getter for (the caps nodes `/dev/nvidia-caps/nvidia-cap<m>` a MIG device needs are looked
//! up by them in `/proc/driver/nvidia-caps/mig-minors`).
//!
//! **Why `unsafe` is allowed here, and nowhere else in devplug's own crates** (the workspace
//! lint is `deny`, not `forbid`, for this module alone): the two NVML calls
//! `nvmlDeviceGetGpuInstanceId` and `nvmlDeviceGetComputeInstanceId` are reached through
//! nvml-wrapper's raw function table (`Nvml::lib()`), with the raw handle of a
//! `Device` (`Device::handle()`, itself `unsafe`). They are sound because:
//!
//! - the `Nvml` is live: `device` borrows it (`Device<'n>` cannot outlive its `Nvml`), so
//!   `nvmlShutdown` has not run;
//! - the handle comes from that same `Nvml` (we take `nvml` from `device.nvml()`, never from
//!   the caller), so it is a handle NVML gave out, valid until shutdown;
//! - the only pointers passed are out-pointers to `u32` locals on this stack frame, which
//!   NVML writes once (`unsigned int *id`) and does not keep;
//! - the function pointers are the ones nvml-wrapper resolved from the loaded library with
//!   these exact C signatures (nvml-wrapper-sys's bindings of `nvml.h`); a symbol the library
//!   lacks is an error here, not the raw table's `expect` panic.
//!
//! The safe API is one function, [`instance_ids`]; nothing else may use `unsafe`.
#![allow(unsafe_code)]

use nvml_wrapper::error::{nvml_sym, nvml_try, NvmlError};
use nvml_wrapper::Device;

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
