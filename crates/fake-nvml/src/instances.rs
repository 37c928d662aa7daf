//! MIG instances at run time: the exported GPU-instance profile, placement, create, list,
//! info and destroy functions, and their compute-instance counterparts, with what they share
//! (MIG UUIDs of created compute instances, engine counts, compute-instance profiles).

use crate::abi::{
    c_string, get, put, put_array, CI_ENGINE_SHARED, CI_SLICES, EVENT_MIG, INSUFFICIENT_RESOURCES,
    INSUFFICIENT_SIZE, INVALID_ARGUMENT, IN_USE, MAX_INSTANCE_ID, NOT_FOUND, NOT_SUPPORTED,
    SMS_PER_SLICE,
};
use crate::config::{MigDeviceConfig, MigProfileConfig, PlacementConfig};
use crate::state::{ci_handle, gi_handle, handle, with_state, ComputeInstance, GpuInstance};
use nvml_wrapper_sys::bindings::{
    nvmlComputeInstanceInfo_t, nvmlComputeInstancePlacement_t, nvmlComputeInstanceProfileInfo_t,
    nvmlComputeInstance_t, nvmlDevice_t, nvmlGpuInstanceInfo_t, nvmlGpuInstancePlacement_t,
    nvmlGpuInstanceProfileInfo_t, nvmlGpuInstanceProfileInfo_v2_t, nvmlGpuInstance_t, nvmlReturn_t,
};
use std::ffi::c_uint;

/// The UUID of the MIG device of a created compute instance: from the GPU index, the GI and
/// CI ids and the GPU's creation count, so that a re-created instance gets a new one.
pub(crate) fn mig_uuid(gpu: usize, gi: u32, ci: u32, serial: u64) -> String {
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
pub(crate) fn engines(slices: u32) -> [u32; 5] {
    let seventh = slices / 7;
    [slices, slices.saturating_mul(5) / 7, 0, seventh, seventh]
}

pub(crate) fn gi_profile_info(p: &MigProfileConfig) -> nvmlGpuInstanceProfileInfo_t {
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

/// The slices of compute-instance profile `profile` in `gi`: `INVALID_ARGUMENT` for an id
/// beyond NVML's, `NOT_SUPPORTED` for an engine profile other than shared or a profile larger
/// than the GPU instance.
pub(crate) fn ci_slices(
    gi: &GpuInstance,
    profile: c_uint,
    engines: c_uint,
) -> Result<u32, nvmlReturn_t> {
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
