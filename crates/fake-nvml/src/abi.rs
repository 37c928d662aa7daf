//! NVML's C ABI as this library speaks it: the return codes and constants of `nvml.h` it
//! answers with, and the only code that touches the caller's pointers (a value written or read
//! through an out-pointer, a list into the caller's array, a string into the caller's buffer).
//! The C types themselves are `nvml-wrapper-sys`'s.

use nvml_wrapper_sys::bindings::{nvmlFieldValue_t, nvmlReturn_t};
use std::ffi::{c_char, c_uint};

pub(crate) const SUCCESS: nvmlReturn_t = 0;
pub(crate) const UNINITIALIZED: nvmlReturn_t = 1;
pub(crate) const INVALID_ARGUMENT: nvmlReturn_t = 2;
pub(crate) const NOT_SUPPORTED: nvmlReturn_t = 3;
pub(crate) const NOT_FOUND: nvmlReturn_t = 6;
pub(crate) const INSUFFICIENT_SIZE: nvmlReturn_t = 7;
pub(crate) const DRIVER_NOT_LOADED: nvmlReturn_t = 9;
pub(crate) const TIMEOUT: nvmlReturn_t = 10;
pub(crate) const GPU_IS_LOST: nvmlReturn_t = 15;
pub(crate) const IN_USE: nvmlReturn_t = 19;
pub(crate) const INSUFFICIENT_RESOURCES: nvmlReturn_t = 23;
pub(crate) const UNKNOWN: nvmlReturn_t = 999;
/// `NVML_ERROR_LIB_RM_VERSION_MISMATCH`: the library and the kernel module differ.
pub(crate) const LIB_RM_VERSION_MISMATCH: nvmlReturn_t = 18;

/// `NVML_NVLINK_MAX_LINKS`.
pub(crate) const MAX_LINKS: u32 = 18;
/// `NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`.
pub(crate) const FIELD_RECOVERY_ACTION: u32 = 230;
/// `nvmlEventTypeSingleBitEccError`.
pub(crate) const EVENT_SBE: u64 = 0x1;
/// `nvmlEventTypeDoubleBitEccError`.
pub(crate) const EVENT_DBE: u64 = 0x2;
/// `nvmlEventTypeXidCriticalError`.
pub(crate) const EVENT_XID: u64 = 0x8;
/// `nvmlEventMigConfigChange`.
pub(crate) const EVENT_MIG: u64 = 0x100;
/// `nvmlDeviceGetMaxMigDeviceCount` of a MIG-capable GPU (A100, H100).
pub(crate) const MAX_MIG_DEVICES: u32 = 7;
/// `nvmlEventTypeGpuRecoveryAction` (driver 565 and later).
pub(crate) const EVENT_RECOVERY_ACTION: u64 = 0x8000;
/// `NVML_GPU_INSTANCE_PROFILE_COUNT`.
pub(crate) const GI_PROFILE_COUNT: u32 = 17;
/// `NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED`, the only engine profile.
pub(crate) const CI_ENGINE_SHARED: u32 = 0;
/// Compute slices of the compute-instance profiles `NVML_COMPUTE_INSTANCE_PROFILE_*`, by id
/// (1, 2, 3, 4, 7, 8, 6 slices and 1 slice rev. 1).
pub(crate) const CI_SLICES: [u32; 8] = [1, 2, 3, 4, 7, 8, 6, 1];
/// Streaming multiprocessors per slice of an A100 (default of `multiprocessors`).
pub(crate) const SMS_PER_SLICE: u32 = 14;
/// The largest GPU- or compute-instance id a handle can hold (8 bits, see `gi_handle`).
pub(crate) const MAX_INSTANCE_ID: u32 = 0xff;

/// Writes `value` through `out` after a null check.
pub(crate) fn put<T>(out: *mut T, value: T) -> Result<(), nvmlReturn_t> {
    if out.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: `out` is non-null and, per the NVML contract, points to a writable `T` that the
    // caller owns for the duration of the call.
    unsafe { out.write(value) };
    Ok(())
}

/// Reads the value the caller passed through `ptr` after a null check.
pub(crate) fn get<T: Copy>(ptr: *const T) -> Result<T, nvmlReturn_t> {
    if ptr.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: `ptr` is non-null and, per the NVML contract, points to an initialised `T` that
    // the caller owns for the duration of the call.
    Ok(unsafe { ptr.read() })
}

/// Writes `values` into the caller's array, which has room for `room` of them.
pub(crate) fn put_array<T: Copy>(
    out: *mut T,
    room: usize,
    values: &[T],
) -> Result<(), nvmlReturn_t> {
    if out.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    if values.len() > room {
        return Err(INSUFFICIENT_SIZE);
    }
    // SAFETY: `out` is non-null and the caller's array holds `room >= values.len()` elements
    // of `T` (for the instance lists, NVML's contract: room for the profile's instance count).
    unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), out, values.len()) };
    Ok(())
}

/// Copies `text` and a NUL into the caller's buffer of `length` bytes.
pub(crate) fn put_str(buf: *mut c_char, length: c_uint, text: &str) -> Result<(), nvmlReturn_t> {
    if buf.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    let bytes = text.as_bytes();
    if bytes.len() >= length as usize {
        return Err(INSUFFICIENT_SIZE);
    }
    // SAFETY: `buf` is non-null and the caller says it holds `length` bytes; we write
    // `bytes.len() + 1 <= length` of them.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), buf, bytes.len());
        buf.add(bytes.len()).write(0);
    }
    Ok(())
}

/// The caller's array of `count` field values (non-null, checked by the caller).
pub(crate) fn field_values<'a>(
    values: *mut nvmlFieldValue_t,
    count: usize,
) -> &'a mut [nvmlFieldValue_t] {
    // SAFETY: NVML's contract for nvmlDeviceGetFieldValues: `values` points to `count`
    // initialised field values owned by the caller for the duration of the call.
    unsafe { std::slice::from_raw_parts_mut(values, count) }
}

/// `text` as a NUL-terminated C string in a fixed array (cut to fit).
pub(crate) fn c_string<const N: usize>(text: &str) -> [c_char; N] {
    let mut out = [0; N];
    for (dst, src) in out.iter_mut().zip(text.bytes().take(N.saturating_sub(1))) {
        *dst = src as c_char;
    }
    out
}
