//! A fake `libnvidia-ml.so.1`: the NVML C functions that `nvml-wrapper` calls, answering from a
//! YAML topology instead of a GPU, so tests and demos run devplug's real NVML loading path
//! (dlopen, symbol lookup, init, events) on a machine without NVIDIA hardware.
//!
//! **Why `unsafe` is allowed here and nowhere else in the workspace:** this crate *is* a C
//! library. NVML's ABI hands us raw out-pointers (`unsigned int *count`, `char *name`,
//! `nvmlEventData_t *data`) and the exported functions must be `#[no_mangle] extern "C"`; writing
//! through those pointers cannot be done in safe Rust. Every `unsafe` block below only writes
//! one value of the caller's declared type through a pointer the caller passed, after a null
//! check, or writes a bounded string into a buffer of the caller's stated length. The rest
//! of devplug talks to this library through `nvml-wrapper`'s safe API, exactly as it talks to
//! the real one.
//!
//! **Configuration.** The YAML file named in `FAKE_NVML_CONFIG`, or else `fake-nvml.yaml` next
//! to the loaded library (so tests that copy the library into a temporary driver root can run
//! in parallel, each with its own topology). See `topologies/*.yaml` for the shape. It is read
//! at `nvmlInit`; a missing or invalid file makes init fail with `DRIVER_NOT_LOADED` (the
//! message goes to stderr).
//!
//! **Faults at run time.** If the config names a `control` file, every complete line appended
//! to it is applied while a caller waits in `nvmlEventSetWait_v2` (it is read every 2 ms):
//!
//! | line | effect |
//! |---|---|
//! | `xid <gpu> <code> [action]` | a critical XID event; `action` sets the GPU recovery action |
//! | `ecc <gpu> [action]` | a double-bit ECC event; `action` sets the GPU recovery action |
//! | `action <gpu> <n>` | sets the GPU recovery action (field 230) and sends its event (0x8000) |
//! | `lost <gpu>` | the GPU falls off the bus: its calls fail `GPU_IS_LOST`, waits fail once |
//! | `found <gpu>` | the GPU answers again |
//! | `events broken` | event waits and registrations fail with `UNKNOWN` (a sick driver) |
//! | `events ok` | they work again |
//! | `mig <gpu> <layout>` | MIG on with the devices of `mig_layouts.<layout>`; sends `nvmlEventMigConfigChange` (0x100) |
//! | `mig <gpu> off` | MIG off; sends the same event |
//!
//! **MIG.** A GPU with `mig: true` is in MIG mode with `mig_devices` (UUID, GPU- and
//! compute-instance ids, slice counts, memory). Their handles answer UUID, name, memory,
//! attributes (slices and memory, for the profile name), the is-MIG query, the parent handle and
//! the GI/CI ids; `nvmlDeviceGetMaxMigDeviceCount` is 7 and empty slots answer `NOT_FOUND`.
//! `mig: false` is MIG-capable but off; without `mig` the GPU answers `NOT_SUPPORTED`.
//!
//! `<gpu>` is an index or a UUID. Events reach only the event sets that registered the GPU for
//! that event type, as in NVML.

use nvml_wrapper_sys::bindings::{
    nvmlDeviceAttributes_t, nvmlDevice_t, nvmlEnableState_t, nvmlEventData_t, nvmlEventSet_t,
    nvmlFieldValue_t, nvmlGpuTopologyLevel_t, nvmlMemory_v2_t, nvmlPciInfo_t, nvmlReturn_t,
};
use serde::Deserialize;
use std::collections::{BTreeMap, VecDeque};
use std::ffi::{c_char, c_int, c_uint, c_ulonglong, CStr};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

const SUCCESS: nvmlReturn_t = 0;
const UNINITIALIZED: nvmlReturn_t = 1;
const INVALID_ARGUMENT: nvmlReturn_t = 2;
const NOT_SUPPORTED: nvmlReturn_t = 3;
const NOT_FOUND: nvmlReturn_t = 6;
const INSUFFICIENT_SIZE: nvmlReturn_t = 7;
const DRIVER_NOT_LOADED: nvmlReturn_t = 9;
const TIMEOUT: nvmlReturn_t = 10;
const GPU_IS_LOST: nvmlReturn_t = 15;
const UNKNOWN: nvmlReturn_t = 999;

