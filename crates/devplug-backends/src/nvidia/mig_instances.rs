//! MIG partitions made and removed through NVML: the GPU-instance profiles of a GPU in MIG
//! mode with their placements, a GPU instance created at one placement with the compute
//! instance that spans it, and both destroyed again. Of these, nvml-wrapper 0.13 wraps only the
//! profile info (`Device::profile_info`, used here) and the possible placements
//! (`Device::possible_placements`, which returns an empty list whatever NVML says: it fills a
//! `Vec` through its pointer and never sets its length); GPU and compute instances it does not
//! wrap at all. So the placements and the instance calls go through its raw function table,
//! like [`super::mig_ids`].
//!
//! **Why `unsafe` is allowed here** (the second of the two modules that may; the workspace
//! lint is `deny`, lifted per module): each call is
//! `nvml_sym(lib.<function>)` then the C function, and they are sound because:
//!
//! - the `Nvml` is live: every function takes a `Device<'_>`, which borrows its `Nvml`, and
//!   takes the function table from `device.nvml()`, so `nvmlShutdown` has not run and the
//!   device handle is one that same NVML gave out;
//! - GPU-instance and compute-instance handles are only ever ones NVML wrote into our locals in
//!   this same call (from `nvmlDeviceGetGpuInstances`, `…ById`, `…CreateGpuInstance…`,
//!   `nvmlGpuInstanceGetComputeInstances`, `…CreateComputeInstance`), used before the function
//!   returns and never kept: a destroyed handle is never used again;
//! - every pointer passed is to a local of the exact `nvml.h` type (nvml-wrapper-sys's
//!   bindings), zero-initialised, or to a `Vec` whose length is the count passed with it; NVML
//!   writes at most that many entries and keeps none of the pointers;
//! - a symbol the library lacks is an error (`nvml_sym`), never a call through a null pointer.
//!
//! The safe API is [`profiles`], [`create`] and [`destroy`]; nothing else here is public.
#![allow(unsafe_code)]

use super::seam::GiProfile;
use nvml_wrapper::error::{nvml_sym, nvml_try, NvmlError};
use nvml_wrapper::Device;
use nvml_wrapper_sys::bindings::{
    nvmlComputeInstanceProfileInfo_t, nvmlComputeInstance_t, nvmlGpuInstanceInfo_t,
    nvmlGpuInstancePlacement_t, nvmlGpuInstance_t, NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
    NVML_COMPUTE_INSTANCE_PROFILE_COUNT,
};

/// The GPU-instance profiles read: `NVML_GPU_INSTANCE_PROFILE_1_SLICE` (0) to
/// `…_1_SLICE_REV2` (9). The later ids (graphics, media-engine variants) name the same slices
/// and memory as these and would give two partitions one name.
const GI_PROFILES: u32 = 10;

/// The most GPU instances of one profile a GPU has (seven 1-slice instances on an A100 or
/// H100; room to spare).
const MAX_INSTANCES: usize = 32;

/// A zero placement, for out-parameters.
const NO_PLACEMENT: nvmlGpuInstancePlacement_t = nvmlGpuInstancePlacement_t { start: 0, size: 0 };

/// A zeroed `nvmlComputeInstanceProfileInfo_t`, for NVML to fill.
fn ci_profile_info() -> nvmlComputeInstanceProfileInfo_t {
    nvmlComputeInstanceProfileInfo_t {
        id: 0,
        sliceCount: 0,
        instanceCount: 0,
        multiprocessorCount: 0,
        sharedCopyEngineCount: 0,
        sharedDecoderCount: 0,
        sharedEncoderCount: 0,
        sharedJpegCount: 0,
        sharedOfaCount: 0,
    }
}

