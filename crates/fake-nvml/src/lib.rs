//! A fake `libnvidia-ml.so.1`: the NVML C functions that `nvml-wrapper` calls, answering from a
//! YAML topology instead of a GPU, so tests and demos run devplug's real NVML loading path
//! (dlopen, symbol lookup, init, events) on a machine without NVIDIA hardware.
//!
//! **Why `unsafe` is allowed here and nowhere else in the workspace:** this crate *is* a C
//! library. NVML's ABI hands us raw out-pointers (`unsigned int *count`, `char *name`,
//! `nvmlEventData_t *data`) and the exported functions must be `#[no_mangle] extern "C"`; writing
//! through those pointers cannot be done in safe Rust. Every `unsafe` block of this crate (in
//! `abi`, and one in `device`, `nvmlDeviceGetHandleByUUID`'s) only writes one value of the
//! caller's declared type through a pointer the caller passed, after a null check, reads one
//! such value (an in/out count, a placement), writes a bounded string into a buffer of the
//! caller's stated length, or writes a bounded list (placements, instance handles) into an
//! array the caller sized as NVML's contract says. The rest of devplug talks to this library
//! through `nvml-wrapper`'s safe API, exactly as it talks to the real one.
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
//! | `xid <gpu> <code> [action] [gi=<id>] [ci=<id>]` | a critical XID event; `action` sets the GPU recovery action; `gi=`/`ci=` fill the event's `gpuInstanceId`/`computeInstanceId` (else `0xFFFFFFFF`: not attributed to an instance) |
//! | `ecc <gpu> [action]` | a double-bit ECC event; `action` sets the GPU recovery action |
//! | `action <gpu> <n>` | sets the GPU recovery action (field 230) and sends its event (0x8000) |
//! | `lost <gpu>` | the GPU falls off the bus: its calls fail `GPU_IS_LOST`, waits fail once |
//! | `found <gpu>` | the GPU answers again |
//! | `events broken` | event waits and registrations fail with `UNKNOWN` (a sick driver) |
//! | `events ok` | they work again |
//! | `mig <gpu> <layout>` | MIG on with the devices of `mig_layouts.<layout>`; sends `nvmlEventMigConfigChange` (0x100) |
//! | `mig <gpu> off` | MIG off; sends the same event |
//!
//! **A broken driver.** While the file the config names in `broken_while` exists (relative
//! paths as `control`), NVML fails as after a driver upgrade without a reboot: `nvmlInit` with
//! `LIB_RM_VERSION_MISMATCH`, every other call (event waits too) with `UNKNOWN`. Removing the
//! file mends it.
//!
//! **Counting inits.** If the config names an `init_log` file (relative paths as `control`),
//! every successful `nvmlInit` appends one line to it, so a test can tell how often NVML was
//! opened.
//!
//! **MIG.** A GPU with `mig: true` is in MIG mode with `mig_devices` (UUID, GPU- and
//! compute-instance ids, slice counts, memory). Their handles answer UUID, name, memory,
//! attributes (slices and memory, for the profile name), the is-MIG query, the parent handle and
//! the GI/CI ids; `nvmlDeviceGetMaxMigDeviceCount` is 7 and empty slots answer `NOT_FOUND`.
//! `mig: false` is MIG-capable but off; without `mig` the GPU answers `NOT_SUPPORTED`.
//!
//! **MIG instances at run time.** A MIG-capable GPU may list `mig_profiles` (GPU-instance
//! profiles: `id`, `slices`, `memory_mib`, `multiprocessors` (default 14 per slice), and
//! `placements` in memory slices), with `compute_slices` (default: the most slices of a
//! profile) and `memory_slices` (default: the furthest placement end); see
//! `topologies/a100-partitions.yaml`. Then these work as on an A100:
//!
//! | function | answer |
//! |---|---|
//! | `nvmlDeviceGetGpuInstanceProfileInfo`, `…InfoV` | the profile, MIG on or off; engine counts as an A100's |
//! | `nvmlDeviceGetGpuInstancePossiblePlacements_v2` | all its placements, taken or not, MIG on or off |
//! | `nvmlDeviceCreateGpuInstanceWithPlacement` | MIG on; one of the profile's placements; its memory slices free and the compute slices enough, else `INSUFFICIENT_RESOURCES`; GI id the lowest free from 1 |
//! | `nvmlDeviceGetGpuInstances`, `nvmlDeviceGetGpuInstanceById` | the created GPU instances |
//! | `nvmlGpuInstanceGetInfo` | parent GPU handle, id, profile, placement |
//! | `nvmlGpuInstanceGetComputeInstanceProfileInfo` | compute profiles 0-7 (1, 2, 3, 4, 7, 8, 6, 1 slices) up to the GI's slices, shared engine profile only |
//! | `nvmlGpuInstanceCreateComputeInstance` | the first free compute slices of the GI; CI id the lowest free from 0; a MIG device appears in the first free slot |
//! | `nvmlGpuInstanceGetComputeInstances`, `nvmlComputeInstanceGetInfo_v2` | the GI's compute instances; placement in compute slices |
//! | `nvmlComputeInstanceDestroy` | its MIG device leaves its slot (a hole, `NOT_FOUND`) |
//! | `nvmlGpuInstanceDestroy` | `IN_USE` while it has compute instances |
//!
//! Each create and destroy sends `nvmlEventMigConfigChange`. The MIG device of a compute
//! instance answers like a static one (name from the GI's slices and memory, attributes with
//! the CI's slices, GI/CI ids) with a UUID `MIG-d<gpu>-<gi>-4<ci>-8…-<n>` from the GPU's
//! creation count `n`, so a re-created instance has a new UUID. Instance handles encode the
//! GPU, the ids and that count, apart from device and MIG handles (see `gi_handle`); a destroyed
//! instance's handle answers `INVALID_ARGUMENT`. The static `mig_devices` (and layouts) hold
//! their GPU instances' compute slices, and with `start` their placement's memory slices too;
//! they have no instance handles, so they are neither listed nor destroyable here. A `mig`
//! control line drops the created instances with the old layout. Created instances outlive
//! the last `nvmlShutdown` of the process, as on a GPU: the next `nvmlInit` takes them back
//! (by GPU UUID) if MIG is on and they still fit the topology it reads.
//!
//! `<gpu>` is an index or a UUID. Events reach only the event sets that registered the GPU for
//! that event type, as in NVML.

mod abi;
mod config;
mod control;
mod device;
mod events;
mod instances;
mod mig;
mod state;
mod system;
#[cfg(test)]
mod tests;

pub use config::{Config, GpuConfig, MigDeviceConfig, MigProfileConfig, PlacementConfig};
pub use device::*;
pub use events::*;
pub use instances::*;
pub use mig::*;
pub use system::*;
