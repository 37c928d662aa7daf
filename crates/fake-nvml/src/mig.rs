//! The exported MIG queries of a GPU and its MIG device handles: MIG mode, the device slots,
//! the handle of a slot, its parent, its GPU- and compute-instance ids and attributes.

use crate::abi::{put, INVALID_ARGUMENT, MAX_MIG_DEVICES, NOT_FOUND, NOT_SUPPORTED, SMS_PER_SLICE};
use crate::instances::engines;
use crate::state::with_state;
use nvml_wrapper_sys::bindings::{nvmlDeviceAttributes_t, nvmlDevice_t, nvmlReturn_t};
use std::ffi::c_uint;

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
        let (gpu, mig) = match s.mig(device) {
            Ok(found) => found,
            Err(_) => {
                s.gpu(device)?;
                return Err(NOT_SUPPORTED);
            }
        };
        // As a real GPU: the multiprocessors of the compute instance's slices (at the rate of
        // the GPU-instance profile of the same size, where the config has one) and the GPU
        // instance's shared engines.
        let ci_slices = mig.ci_slices.unwrap_or(mig.slices);
        let per_slice = gpu
            .config
            .mig_profiles
            .iter()
            .find(|p| p.slices == mig.slices)
            .and_then(|p| p.multiprocessors().checked_div(p.slices))
            .unwrap_or(SMS_PER_SLICE);
        let [copy, decoders, encoders, jpegs, ofas] = engines(mig.slices);
        put(
            attributes,
            nvmlDeviceAttributes_t {
                multiprocessorCount: per_slice.saturating_mul(ci_slices),
                sharedCopyEngineCount: copy,
                sharedDecoderCount: decoders,
                sharedEncoderCount: encoders,
                sharedJpegCount: jpegs,
                sharedOfaCount: ofas,
                gpuInstanceSliceCount: mig.slices,
                computeInstanceSliceCount: ci_slices,
                memorySizeMB: mig.memory_mib,
            },
        )
    })
}