/// The GPU-instance profiles of `device` (a GPU in MIG mode) that NVML answers for, with
/// their possible placements. A profile the GPU lacks answers `NOT_SUPPORTED` and is left out.
pub(crate) fn profiles(device: &Device<'_>) -> Result<Vec<GiProfile>, NvmlError> {
    let lib = device.nvml().lib();
    let placements_sym = nvml_sym(lib.nvmlDeviceGetGpuInstancePossiblePlacements_v2.as_ref())?;
    let mut out = Vec::new();
    for id in 0..GI_PROFILES {
        let info = match device.profile_info(id) {
            Ok(info) => info,
            Err(NvmlError::NotSupported) | Err(NvmlError::InvalidArg) => continue,
            Err(err) => return Err(err),
        };
        let mut count: u32 = 0;
        // SAFETY: see the module comment (live Nvml, its own handle, out-pointers to locals of
        // the declared types); a null array asks for the count only (nvml.h).
        unsafe {
            nvml_try(placements_sym(
                device.handle(),
                id,
                std::ptr::null_mut(),
                &mut count,
            ))?;
        }
        let mut placements = vec![NO_PLACEMENT; count as usize];
        // SAFETY: as above; the array has `count` entries and `count` says so.
        unsafe {
            nvml_try(placements_sym(
                device.handle(),
                id,
                placements.as_mut_ptr(),
                &mut count,
            ))?;
        }
        placements.truncate(count as usize);
        out.push(GiProfile {
            id: info.id,
            slices: info.slice_count,
            memory_mib: info.memory_size_mb,
            placements: placements.iter().map(|p| (p.start, p.size)).collect(),
        });
    }
    Ok(out)
}

/// The GPU instances of `profile` on `device`, with their ids and placements.
fn instances(
    device: &Device<'_>,
    profile: u32,
) -> Result<Vec<(nvmlGpuInstance_t, u32, u32)>, NvmlError> {
    let lib = device.nvml().lib();
    let list_sym = nvml_sym(lib.nvmlDeviceGetGpuInstances.as_ref())?;
    let info_sym = nvml_sym(lib.nvmlGpuInstanceGetInfo.as_ref())?;
    let mut handles: Vec<nvmlGpuInstance_t> = vec![std::ptr::null_mut(); MAX_INSTANCES];
    let mut count = MAX_INSTANCES as u32;
    // SAFETY: see the module comment: the array has `count` entries.
    unsafe {
        nvml_try(list_sym(
            device.handle(),
            profile,
            handles.as_mut_ptr(),
            &mut count,
        ))?;
    }
    handles.truncate(count as usize);
    let mut out = Vec::new();
    for gi in handles {
        let mut info = nvmlGpuInstanceInfo_t {
            device: std::ptr::null_mut(),
            id: 0,
            profileId: 0,
            placement: NO_PLACEMENT,
        };
        // SAFETY: `gi` was written by NVML just above; `info` is a local of the type.
        unsafe { nvml_try(info_sym(gi, &mut info))? };
        out.push((gi, info.id, info.placement.start));
    }
    Ok(out)
}

/// Creates the MIG partition of `profile` (slices `slices`) at memory slice `start` (span
/// `size`) on `device`: a GPU instance there, with one compute instance spanning all its
/// slices. Returns the GPU instance's id. If an instance of this profile is already at that
/// placement (a prepare retried after a restart), it is used as it is, given its compute
/// instance. If the compute instance cannot be made, the GPU instance is destroyed again.
pub(crate) fn create(
    device: &Device<'_>,
    profile: u32,
    slices: u32,
    start: u32,
    size: u32,
) -> Result<u32, NvmlError> {
    let lib = device.nvml().lib();
    let create_gi = nvml_sym(lib.nvmlDeviceCreateGpuInstanceWithPlacement.as_ref())?;
    let info_sym = nvml_sym(lib.nvmlGpuInstanceGetInfo.as_ref())?;
    let existing = instances(device, profile)?
        .into_iter()
        .find(|&(_, _, at)| at == start);
    let (gi, id, made) = match existing {
        Some((gi, id, _)) => (gi, id, false),
        None => {
            let placement = nvmlGpuInstancePlacement_t { start, size };
            let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
            // SAFETY: see the module comment: `placement` is read, `gi` written.
            unsafe { nvml_try(create_gi(device.handle(), profile, &placement, &mut gi))? };
            let mut info = nvmlGpuInstanceInfo_t {
                device: std::ptr::null_mut(),
                id: 0,
                profileId: 0,
                placement,
            };
            // SAFETY: `gi` was just written by NVML; `info` is a local of the type.
            if let Err(err) = unsafe { nvml_try(info_sym(gi, &mut info)) } {
                let _ = destroy_instance(device, gi);
                return Err(err);
            }
            (gi, info.id, true)
        }
    };
    match full_compute_instance(device, gi, slices) {
        Ok(()) => Ok(id),
        Err(err) => {
            if made {
                if let Err(undo) = destroy_instance(device, gi) {
                    tracing::warn!(gi = id, %undo, "cannot destroy the GPU instance whose compute instance failed");
                }
            }
            Err(err)
        }
    }
}

