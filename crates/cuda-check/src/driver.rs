//! The CUDA driver API, loaded from `libcuda.so.1` at run time: the calls this program makes,
//! each behind a safe method.
//!
//! This is the only module with `unsafe` code. It is needed for two things only: loading a
//! shared library (its initialisers run in this process) and calling C functions through
//! pointers looked up by name. Why each is sound is said where it happens; the rules they rely
//! on are the driver API's documented signatures (cuda.h, which this program does not need to
//! build: the types are restated below with their C sizes) and that every pointer handed over
//! is valid, of the size the call writes, for the length of the call.
#![allow(unsafe_code)]

use libloading::Library;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

/// `CUresult`, a C enum (an `int`).
type CuResult = c_int;
/// `CUdevice` is an `int`; `CUdeviceptr` is an `unsigned long long` on 64-bit systems.
type CuDevice = c_int;
type CuDevicePtr = u64;
/// `CUcontext`, `CUmodule`, `CUfunction`, `CUstream`: opaque pointers.
type Handle = *mut c_void;

/// `CUDA_SUCCESS`.
const SUCCESS: CuResult = 0;
/// `CUDA_ERROR_OUT_OF_MEMORY`.
pub const OUT_OF_MEMORY: CuResult = 2;
/// `CUDA_ERROR_NO_DEVICE`.
pub const NO_DEVICE: CuResult = 100;
/// `CU_JIT_ERROR_LOG_BUFFER` and `CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES` (`CUjit_option`).
const JIT_ERROR_LOG_BUFFER: c_uint = 5;
const JIT_ERROR_LOG_BUFFER_SIZE_BYTES: c_uint = 6;
/// The JIT's error log size.
const JIT_LOG_BYTES: usize = 8192;

/// A failed driver call: which call, its `CUresult` and the driver's name for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaError {
    /// The driver API function.
    pub call: &'static str,
    /// Its `CUresult`.
    pub code: i32,
    /// `cuGetErrorName`'s text (`CUDA_ERROR_NO_DEVICE`), or the number.
    pub name: String,
    /// More from the driver (the JIT's error log).
    pub detail: String,
}

impl std::fmt::Display for CudaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} failed: {} ({})", self.call, self.name, self.code)?;
        if !self.detail.is_empty() {
            write!(f, ": {}", self.detail)?;
        }
        Ok(())
    }
}

/// The driver API functions used, as C function pointers.
struct Api {
    init: unsafe extern "C" fn(c_uint) -> CuResult,
    driver_get_version: unsafe extern "C" fn(*mut c_int) -> CuResult,
    get_error_name: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get: unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult,
    device_get_name: unsafe extern "C" fn(*mut c_char, c_int, CuDevice) -> CuResult,
    device_total_mem: unsafe extern "C" fn(*mut usize, CuDevice) -> CuResult,
    primary_ctx_retain: unsafe extern "C" fn(*mut Handle, CuDevice) -> CuResult,
    primary_ctx_release: unsafe extern "C" fn(CuDevice) -> CuResult,
    ctx_set_current: unsafe extern "C" fn(Handle) -> CuResult,
    ctx_synchronize: unsafe extern "C" fn() -> CuResult,
    mem_get_info: unsafe extern "C" fn(*mut usize, *mut usize) -> CuResult,
    mem_alloc: unsafe extern "C" fn(*mut CuDevicePtr, usize) -> CuResult,
    mem_free: unsafe extern "C" fn(CuDevicePtr) -> CuResult,
    memcpy_htod: unsafe extern "C" fn(CuDevicePtr, *const c_void, usize) -> CuResult,
    memcpy_dtoh: unsafe extern "C" fn(*mut c_void, CuDevicePtr, usize) -> CuResult,
    module_load_data_ex: unsafe extern "C" fn(
        *mut Handle,
        *const c_void,
        c_uint,
        *mut c_uint,
        *mut *mut c_void,
    ) -> CuResult,
    module_unload: unsafe extern "C" fn(Handle) -> CuResult,
    module_get_function: unsafe extern "C" fn(*mut Handle, Handle, *const c_char) -> CuResult,
    #[allow(clippy::type_complexity)]
    launch_kernel: unsafe extern "C" fn(
        Handle,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        Handle,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> CuResult,
}

/// The loaded driver. The function pointers in `api` point into `_library`, which lives as
/// long as this value.
pub struct Cuda {
    api: Api,
    _library: Library,
}

/// A device ordinal's handle.
#[derive(Debug, Clone, Copy)]
pub struct Device(CuDevice);

/// The device's primary context, retained (released when dropped).
pub struct Context<'a> {
    cuda: &'a Cuda,
    device: Device,
}