/// `NVML_NVLINK_MAX_LINKS`.
const MAX_LINKS: u32 = 18;
/// `NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`.
const FIELD_RECOVERY_ACTION: u32 = 230;
/// `nvmlEventTypeSingleBitEccError`.
const EVENT_SBE: u64 = 0x1;
/// `nvmlEventTypeDoubleBitEccError`.
const EVENT_DBE: u64 = 0x2;
/// `nvmlEventTypeXidCriticalError`.
const EVENT_XID: u64 = 0x8;
/// `nvmlEventMigConfigChange`.
const EVENT_MIG: u64 = 0x100;
/// `nvmlDeviceGetMaxMigDeviceCount` of a MIG-capable GPU (A100, H100).
const MAX_MIG_DEVICES: u32 = 7;
/// `nvmlEventTypeGpuRecoveryAction` (driver 565 and later).
const EVENT_RECOVERY_ACTION: u64 = 0x8000;
/// How often a waiting caller looks at the control file.
const CONTROL_POLL: Duration = Duration::from_millis(2);

/// The topology file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// What `nvmlSystemGetDriverVersion` answers.
    #[serde(default = "default_driver_version")]
    pub driver_version: String,
    /// The fault-injection file (relative paths are relative to the config file).
    #[serde(default)]
    pub control: Option<PathBuf>,
    /// Whether the driver has the GPU recovery action (field 230 and event 0x8000).
    #[serde(default = "yes")]
    pub recovery_action: bool,
    /// The GPUs, in index order.
    pub gpus: Vec<GpuConfig>,
}

/// One GPU of the topology.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuConfig {
    /// `GPU-…` UUID.
    pub uuid: String,
    /// Product name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// Minor number (`/dev/nvidia<minor>`); default: the index.
    #[serde(default)]
    pub minor: Option<u32>,
    /// Memory in MiB.
    pub memory_mib: u64,
    /// PCI bus id with an 8-hex domain, e.g. `00000000:06:00.0`.
    pub bus_id: String,
    /// NUMA node (for the PCIe level between GPUs; sysfs is what devplug reads).
    #[serde(default)]
    pub numa: i64,
    /// Host bridge id: GPUs under the same one are `HOSTBRIDGE` apart.
    #[serde(default)]
    pub host_bridge: Option<u32>,
    /// PCIe switch id: GPUs under the same one are `SINGLE` apart.
    #[serde(default)]
    pub switch: Option<u32>,
    /// One entry per NVLink: the index of the GPU at the other end.
    #[serde(default)]
    pub nvlinks: Vec<u32>,
    /// One entry per NVLink to an NVSwitch: the switch's PCI bus id.
    #[serde(default)]
    pub nvswitch_links: Vec<String>,
    /// MIG mode: absent = not supported, `false` = off, `true` = on.
    #[serde(default)]
    pub mig: Option<bool>,
    /// The MIG devices while MIG is on.
    #[serde(default)]
    pub mig_devices: Vec<MigDeviceConfig>,
    /// Layouts the control line `mig <gpu> <layout>` switches to.
    #[serde(default)]
    pub mig_layouts: BTreeMap<String, Vec<MigDeviceConfig>>,
}

/// One MIG device.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigDeviceConfig {
    /// `MIG-…` UUID.
    pub uuid: String,
    /// GPU instance id.
    pub gi: u32,
    /// Compute instance id.
    #[serde(default)]
    pub ci: u32,
    /// GPU-instance slices (the `<g>` of `<g>g.<m>gb`).
    pub slices: u32,
    /// Compute-instance slices; default: all of the GPU instance's.
    #[serde(default)]
    pub ci_slices: Option<u32>,
    /// Memory in MiB.
    pub memory_mib: u64,
}

fn default_driver_version() -> String {
    "570.86.15".to_owned()
}

fn yes() -> bool {
    true
}

impl Config {
    /// Parses a topology file's text.
    pub fn parse(text: &str) -> Result<Config, String> {
        let config: Config = serde_saphyr::from_str(text).map_err(|e| e.to_string())?;
        for (i, gpu) in config.gpus.iter().enumerate() {
            let links = gpu.nvlinks.len().saturating_add(gpu.nvswitch_links.len());
            if links > MAX_LINKS as usize {
                return Err(format!("gpus[{i}]: {links} NVLinks, at most {MAX_LINKS}"));
            }
            let layouts = std::iter::once(&gpu.mig_devices).chain(gpu.mig_layouts.values());
            if let Some(layout) = layouts
                .into_iter()
                .find(|l| l.len() > MAX_MIG_DEVICES as usize)
            {
                return Err(format!(
                    "gpus[{i}]: {} MIG devices, at most {MAX_MIG_DEVICES}",
                    layout.len()
                ));
            }
            if gpu.mig != Some(true) && !gpu.mig_devices.is_empty() {
                return Err(format!("gpus[{i}]: mig_devices without mig: true"));
            }
            if let Some(bad) = gpu
                .nvlinks
                .iter()
                .find(|&&r| r as usize >= config.gpus.len())
            {
                return Err(format!("gpus[{i}].nvlinks: no GPU {bad}"));
            }
        }
        Ok(config)
    }
}