/// Gives GPU instance `gi` the compute instance that spans its `slices`, unless it has
/// compute instances already.
fn full_compute_instance(
    device: &Device<'_>,
    gi: nvmlGpuInstance_t,
    slices: u32,
) -> Result<(), NvmlError> {
    let lib = device.nvml().lib();
    let info_sym = nvml_sym(lib.nvmlGpuInstanceGetComputeInstanceProfileInfo.as_ref())?;
    let create_ci = nvml_sym(lib.nvmlGpuInstanceCreateComputeInstance.as_ref())?;
    if !compute_instances(device, gi)?.is_empty() {
        return Ok(());
    }
    for ci_profile in 0..NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
        let mut info = ci_profile_info();
        // SAFETY: see the module comment: `gi` from NVML in this call, `info` a local.
        let got = unsafe {
            nvml_try(info_sym(
                gi,
                ci_profile,
                NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                &mut info,
            ))
        };
        match got {
            Ok(()) if info.sliceCount == slices => {
                let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
                // SAFETY: as above; `ci` is written once and not kept.
                return unsafe { nvml_try(create_ci(gi, info.id, &mut ci)) };
            }
            Ok(()) | Err(NvmlError::NotSupported) | Err(NvmlError::InvalidArg) => {}
            Err(err) => return Err(err),
        }
    }
    Err(NvmlError::NotSupported)
}

/// The compute instances of GPU instance `gi`, of every profile.
fn compute_instances(
    device: &Device<'_>,
    gi: nvmlGpuInstance_t,
) -> Result<Vec<nvmlComputeInstance_t>, NvmlError> {
    let lib = device.nvml().lib();
    let list_sym = nvml_sym(lib.nvmlGpuInstanceGetComputeInstances.as_ref())?;
    let mut out = Vec::new();
    for ci_profile in 0..NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
        let mut handles: Vec<nvmlComputeInstance_t> = vec![std::ptr::null_mut(); MAX_INSTANCES];
        let mut count = MAX_INSTANCES as u32;
        // SAFETY: see the module comment: the array has `count` entries.
        let got = unsafe { nvml_try(list_sym(gi, ci_profile, handles.as_mut_ptr(), &mut count)) };
        match got {
            Ok(()) => {
                handles.truncate(count as usize);
                out.extend(handles);
            }
            Err(NvmlError::NotSupported) | Err(NvmlError::InvalidArg) => {}
            Err(err) => return Err(err),
        }
    }
    Ok(out)
}

/// Destroys GPU instance `gi`'s compute instances, then `gi`.
fn destroy_instance(device: &Device<'_>, gi: nvmlGpuInstance_t) -> Result<(), NvmlError> {
    let lib = device.nvml().lib();
    let destroy_ci = nvml_sym(lib.nvmlComputeInstanceDestroy.as_ref())?;
    let destroy_gi = nvml_sym(lib.nvmlGpuInstanceDestroy.as_ref())?;
    for ci in compute_instances(device, gi)? {
        // SAFETY: `ci` was listed by NVML just now and is not used after this call.
        unsafe { nvml_try(destroy_ci(ci))? };
    }
    // SAFETY: `gi` comes from NVML in this call and is not used after this.
    unsafe { nvml_try(destroy_gi(gi)) }
}

/// Destroys the MIG partition of `profile` at memory slice `start` on `device` (its compute
/// instances, then its GPU instance). `Ok(false)` if there is none there (already destroyed).
pub(crate) fn destroy(device: &Device<'_>, profile: u32, start: u32) -> Result<bool, NvmlError> {
    match instances(device, profile)?
        .into_iter()
        .find(|&(_, _, at)| at == start)
    {
        Some((gi, _, _)) => destroy_instance(device, gi).map(|()| true),
        None => Ok(false),
    }
}
