//! `nvmlInit` and `nvmlShutdown` (where the topology is found and how it is loaded), the error
//! strings and the system queries (driver and CUDA versions).

use crate::abi::{
    put, put_str, DRIVER_NOT_LOADED, GPU_IS_LOST, INSUFFICIENT_RESOURCES, INSUFFICIENT_SIZE,
    INVALID_ARGUMENT, IN_USE, LIB_RM_VERSION_MISMATCH, NOT_FOUND, NOT_SUPPORTED, SUCCESS, TIMEOUT,
    UNINITIALIZED, UNKNOWN,
};
use crate::config::{version_pair, Config};
use crate::state::{kept, lock, with_state, State};
use nvml_wrapper_sys::bindings::nvmlReturn_t;
use std::ffi::{c_char, c_int, c_uint, CStr};
use std::path::{Path, PathBuf};

/// Where this library was loaded from (the mapping that holds one of its functions).
pub(crate) fn own_path() -> Option<PathBuf> {
    let here = nvmlInit_v2 as *const () as usize;
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|line| {
        let mut parts = line.split_whitespace();
        let (start, end) = parts.next()?.split_once('-')?;
        let (start, end) = (
            usize::from_str_radix(start, 16).ok()?,
            usize::from_str_radix(end, 16).ok()?,
        );
        let path = parts.nth(4)?;
        (start <= here && here < end && path.starts_with('/')).then(|| PathBuf::from(path))
    })
}

pub(crate) fn config_path() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("FAKE_NVML_CONFIG") {
        return Some(PathBuf::from(path));
    }
    Some(own_path()?.parent()?.join("fake-nvml.yaml"))
}

pub(crate) fn load() -> Result<State, String> {
    let path = config_path().ok_or("cannot tell where the config is")?;
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let config = Config::parse(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let beside = |c: &PathBuf| {
        if c.is_absolute() {
            c.clone()
        } else {
            path.parent().unwrap_or(Path::new("/")).join(c)
        }
    };
    let control = config.control.as_ref().map(beside);
    let init_log = config.init_log.as_ref().map(beside);
    let broken_while = config.broken_while.as_ref().map(beside);
    let control_offset = control
        .as_ref()
        .and_then(|c| std::fs::metadata(c).ok())
        .map_or(0, |m| usize::try_from(m.len()).unwrap_or(usize::MAX));
    let mut state = State::new(config, control, control_offset);
    state.init_log = init_log;
    state.broken_while = broken_while;
    Ok(state)
}

/// `nvmlInit_v2`: reads the topology.
#[no_mangle]
pub extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    let mut guard = lock();
    if guard.is_none() {
        match load() {
            Ok(state) => *guard = Some(state),
            Err(err) => {
                eprintln!("fake-nvml: {err}");
                return DRIVER_NOT_LOADED;
            }
        }
    }
    if let Some(state) = guard.as_mut() {
        if state.broken() {
            if state.users == 0 {
                *guard = None;
            }
            return LIB_RM_VERSION_MISMATCH;
        }
        state.users = state.users.saturating_add(1);
        if let Some(path) = &state.init_log {
            let logged = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .and_then(|mut f| std::io::Write::write_all(&mut f, b"init\n"));
            if let Err(err) = logged {
                eprintln!("fake-nvml: {}: {err}", path.display());
            }
        }
    }
    SUCCESS
}

/// `nvmlInitWithFlags`: as `nvmlInit_v2`.
#[no_mangle]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nvmlReturn_t {
    nvmlInit_v2()
}

/// `nvmlShutdown`: the last user's shutdown forgets the state.
#[no_mangle]
pub extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    let mut guard = lock();
    let Some(state) = guard.as_mut() else {
        return UNINITIALIZED;
    };
    state.users = state.users.saturating_sub(1);
    if state.users == 0 {
        // Created MIG instances outlive the state, as on a GPU (see `Kept`).
        let mut kept = kept();
        for gpu in &state.gpus {
            if let Some(k) = gpu.keep() {
                kept.insert(gpu.config.uuid.clone(), k);
            }
        }
        drop(kept);
        *guard = None;
    }
    SUCCESS
}

/// `nvmlErrorString`.
#[no_mangle]
pub extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    let text: &'static CStr = match result {
        SUCCESS => c"Success",
        UNINITIALIZED => c"Uninitialized",
        INVALID_ARGUMENT => c"Invalid Argument",
        NOT_SUPPORTED => c"Not Supported",
        NOT_FOUND => c"Not Found",
        IN_USE => c"In use by another client",
        INSUFFICIENT_RESOURCES => c"Ran out of critical resources, other than memory",
        INSUFFICIENT_SIZE => c"Insufficient Size",
        DRIVER_NOT_LOADED => c"Driver Not Loaded",
        TIMEOUT => c"Timeout",
        GPU_IS_LOST => c"GPU is lost",
        _ => c"Unknown Error",
    };
    text.as_ptr()
}

/// `nvmlSystemGetDriverVersion`.
#[no_mangle]
pub extern "C" fn nvmlSystemGetDriverVersion(version: *mut c_char, length: c_uint) -> nvmlReturn_t {
    with_state(|s| put_str(version, length, &s.config.driver_version))
}

/// `nvmlSystemGetCudaDriverVersion_v2`: `1000 * major + 10 * minor`.
#[no_mangle]
pub extern "C" fn nvmlSystemGetCudaDriverVersion_v2(version: *mut c_int) -> nvmlReturn_t {
    with_state(|s| {
        let (major, minor) = version_pair(&s.config.cuda_version).ok_or(UNKNOWN)?;
        put(
            version,
            major
                .saturating_mul(1000)
                .saturating_add(minor.saturating_mul(10)),
        )
    })
}

/// `nvmlSystemGetCudaDriverVersion`: as `_v2`.
#[no_mangle]
pub extern "C" fn nvmlSystemGetCudaDriverVersion(version: *mut c_int) -> nvmlReturn_t {
    nvmlSystemGetCudaDriverVersion_v2(version)
}