struct Event {
    device: usize,
    kind: u64,
    data: u64,
}

#[derive(Default)]
struct Set {
    events: VecDeque<Event>,
    /// A GPU was lost since the last wait: the next wait fails with `GPU_IS_LOST`.
    lost: bool,
}

struct Gpu {
    config: GpuConfig,
    /// MIG mode now (changed by `mig` control lines).
    mig_on: bool,
    /// MIG devices now.
    migs: Vec<MigDeviceConfig>,
    lost: bool,
    recovery_action: u32,
    /// (set id, event mask) registrations.
    registered: Vec<(usize, u64)>,
}

struct State {
    config: Config,
    gpus: Vec<Gpu>,
    sets: Vec<Option<Set>>,
    control: Option<PathBuf>,
    control_offset: usize,
    users: u32,
    /// `events broken`: waits and registrations fail.
    events_broken: bool,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

fn lock() -> MutexGuard<'static, Option<State>> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Where this library was loaded from (the mapping that holds one of its functions).
fn own_path() -> Option<PathBuf> {
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

fn config_path() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("FAKE_NVML_CONFIG") {
        return Some(PathBuf::from(path));
    }
    Some(own_path()?.parent()?.join("fake-nvml.yaml"))
}

fn load() -> Result<State, String> {
    let path = config_path().ok_or("cannot tell where the config is")?;
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let config = Config::parse(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let control = config.control.as_ref().map(|c| {
        if c.is_absolute() {
            c.clone()
        } else {
            path.parent().unwrap_or(Path::new("/")).join(c)
        }
    });
    let control_offset = control
        .as_ref()
        .and_then(|c| std::fs::metadata(c).ok())
        .map_or(0, |m| usize::try_from(m.len()).unwrap_or(usize::MAX));
    let gpus = config
        .gpus
        .iter()
        .map(|g| Gpu {
            config: g.clone(),
            mig_on: g.mig == Some(true),
            migs: g.mig_devices.clone(),
            lost: false,
            recovery_action: 0,
            registered: Vec::new(),
        })
        .collect();
    Ok(State {
        config,
        gpus,
        sets: Vec::new(),
        control,
        control_offset,
        users: 0,
        events_broken: false,
    })
}

impl State {
    fn gpu(&self, device: nvmlDevice_t) -> Result<&Gpu, nvmlReturn_t> {
        let gpu = (device as usize)
            .checked_sub(1)
            .and_then(|i| self.gpus.get(i))
            .ok_or(INVALID_ARGUMENT)?;
        if gpu.lost {
            return Err(GPU_IS_LOST);
        }
        Ok(gpu)
    }

    /// The GPU and MIG device of a MIG handle (`handle(gpu) << 16 | slot + 1`).
    fn mig(&self, device: nvmlDevice_t) -> Result<(&Gpu, &MigDeviceConfig), nvmlReturn_t> {
        let raw = device as usize;
        let (gpu, slot) = (raw >> 16, raw & 0xffff);
        let gpu = gpu
            .checked_sub(1)
            .and_then(|i| self.gpus.get(i))
            .ok_or(INVALID_ARGUMENT)?;
        if gpu.lost {
            return Err(GPU_IS_LOST);
        }
        let mig = slot
            .checked_sub(1)
            .filter(|_| gpu.mig_on)
            .and_then(|j| gpu.migs.get(j))
            .ok_or(INVALID_ARGUMENT)?;
        Ok((gpu, mig))
    }

    fn find(&self, which: &str) -> Option<usize> {
        if let Ok(i) = which.parse::<usize>() {
            return (i < self.gpus.len()).then_some(i);
        }
        self.gpus.iter().position(|g| g.config.uuid == which)
    }

    fn send(&mut self, device: usize, kind: u64, data: u64) {
        let Some(gpu) = self.gpus.get(device) else {
            return;
        };
        for &(set, mask) in &gpu.registered {
            if mask & kind != 0 {
                if let Some(Some(set)) = self.sets.get_mut(set) {
                    set.events.push_back(Event { device, kind, data });
                }
            }
        }
    }

    /// Applies the complete lines appended to the control file since the last look.
    fn poll_control(&mut self) {
        let Some(path) = &self.control else {
            return;
        };
        let Ok(text) = std::fs::read_to_string(path) else {
            return;
        };
        let Some(new) = text.get(self.control_offset..) else {
            // Truncated or rewritten: start over from its end.
            self.control_offset = text.len();
            return;
        };
        let Some(end) = new.rfind('\n') else {
            return;
        };
        let lines: Vec<String> = new[..end].lines().map(str::to_owned).collect();
        self.control_offset = self.control_offset.saturating_add(end + 1);
        for line in lines {
            if let Err(err) = self.apply(&line) {
                eprintln!("fake-nvml: control line {line:?}: {err}");
            }
        }
    }

    fn apply(&mut self, line: &str) -> Result<(), String> {
        let words: Vec<&str> = line.split_whitespace().collect();
        let Some((&verb, args)) = words.split_first() else {
            return Ok(());
        };
        if verb == "mig" {
            let gpu = args
                .first()
                .and_then(|w| self.find(w))
                .ok_or("no such GPU")?;
            let layout = args.get(1).ok_or("mig <gpu> <layout>|off")?;
            let g = &mut self.gpus[gpu];
            if g.config.mig.is_none() {
                return Err("this GPU has no MIG".into());
            }
            if *layout == "off" {
                g.mig_on = false;
                g.migs.clear();
            } else {
                g.migs = g
                    .config
                    .mig_layouts
                    .get(*layout)
                    .ok_or_else(|| format!("no MIG layout {layout:?}"))?
                    .clone();
                g.mig_on = true;
            }
            self.send(gpu, EVENT_MIG, 0);
            return Ok(());
        }
        if verb == "events" {
            self.events_broken = match args.first() {
                Some(&"broken") => true,
                Some(&"ok") => false,
                _ => return Err("events broken|ok".into()),
            };
            return Ok(());
        }
        let gpu = args
            .first()
            .and_then(|w| self.find(w))
            .ok_or("no such GPU")?;
        let number = |i: usize| -> Result<u64, String> {
            args.get(i)
                .ok_or_else(|| format!("argument {i} missing"))?
                .parse::<u64>()
                .map_err(|e| e.to_string())
        };
        match verb {
            "xid" => {
                let code = number(1)?;
                if args.len() > 2 {
                    let action = u32::try_from(number(2)?).map_err(|e| e.to_string())?;
                    self.gpus[gpu].recovery_action = action;
                }
                self.send(gpu, EVENT_XID, code);
            }
            "ecc" => {
                if args.len() > 1 {
                    let action = u32::try_from(number(1)?).map_err(|e| e.to_string())?;
                    self.gpus[gpu].recovery_action = action;
                }
                self.send(gpu, EVENT_DBE, 0);
            }
            "action" => {
                self.gpus[gpu].recovery_action =
                    u32::try_from(number(1)?).map_err(|e| e.to_string())?;
                if self.config.recovery_action {
                    self.send(
                        gpu,
                        EVENT_RECOVERY_ACTION,
                        u64::from(self.gpus[gpu].recovery_action),
                    );
                }
            }
            "lost" => {
                self.gpus[gpu].lost = true;
                let sets: Vec<usize> = self.gpus[gpu].registered.iter().map(|r| r.0).collect();
                for set in sets {
                    if let Some(Some(set)) = self.sets.get_mut(set) {
                        set.lost = true;
                    }
                }
            }
            "found" => self.gpus[gpu].lost = false,
            other => return Err(format!("unknown verb {other:?}")),
        }
        Ok(())
    }
}

/// Runs `f` on the initialised state (after applying new control lines), or answers
/// `UNINITIALIZED`.
fn with_state(f: impl FnOnce(&mut State) -> Result<(), nvmlReturn_t>) -> nvmlReturn_t {
    let mut guard = lock();
    match guard.as_mut() {
        None => UNINITIALIZED,
        Some(state) => {
            state.poll_control();
            match f(state) {
                Ok(()) => SUCCESS,
                Err(code) => code,
            }
        }
    }
}

/// Writes `value` through `out` after a null check.
fn put<T>(out: *mut T, value: T) -> Result<(), nvmlReturn_t> {
    if out.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: `out` is non-null and, per the NVML contract, points to a writable `T` that the
    // caller owns for the duration of the call.
    unsafe { out.write(value) };
    Ok(())
}

/// Copies `text` and a NUL into the caller's buffer of `length` bytes.
fn put_str(buf: *mut c_char, length: c_uint, text: &str) -> Result<(), nvmlReturn_t> {
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
fn field_values<'a>(values: *mut nvmlFieldValue_t, count: usize) -> &'a mut [nvmlFieldValue_t] {
    // SAFETY: NVML's contract for nvmlDeviceGetFieldValues: `values` points to `count`
    // initialised field values owned by the caller for the duration of the call.
    unsafe { std::slice::from_raw_parts_mut(values, count) }
}

fn handle(index: usize) -> nvmlDevice_t {
    index.saturating_add(1) as nvmlDevice_t
}

fn pci_info(bus_id: &str) -> nvmlPciInfo_t {
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
        state.users = state.users.saturating_add(1);
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
        if !gpu.mig_on || index as usize >= gpu.migs.len() {
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
        let (_, mig) = match s.mig(device) {
            Ok(found) => found,
            Err(_) => {
                s.gpu(device)?;
                return Err(NOT_SUPPORTED);
            }
        };
        put(
            attributes,
            nvmlDeviceAttributes_t {
                multiprocessorCount: mig.slices.saturating_mul(14),
                sharedCopyEngineCount: mig.slices,
                sharedDecoderCount: 0,
                sharedEncoderCount: 0,
                sharedJpegCount: 0,
                sharedOfaCount: 0,
                gpuInstanceSliceCount: mig.slices,
                computeInstanceSliceCount: mig.ci_slices.unwrap_or(mig.slices),
                memorySizeMB: mig.memory_mib,
            },
        )
    })
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
                    gpuInstanceId: u32::MAX,
                    computeInstanceId: u32::MAX,
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn shipped_topologies_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("topologies");
        let mut names = Vec::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let config = Config::parse(&std::fs::read_to_string(&path).unwrap())
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            // Links are symmetric: i lists j as often as j lists i.
            for (i, gpu) in config.gpus.iter().enumerate() {
                for &j in &gpu.nvlinks {
                    let there = config.gpus[j as usize]
                        .nvlinks
                        .iter()
                        .filter(|&&k| k as usize == i)
                        .count();
                    let here = gpu.nvlinks.iter().filter(|&&k| k == j).count();
                    assert_eq!(here, there, "{}: links {i}-{j}", path.display());
                }
            }
            names.push(path.file_name().unwrap().to_string_lossy().into_owned());
        }
        names.sort();
        assert_eq!(
            names,
            [
                "a100-mig.yaml",
                "dgx-h100.yaml",
                "dgx1-v100.yaml",
                "pcie-4gpu.yaml"
            ]
        );
    }

