//! The exported event functions: supported types, event sets, registration and the wait that
//! also applies the control file's lines.

use crate::abi::{
    put, EVENT_DBE, EVENT_MIG, EVENT_RECOVERY_ACTION, EVENT_SBE, EVENT_XID, GPU_IS_LOST,
    INVALID_ARGUMENT, SUCCESS, TIMEOUT, UNKNOWN,
};
use crate::state::{handle, with_state, Set, State};
use nvml_wrapper_sys::bindings::{nvmlDevice_t, nvmlEventData_t, nvmlEventSet_t, nvmlReturn_t};
use std::ffi::{c_uint, c_ulonglong};
use std::time::{Duration, Instant};

/// How often a waiting caller looks at the control file.
const CONTROL_POLL: Duration = Duration::from_millis(2);

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