/// Device memory (freed when dropped, or by [`Buffer::free`] to see the result).
pub struct Buffer<'a> {
    cuda: &'a Cuda,
    ptr: CuDevicePtr,
    bytes: usize,
}

/// A loaded module (unloaded when dropped).
pub struct Module<'a> {
    cuda: &'a Cuda,
    handle: Handle,
}

/// A kernel of a module.
pub struct Function<'m> {
    handle: Handle,
    _module: std::marker::PhantomData<&'m ()>,
}

/// Looks up `name` in `library` as a function pointer of type `T`.
///
/// # Safety
/// `T` must be the C signature of `name` as the driver API declares it.
unsafe fn symbol<T: Copy>(library: &Library, name: &str) -> Result<T, libloading::Error> {
    // SAFETY: the caller names the symbol's true type; the pointer is copied out and used
    // only while `library` is loaded (both live in the same `Cuda`).
    unsafe { library.get::<T>(name.as_bytes()).map(|s| *s) }
}

impl Cuda {
    /// Loads `libcuda.so.1` the way CUDA programs do (the dynamic loader's search:
    /// `LD_LIBRARY_PATH`, the loader cache, the default folders) and looks up the calls.
    pub fn load() -> Result<Cuda, libloading::Error> {
        // SAFETY: loading runs libcuda's initialisers. libcuda is the driver's own library,
        // made to be loaded into any process (every CUDA program does exactly this through
        // the CUDA runtime); it has no initialiser that depends on the loading program.
        let library = unsafe { Library::new("libcuda.so.1") }?;
        // SAFETY (each `symbol`): the types are the signatures of cuda.h for these names
        // (`_v2` names are the 64-bit-size versions that cuda.h maps the plain names to):
        // `CUresult` is an `int`, `CUdevice` an `int`, `CUdeviceptr` a 64-bit integer,
        // handles are pointers, sizes are `size_t`.
        let api = unsafe {
            Api {
                init: symbol(&library, "cuInit")?,
                driver_get_version: symbol(&library, "cuDriverGetVersion")?,
                get_error_name: symbol(&library, "cuGetErrorName")?,
                device_get_count: symbol(&library, "cuDeviceGetCount")?,
                device_get: symbol(&library, "cuDeviceGet")?,
                device_get_name: symbol(&library, "cuDeviceGetName")?,
                device_total_mem: symbol(&library, "cuDeviceTotalMem_v2")?,
                primary_ctx_retain: symbol(&library, "cuDevicePrimaryCtxRetain")?,
                primary_ctx_release: symbol(&library, "cuDevicePrimaryCtxRelease_v2")?,
                ctx_set_current: symbol(&library, "cuCtxSetCurrent")?,
                ctx_synchronize: symbol(&library, "cuCtxSynchronize")?,
                mem_get_info: symbol(&library, "cuMemGetInfo_v2")?,
                mem_alloc: symbol(&library, "cuMemAlloc_v2")?,
                mem_free: symbol(&library, "cuMemFree_v2")?,
                memcpy_htod: symbol(&library, "cuMemcpyHtoD_v2")?,
                memcpy_dtoh: symbol(&library, "cuMemcpyDtoH_v2")?,
                module_load_data_ex: symbol(&library, "cuModuleLoadDataEx")?,
                module_unload: symbol(&library, "cuModuleUnload")?,
                module_get_function: symbol(&library, "cuModuleGetFunction")?,
                launch_kernel: symbol(&library, "cuLaunchKernel")?,
            }
        };
        Ok(Cuda {
            api,
            _library: library,
        })
    }