    #[test]
    fn pci_info_splits_the_bus_id() {
        let info = pci_info("00000000:3B:00.0");
        assert_eq!((info.domain, info.bus, info.device), (0, 0x3b, 0));
        let text = unsafe { CStr::from_ptr(info.busId.as_ptr()) };
        assert_eq!(text.to_str().unwrap(), "00000000:3B:00.0");
    }

    #[test]
    fn too_many_links_or_a_missing_peer_are_refused() {
        let many = format!(
            "gpus:\n  - {{uuid: GPU-a, name: x, memory_mib: 1, bus_id: '00000000:01:00.0', nvlinks: [{}]}}\n",
            ["0"; 19].join(",")
        );
        assert!(Config::parse(&many).unwrap_err().contains("at most 18"));
        let missing = "gpus:\n  - {uuid: GPU-a, name: x, memory_mib: 1, bus_id: '00000000:01:00.0', nvlinks: [3]}\n";
        assert!(Config::parse(missing).unwrap_err().contains("no GPU 3"));
    }

    #[test]
    fn mig_devices_need_mig_on_and_fit_in_seven_slots() {
        let one = "{uuid: MIG-a, gi: 7, slices: 1, memory_mib: 4864}";
        let off = format!(
            "gpus:\n  - {{uuid: GPU-a, name: x, memory_mib: 1, bus_id: '00000000:01:00.0', mig: false, mig_devices: [{one}]}}\n"
        );
        assert!(Config::parse(&off)
            .unwrap_err()
            .contains("without mig: true"));
        let eight = format!(
            "gpus:\n  - {{uuid: GPU-a, name: x, memory_mib: 1, bus_id: '00000000:01:00.0', mig: true, mig_layouts: {{big: [{}]}}}}\n",
            [one; 8].join(",")
        );
        assert!(Config::parse(&eight).unwrap_err().contains("at most 7"));
        let ok = format!(
            "gpus:\n  - {{uuid: GPU-a, name: x, memory_mib: 1, bus_id: '00000000:01:00.0', mig: true, mig_devices: [{one}]}}\n"
        );
        let config = Config::parse(&ok).unwrap();
        assert_eq!(config.gpus[0].mig_devices[0].ci_slices, None);
    }
}
