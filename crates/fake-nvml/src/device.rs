//! The exported device queries of a GPU: count and handles, UUID, name, minor number, memory,
//! PCI information, compute capability, topology between GPUs, NVLinks and field values. MIG
//! device handles answer UUID, name and memory here too.

use crate::abi::{
    field_values, put, put_str, FIELD_RECOVERY_ACTION, GPU_IS_LOST, INVALID_ARGUMENT, MAX_LINKS,
    NOT_FOUND, NOT_SUPPORTED, SUCCESS,
};
use crate::config::GpuConfig;
use crate::state::{handle, with_state};
use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlEnableState_t, nvmlFieldValue_t, nvmlGpuTopologyLevel_t, nvmlMemory_v2_t,
    nvmlPciInfo_t, nvmlReturn_t,
};
use std::ffi::{c_char, c_int, c_uint, CStr};

pub(crate) fn pci_info(bus_id: &str) -> nvmlPciInfo_t {
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn pci_info_splits_the_bus_id() {
        let info = pci_info("00000000:3B:00.0");
        assert_eq!((info.domain, info.bus, info.device), (0, 0x3b, 0));
        let text = unsafe { CStr::from_ptr(info.busId.as_ptr()) };
        assert_eq!(text.to_str().unwrap(), "00000000:3B:00.0");
    }
}