    /// `Ok`, or the error of `call` with the driver's name for `code`.
    fn check(&self, call: &'static str, code: CuResult) -> Result<(), CudaError> {
        if code == SUCCESS {
            return Ok(());
        }
        let mut text: *const c_char = std::ptr::null();
        // SAFETY: `text` is a valid place for the one pointer the call writes.
        let named = unsafe { (self.api.get_error_name)(code, &mut text) };
        let name = if named == SUCCESS && !text.is_null() {
            // SAFETY: on success the driver points `text` at a static NUL-terminated string.
            unsafe { CStr::from_ptr(text) }
                .to_string_lossy()
                .into_owned()
        } else {
            format!("CUresult {code}")
        };
        Err(CudaError {
            call,
            code,
            name,
            detail: String::new(),
        })
    }

    /// `cuInit(0)`.
    pub fn init(&self) -> Result<(), CudaError> {
        // SAFETY: takes flags by value (0 is the only defined value).
        self.check("cuInit", unsafe { (self.api.init)(0) })
    }

    /// The CUDA version the driver supports (`13000` for 13.0).
    pub fn driver_version(&self) -> Result<i32, CudaError> {
        let mut v: c_int = 0;
        // SAFETY: `v` is a valid `int` to write.
        self.check("cuDriverGetVersion", unsafe {
            (self.api.driver_get_version)(&mut v)
        })?;
        Ok(v)
    }

    /// How many devices the driver sees.
    pub fn device_count(&self) -> Result<i32, CudaError> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid `int` to write.
        self.check("cuDeviceGetCount", unsafe {
            (self.api.device_get_count)(&mut n)
        })?;
        Ok(n)
    }

    /// The device of ordinal `ordinal`.
    pub fn device(&self, ordinal: i32) -> Result<Device, CudaError> {
        let mut d: CuDevice = 0;
        // SAFETY: `d` is a valid `CUdevice` to write.
        self.check("cuDeviceGet", unsafe {
            (self.api.device_get)(&mut d, ordinal)
        })?;
        Ok(Device(d))
    }

    /// The device's product name.
    pub fn device_name(&self, device: Device) -> Result<String, CudaError> {
        let mut buf = [0 as c_char; 256];
        let len = c_int::try_from(buf.len()).unwrap_or(c_int::MAX);
        // SAFETY: the driver writes at most `len` bytes, NUL included, into `buf`.
        self.check("cuDeviceGetName", unsafe {
            (self.api.device_get_name)(buf.as_mut_ptr(), len, device.0)
        })?;
        // A terminator at the end, whatever the driver wrote.
        buf[buf.len() - 1] = 0;
        // SAFETY: `buf` holds a NUL (set above) and lives past the borrow.
        let name = unsafe { CStr::from_ptr(buf.as_ptr()) };
        Ok(name.to_string_lossy().into_owned())
    }

    /// The device's memory in bytes.
    pub fn total_memory(&self, device: Device) -> Result<usize, CudaError> {
        let mut bytes: usize = 0;
        // SAFETY: `bytes` is a valid `size_t` to write.
        self.check("cuDeviceTotalMem_v2", unsafe {
            (self.api.device_total_mem)(&mut bytes, device.0)
        })?;
        Ok(bytes)
    }

    /// Retains the device's primary context and makes it current on this thread.
    pub fn primary_context(&self, device: Device) -> Result<Context<'_>, CudaError> {
        let mut ctx: Handle = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid place for the context handle.
        self.check("cuDevicePrimaryCtxRetain", unsafe {
            (self.api.primary_ctx_retain)(&mut ctx, device.0)
        })?;
        let context = Context { cuda: self, device };
        // SAFETY: `ctx` is the handle the driver just returned, retained until `context`
        // is dropped.
        self.check("cuCtxSetCurrent", unsafe {
            (self.api.ctx_set_current)(ctx)
        })?;
        Ok(context)
    }

    /// Free and total memory of the current context's device.
    pub fn memory_info(&self) -> Result<(usize, usize), CudaError> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: both are valid `size_t`s to write.
        self.check("cuMemGetInfo_v2", unsafe {
            (self.api.mem_get_info)(&mut free, &mut total)
        })?;
        Ok((free, total))
    }

    /// Allocates `bytes` of device memory in the current context.
    pub fn alloc(&self, bytes: usize) -> Result<Buffer<'_>, CudaError> {
        let mut ptr: CuDevicePtr = 0;
        // SAFETY: `ptr` is a valid `CUdeviceptr` to write.
        self.check("cuMemAlloc_v2", unsafe {
            (self.api.mem_alloc)(&mut ptr, bytes)
        })?;
        Ok(Buffer {
            cuda: self,
            ptr,
            bytes,
        })
    }

    /// Copies `data` to the start of `buffer`.
    pub fn copy_to(&self, buffer: &Buffer<'_>, data: &[f32]) -> Result<(), CudaError> {
        let bytes = std::mem::size_of_val(data);
        self.fits("cuMemcpyHtoD_v2", buffer, bytes)?;
        // SAFETY: `data` is readable for `bytes` bytes; `buffer` holds at least as many.
        self.check("cuMemcpyHtoD_v2", unsafe {
            (self.api.memcpy_htod)(buffer.ptr, data.as_ptr().cast(), bytes)
        })
    }

    /// Copies the start of `buffer` into `out`.
    pub fn copy_from(&self, buffer: &Buffer<'_>, out: &mut [f32]) -> Result<(), CudaError> {
        let bytes = std::mem::size_of_val(out);
        self.fits("cuMemcpyDtoH_v2", buffer, bytes)?;
        // SAFETY: `out` is writable for `bytes` bytes, and any bit pattern is an `f32`;
        // `buffer` holds at least as many.
        self.check("cuMemcpyDtoH_v2", unsafe {
            (self.api.memcpy_dtoh)(out.as_mut_ptr().cast(), buffer.ptr, bytes)
        })
    }

    /// An error unless `buffer` holds `bytes`.
    fn fits(&self, call: &'static str, buffer: &Buffer<'_>, bytes: usize) -> Result<(), CudaError> {
        if bytes <= buffer.bytes {
            return Ok(());
        }
        Err(CudaError {
            call,
            code: -1,
            name: "a copy larger than its buffer".into(),
            detail: format!("{bytes} bytes into {}", buffer.bytes),
        })
    }

    /// Loads PTX text with the driver's JIT; the JIT's error log comes with an error.
    pub fn load_ptx(&self, ptx: &CStr) -> Result<Module<'_>, CudaError> {
        let mut handle: Handle = std::ptr::null_mut();
        let mut log = vec![0u8; JIT_LOG_BYTES];
        let mut options = [JIT_ERROR_LOG_BUFFER, JIT_ERROR_LOG_BUFFER_SIZE_BYTES];
        // The values are pointer-sized: the buffer's address, and its size as an integer in
        // the pointer's place (as cuda.h documents for size options).
        let mut values: [*mut c_void; 2] = [log.as_mut_ptr().cast(), JIT_LOG_BYTES as *mut c_void];
        let count = c_uint::try_from(options.len()).unwrap_or(0);
        // SAFETY: `ptx` is NUL-terminated text, as the call requires of PTX; `options` and
        // `values` hold `count` entries each; the log buffer is writable for the size given
        // and lives past the call.
        let code = unsafe {
            (self.api.module_load_data_ex)(
                &mut handle,
                ptx.as_ptr().cast(),
                count,
                options.as_mut_ptr(),
                values.as_mut_ptr(),
            )
        };
        self.check("cuModuleLoadDataEx", code).map_err(|mut e| {
            let end = log.iter().position(|b| *b == 0).unwrap_or(log.len());
            e.detail = String::from_utf8_lossy(&log[..end]).trim().to_owned();
            e
        })?;
        Ok(Module { cuda: self, handle })
    }

    /// The kernel `name` of `module`.
    pub fn function<'m>(
        &self,
        module: &'m Module<'_>,
        name: &CStr,
    ) -> Result<Function<'m>, CudaError> {
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: `module.handle` is a loaded module (alive while `module` is); `name` is
        // NUL-terminated; `handle` is a valid place for the function handle.
        self.check("cuModuleGetFunction", unsafe {
            (self.api.module_get_function)(&mut handle, module.handle, name.as_ptr())
        })?;
        Ok(Function {
            handle,
            _module: std::marker::PhantomData,
        })
    }

    /// Launches the PTX kernel of [`crate::ptx::SAXPY`] over `n` elements of `x` and `y` in
    /// blocks of `block` threads, on the default stream, and waits for it.
    pub fn launch_saxpy(
        &self,
        saxpy: &Function<'_>,
        block: u32,
        n: u32,
        a: f32,
        x: &Buffer<'_>,
        y: &Buffer<'_>,
    ) -> Result<(), CudaError> {
        let needed = usize::try_from(n)
            .ok()
            .and_then(|n| n.checked_mul(4))
            .unwrap_or(usize::MAX);
        self.fits("cuLaunchKernel", x, needed)?;
        self.fits("cuLaunchKernel", y, needed)?;
        let grid = n.div_ceil(block.max(1));
        let (mut n, mut a, mut x, mut y) = (n, a, x.ptr, y.ptr);
        let mut params: [*mut c_void; 4] = [
            (&raw mut n).cast(),
            (&raw mut a).cast(),
            (&raw mut x).cast(),
            (&raw mut y).cast(),
        ];
        // SAFETY: the kernel's parameters are `.u32, .f32, .u64, .u64` (ptx.rs's test pins
        // them), and `params` points at a `u32`, an `f32` and two `u64`s in that order, alive
        // until the call returns (the driver copies them at launch); the kernel touches only
        // indices below `n`, within both buffers (checked above); no extra options.
        let code = unsafe {
            (self.api.launch_kernel)(
                saxpy.handle,
                grid,
                1,
                1,
                block,
                1,
                1,
                0,
                std::ptr::null_mut(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        self.check("cuLaunchKernel", code)?;
        // SAFETY: no arguments; waits for the current context's work.
        self.check("cuCtxSynchronize", unsafe { (self.api.ctx_synchronize)() })
    }
}

impl Buffer<'_> {
    /// Frees the memory, with the driver's answer.
    pub fn free(mut self) -> Result<(), CudaError> {
        let ptr = std::mem::take(&mut self.ptr);
        // SAFETY: `ptr` came from cuMemAlloc_v2 and is freed once (the field is zeroed, so
        // the drop below frees nothing).
        self.cuda
            .check("cuMemFree_v2", unsafe { (self.cuda.api.mem_free)(ptr) })
    }
}

impl Drop for Buffer<'_> {
    fn drop(&mut self) {
        if self.ptr != 0 {
            // SAFETY: as in `free`; a pointer not freed there is freed once here.
            let _ = unsafe { (self.cuda.api.mem_free)(self.ptr) };
        }
    }
}

impl Drop for Module<'_> {
    fn drop(&mut self) {
        // SAFETY: the module was loaded and is unloaded once; functions borrowed from it are
        // gone (they borrow the module).
        let _ = unsafe { (self.cuda.api.module_unload)(self.handle) };
    }
}

impl Drop for Context<'_> {
    fn drop(&mut self) {
        // SAFETY: releases the one reference `primary_context` retained.
        let _ = unsafe { (self.cuda.api.primary_ctx_release)(self.device.0) };
    }
}
