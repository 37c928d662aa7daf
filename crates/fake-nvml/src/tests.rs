//! The exported functions called in-process: MIG instances created, listed and destroyed,
//! their MIG devices and events, and what outlives `nvmlShutdown`.

#![allow(clippy::unwrap_used)]
use crate::abi::*;
use crate::config::Config;
use crate::state::{kept, lock, with_state, State};
use crate::*;
use nvml_wrapper_sys::bindings::*;
use std::collections::BTreeSet;
use std::ffi::{c_char, c_uint, CStr};
use std::sync::{Mutex, MutexGuard};

// The extern functions, called in-process. They share the library's global state, so each
// test holds `SERIAL` while it installs its own topology and uses it.

static SERIAL: Mutex<()> = Mutex::new(());
const PARTITIONS: &str = include_str!("../topologies/a100-partitions.yaml");

/// Installs `yaml` as an initialised state with nothing kept from earlier tests.
fn install(yaml: &str) -> MutexGuard<'static, ()> {
    let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    kept().clear();
    reload(yaml);
    guard
}

/// As `nvmlInit` with `yaml` as the topology (takes back what the last shutdown kept).
fn reload(yaml: &str) {
    let mut state = State::new(Config::parse(yaml).unwrap(), None, 0);
    state.users = 1;
    *lock() = Some(state);
}

fn gpu(i: u32) -> nvmlDevice_t {
    let mut d = std::ptr::null_mut();
    assert_eq!(nvmlDeviceGetHandleByIndex_v2(i, &mut d), SUCCESS);
    d
}

fn place(start: u32, size: u32) -> nvmlGpuInstancePlacement_t {
    nvmlGpuInstancePlacement_t { start, size }
}

fn create_gi(
    dev: nvmlDevice_t,
    profile: u32,
    start: u32,
    size: u32,
) -> Result<nvmlGpuInstance_t, nvmlReturn_t> {
    let mut gi = std::ptr::null_mut();
    match nvmlDeviceCreateGpuInstanceWithPlacement(dev, profile, &place(start, size), &mut gi) {
        SUCCESS => Ok(gi),
        code => Err(code),
    }
}

fn create_ci(gi: nvmlGpuInstance_t, profile: u32) -> Result<nvmlComputeInstance_t, nvmlReturn_t> {
    let mut ci = std::ptr::null_mut();
    match nvmlGpuInstanceCreateComputeInstance(gi, profile, &mut ci) {
        SUCCESS => Ok(ci),
        code => Err(code),
    }
}

fn text(f: impl FnOnce(*mut c_char, c_uint) -> nvmlReturn_t) -> String {
    let mut buf = [0 as c_char; 96];
    assert_eq!(f(buf.as_mut_ptr(), 96), SUCCESS);
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_str()
        .unwrap()
        .to_owned()
}

/// The MIG devices in the GPU's slots: (UUID, GI id, CI id, name).
fn mig_devices(dev: nvmlDevice_t) -> Vec<(String, u32, u32, String)> {
    let mut out = Vec::new();
    for slot in 0..MAX_MIG_DEVICES {
        let mut mig = std::ptr::null_mut();
        match nvmlDeviceGetMigDeviceHandleByIndex(dev, slot, &mut mig) {
            SUCCESS => {}
            NOT_FOUND => continue,
            code => panic!("slot {slot}: {code}"),
        }
        let (mut gi, mut ci) = (0, 0);
        assert_eq!(nvmlDeviceGetGpuInstanceId(mig, &mut gi), SUCCESS);
        assert_eq!(nvmlDeviceGetComputeInstanceId(mig, &mut ci), SUCCESS);
        let uuid = text(|b, l| nvmlDeviceGetUUID(mig, b, l));
        let name = text(|b, l| nvmlDeviceGetName(mig, b, l));
        out.push((uuid, gi, ci, name));
    }
    out
}

fn is_mig_uuid(uuid: &str) -> bool {
    let parts: Vec<&str> = uuid.split('-').collect();
    let hex = |p: &str| p.chars().all(|c| c.is_ascii_hexdigit());
    parts.len() == 6
        && parts[0] == "MIG"
        && [8, 4, 4, 4, 12]
            .iter()
            .zip(&parts[1..])
            .all(|(&n, p)| p.len() == n && hex(p))
        && parts[3].starts_with('4')
        && parts[4].starts_with('8')
}

#[test]
fn profiles_and_placements_answer_from_the_config() {
    let _serial = install(PARTITIONS);
    let dev = gpu(0);
    let mut info: nvmlGpuInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
    assert_eq!(
        nvmlDeviceGetGpuInstanceProfileInfo(dev, 4, &mut info),
        SUCCESS
    );
    assert_eq!(
        (
            info.id,
            info.sliceCount,
            info.instanceCount,
            info.multiprocessorCount
        ),
        (4, 7, 1, 98)
    );
    assert_eq!((info.memorySizeMB, info.copyEngineCount), (40192, 7));
    assert_eq!(
        nvmlDeviceGetGpuInstanceProfileInfo(dev, 0, &mut info),
        SUCCESS
    );
    assert_eq!(
        (info.sliceCount, info.instanceCount, info.memorySizeMB),
        (1, 7, 4864)
    );
    // Not an A100 40GB profile; beyond NVML's ids.
    assert_eq!(
        nvmlDeviceGetGpuInstanceProfileInfo(dev, 5, &mut info),
        NOT_SUPPORTED
    );
    assert_eq!(
        nvmlDeviceGetGpuInstanceProfileInfo(dev, 17, &mut info),
        INVALID_ARGUMENT
    );
    let mut v2: nvmlGpuInstanceProfileInfo_v2_t = unsafe { std::mem::zeroed() };
    assert_eq!(
        nvmlDeviceGetGpuInstanceProfileInfoV(dev, 7, &mut v2),
        SUCCESS
    );
    let name = unsafe { CStr::from_ptr(v2.name.as_ptr()) };
    assert_eq!((name.to_str().unwrap(), v2.sliceCount), ("MIG 1g.10gb", 1));

    // The count query, too small an array, then the list.
    let mut count = 0;
    let none = std::ptr::null_mut();
    assert_eq!(
        nvmlDeviceGetGpuInstancePossiblePlacements_v2(dev, 0, none, &mut count),
        SUCCESS
    );
    assert_eq!(count, 7);
    let mut list = [place(99, 99); 7];
    count = 3;
    assert_eq!(
        nvmlDeviceGetGpuInstancePossiblePlacements_v2(dev, 0, list.as_mut_ptr(), &mut count),
        INSUFFICIENT_SIZE
    );
    assert_eq!((count, list[0].start), (7, 99));
    count = 7;
    assert_eq!(
        nvmlDeviceGetGpuInstancePossiblePlacements_v2(dev, 2, list.as_mut_ptr(), &mut count),
        SUCCESS
    );
    assert_eq!(count, 2);
    let got: Vec<(u32, u32)> = list[..2].iter().map(|p| (p.start, p.size)).collect();
    assert_eq!(got, [(0, 4), (4, 4)]);
    assert_eq!(
        nvmlDeviceGetGpuInstancePossiblePlacements_v2(dev, 5, none, &mut count),
        NOT_SUPPORTED
    );

    // MIG capable but off: profiles and placements answer, creating does not. No MIG:
    // NOT_SUPPORTED.
    let yaml = PARTITIONS.replacen("mig: true", "mig: false", 1);
    drop(_serial);
    let _serial = install(&yaml);
    let dev = gpu(0);
    assert_eq!(
        nvmlDeviceGetGpuInstanceProfileInfo(dev, 1, &mut info),
        SUCCESS
    );
    assert_eq!(
        nvmlDeviceGetGpuInstancePossiblePlacements_v2(dev, 1, none, &mut count),
        SUCCESS
    );
    assert_eq!(count, 3);
    assert_eq!(create_gi(dev, 1, 0, 2), Err(NOT_SUPPORTED));
    assert!(create_gi(gpu(1), 1, 0, 2).is_ok());
    drop(_serial);
    let _serial =
        install("gpus:\n  - {uuid: GPU-a, name: x, memory_mib: 1, bus_id: '00000000:01:00.0'}\n");
    assert_eq!(
        nvmlDeviceGetGpuInstanceProfileInfo(gpu(0), 0, &mut info),
        NOT_SUPPORTED
    );
    assert_eq!(
        nvmlDeviceGetGpuInstancePossiblePlacements_v2(gpu(0), 0, none, &mut count),
        NOT_SUPPORTED
    );
}

#[test]
fn gpu_instances_may_not_overlap_in_memory_or_exceed_the_compute_slices() {
    let _serial = install(PARTITIONS);
    let dev = gpu(0);
    let one = create_gi(dev, 0, 0, 1).unwrap();
    // 2g.10gb at 0 covers memory slice 0; 7g.40gb needs the whole GPU.
    assert_eq!(create_gi(dev, 1, 0, 2), Err(INSUFFICIENT_RESOURCES));
    assert_eq!(create_gi(dev, 4, 0, 8), Err(INSUFFICIENT_RESOURCES));
    // Not one of 2g.10gb's placements.
    assert_eq!(create_gi(dev, 1, 1, 2), Err(INVALID_ARGUMENT));
    assert_eq!(create_gi(dev, 1, 0, 1), Err(INVALID_ARGUMENT));
    let two = create_gi(dev, 1, 2, 2).unwrap();
    let mut info: nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
    assert_eq!(nvmlGpuInstanceGetInfo(one, &mut info), SUCCESS);
    assert_eq!((info.device, info.id, info.profileId), (dev, 1, 0));
    assert_eq!(nvmlGpuInstanceGetInfo(two, &mut info), SUCCESS);
    assert_eq!((info.id, info.profileId), (2, 1));
    assert_eq!((info.placement.start, info.placement.size), (2, 2));
    // 3g at 4: 1 + 2 + 3 = 6 compute slices; a second 3g does not fit memory, a 1g at
    // memory slice 1 is the seventh compute slice.
    let three = create_gi(dev, 2, 4, 4).unwrap();
    assert_eq!(create_gi(dev, 2, 0, 4), Err(INSUFFICIENT_RESOURCES));
    let last = create_gi(dev, 0, 1, 1).unwrap();
    // Lists and ids.
    let mut list = [std::ptr::null_mut(); 7];
    let mut count = 0;
    assert_eq!(
        nvmlDeviceGetGpuInstances(dev, 0, list.as_mut_ptr(), &mut count),
        SUCCESS
    );
    assert_eq!(&list[..count as usize], [one, last]);
    assert_eq!(
        nvmlDeviceGetGpuInstances(dev, 0, std::ptr::null_mut(), &mut count),
        INVALID_ARGUMENT
    );
    let mut found = std::ptr::null_mut();
    assert_eq!(nvmlDeviceGetGpuInstanceById(dev, 3, &mut found), SUCCESS);
    assert_eq!(found, three);
    assert_eq!(nvmlDeviceGetGpuInstanceById(dev, 9, &mut found), NOT_FOUND);
    // The other GPU is untouched; handles of the four kinds differ.
    assert!(create_gi(gpu(1), 4, 0, 8).is_ok());
    let kinds = [dev as usize, one as usize, gpu(1) as usize];
    assert_eq!(kinds.iter().collect::<BTreeSet<_>>().len(), 3);

    // Compute slices run out while memory is free: a static 4g device without `start`
    // holds 4 compute slices and no memory.
    let yaml = PARTITIONS.replacen(
        "    compute_slices: 7\n",
        "    compute_slices: 7\n    mig_devices: [{uuid: MIG-s, gi: 1, slices: 4, memory_mib: 19968}]\n",
        1,
    );
    drop(_serial);
    let _serial = install(&yaml);
    let dev = gpu(0);
    let big = create_gi(dev, 2, 4, 4).unwrap();
    let mut info: nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
    assert_eq!(nvmlGpuInstanceGetInfo(big, &mut info), SUCCESS);
    assert_eq!(info.id, 2, "the static device's GI id 1 is taken");
    assert_eq!(create_gi(dev, 0, 0, 1), Err(INSUFFICIENT_RESOURCES));
    assert_eq!(nvmlGpuInstanceDestroy(big), SUCCESS);
    assert!(create_gi(dev, 0, 0, 1).is_ok());
    // With `start: 0` it holds memory slices 0-3 as well.
    let yaml = yaml.replace("memory_mib: 19968}]", "memory_mib: 19968, start: 0}]");
    drop(_serial);
    let _serial = install(&yaml);
    assert_eq!(create_gi(gpu(0), 0, 3, 1), Err(INSUFFICIENT_RESOURCES));
    let kept = create_gi(gpu(0), 0, 4, 1).unwrap();
    // A `mig` control line: the layout replaces the created instances.
    assert_eq!(
        with_state(|s| s.apply("mig 0 off").map_err(|_| UNKNOWN)),
        SUCCESS
    );
    let mut count = 0;
    let mut list = [std::ptr::null_mut(); 7];
    assert_eq!(
        nvmlDeviceGetGpuInstances(gpu(0), 0, list.as_mut_ptr(), &mut count),
        NOT_SUPPORTED
    );
    let mut info: nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
    assert_eq!(nvmlGpuInstanceGetInfo(kept, &mut info), INVALID_ARGUMENT);
}

#[test]
fn compute_instances_make_mig_devices_and_block_their_gpu_instance() {
    let _serial = install(PARTITIONS);
    let dev = gpu(0);
    assert!(mig_devices(dev).is_empty());
    let gi = create_gi(dev, 2, 4, 4).unwrap();
    let mut info: nvmlComputeInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
    assert_eq!(
        nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 2, 0, &mut info),
        SUCCESS
    );
    assert_eq!(
        (
            info.sliceCount,
            info.instanceCount,
            info.multiprocessorCount
        ),
        (3, 1, 42)
    );
    assert_eq!(
        nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 0, 0, &mut info),
        SUCCESS
    );
    assert_eq!((info.sliceCount, info.instanceCount), (1, 3));
    assert_eq!(
        nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 3, 0, &mut info),
        NOT_SUPPORTED
    );
    assert_eq!(
        nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 2, 1, &mut info),
        NOT_SUPPORTED
    );
    assert_eq!(
        nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 8, 0, &mut info),
        INVALID_ARGUMENT
    );

    let ci = create_ci(gi, 2).unwrap();
    let devices = mig_devices(dev);
    assert_eq!(devices.len(), 1);
    let (uuid, gi_id, ci_id, name) = devices[0].clone();
    assert!(is_mig_uuid(&uuid), "{uuid}");
    assert_eq!((gi_id, ci_id), (1, 0));
    assert_eq!(name, "NVIDIA A100-SXM4-40GB MIG 3g.20gb");
    let mut mig = std::ptr::null_mut();
    assert_eq!(
        nvmlDeviceGetMigDeviceHandleByIndex(dev, 0, &mut mig),
        SUCCESS
    );
    let mut attrs: nvmlDeviceAttributes_t = unsafe { std::mem::zeroed() };
    assert_eq!(nvmlDeviceGetAttributes_v2(mig, &mut attrs), SUCCESS);
    assert_eq!(
        (
            attrs.gpuInstanceSliceCount,
            attrs.computeInstanceSliceCount,
            attrs.memorySizeMB
        ),
        (3, 3, 19968)
    );
    let mut parent = std::ptr::null_mut();
    assert_eq!(
        nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig, &mut parent),
        SUCCESS
    );
    assert_eq!(parent, dev);
    let mut ci_info: nvmlComputeInstanceInfo_t = unsafe { std::mem::zeroed() };
    assert_eq!(nvmlComputeInstanceGetInfo_v2(ci, &mut ci_info), SUCCESS);
    assert_eq!(
        (
            ci_info.device,
            ci_info.gpuInstance,
            ci_info.id,
            ci_info.profileId
        ),
        (dev, gi, 0, 2)
    );
    assert_eq!((ci_info.placement.start, ci_info.placement.size), (0, 3));
    // The GI's compute slices are all taken.
    assert_eq!(create_ci(gi, 0), Err(INSUFFICIENT_RESOURCES));
    let mut list = [std::ptr::null_mut(); 1];
    let mut count = 0;
    assert_eq!(
        nvmlGpuInstanceGetComputeInstances(gi, 2, list.as_mut_ptr(), &mut count),
        SUCCESS
    );
    assert_eq!((count, list[0]), (1, ci));

    // Not while it has a compute instance; then the CI, then the GI.
    assert_eq!(nvmlGpuInstanceDestroy(gi), IN_USE);
    assert_eq!(nvmlComputeInstanceDestroy(ci), SUCCESS);
    assert!(mig_devices(dev).is_empty());
    assert_eq!(nvmlComputeInstanceDestroy(ci), INVALID_ARGUMENT);
    assert_eq!(
        nvmlComputeInstanceGetInfo_v2(ci, &mut ci_info),
        INVALID_ARGUMENT
    );
    assert_eq!(nvmlGpuInstanceDestroy(gi), SUCCESS);
    assert_eq!(nvmlGpuInstanceDestroy(gi), INVALID_ARGUMENT);
    let mut found = std::ptr::null_mut();
    assert_eq!(nvmlDeviceGetGpuInstanceById(dev, 1, &mut found), NOT_FOUND);

    // Re-created with the same ids: new handles, a new UUID.
    let again = create_gi(dev, 2, 4, 4).unwrap();
    assert_ne!(again, gi);
    let ci_again = create_ci(again, 2).unwrap();
    assert_ne!(ci_again, ci);
    // The old handles do not name the new instances.
    let mut gi_info: nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
    assert_eq!(nvmlGpuInstanceGetInfo(gi, &mut gi_info), INVALID_ARGUMENT);
    assert_eq!(
        nvmlComputeInstanceGetInfo_v2(ci, &mut ci_info),
        INVALID_ARGUMENT
    );
    assert_eq!(nvmlGpuInstanceGetInfo(again, &mut gi_info), SUCCESS);
    let devices = mig_devices(dev);
    assert_eq!(devices.len(), 1);
    assert_eq!((devices[0].1, devices[0].2), (1, 0));
    assert!(is_mig_uuid(&devices[0].0));
    assert_ne!(devices[0].0, uuid);

    // Several compute instances in a 7g GPU instance (on the other GPU): 4 + 2 + 1, then
    // nothing; one destroyed leaves a hole in the slots that the next one fills.
    let whole = create_gi(gpu(1), 4, 0, 8).unwrap();
    let four = create_ci(whole, 3).unwrap();
    let two = create_ci(whole, 1).unwrap();
    let one = create_ci(whole, 0).unwrap();
    assert_eq!(create_ci(whole, 0), Err(INSUFFICIENT_RESOURCES));
    let ids: Vec<(u32, u32)> = mig_devices(gpu(1)).iter().map(|d| (d.1, d.2)).collect();
    assert_eq!(ids, [(1, 0), (1, 1), (1, 2)]);
    assert_eq!(nvmlComputeInstanceGetInfo_v2(one, &mut ci_info), SUCCESS);
    assert_eq!((ci_info.placement.start, ci_info.placement.size), (6, 1));
    assert_eq!(nvmlComputeInstanceDestroy(two), SUCCESS);
    assert_eq!(
        nvmlDeviceGetMigDeviceHandleByIndex(gpu(1), 1, &mut mig),
        NOT_FOUND
    );
    let two_again = create_ci(whole, 1).unwrap();
    let ids: Vec<(u32, u32)> = mig_devices(gpu(1)).iter().map(|d| (d.1, d.2)).collect();
    assert_eq!(ids, [(1, 0), (1, 1), (1, 2)]);
    for ci in [four, two_again, one] {
        assert_eq!(nvmlComputeInstanceDestroy(ci), SUCCESS);
    }
    assert_eq!(nvmlGpuInstanceDestroy(whole), SUCCESS);
    assert!(mig_devices(gpu(1)).is_empty());
}

#[test]
fn xid_lines_carry_the_instance_ids_they_name_and_none_otherwise() {
    let _serial = install(PARTITIONS);
    let mut set = std::ptr::null_mut();
    assert_eq!(nvmlEventSetCreate(&mut set), SUCCESS);
    assert_eq!(nvmlDeviceRegisterEvents(gpu(0), EVENT_XID, set), SUCCESS);
    let apply = |line: &str| lock().as_mut().unwrap().apply(line);
    let mut data: nvmlEventData_t = unsafe { std::mem::zeroed() };
    apply("xid 0 79 1 gi=9 ci=0").unwrap();
    assert_eq!(nvmlEventSetWait_v2(set, &mut data, 0), SUCCESS);
    assert_eq!(
        (data.eventData, data.gpuInstanceId, data.computeInstanceId),
        (79, 9, 0)
    );
    assert_eq!(lock().as_ref().unwrap().gpus[0].recovery_action, 1);
    // The ids go anywhere after the code; without them, not attributed.
    apply("xid 0 48 gi=3 2").unwrap();
    assert_eq!(nvmlEventSetWait_v2(set, &mut data, 0), SUCCESS);
    assert_eq!((data.gpuInstanceId, data.computeInstanceId), (3, u32::MAX));
    assert_eq!(lock().as_ref().unwrap().gpus[0].recovery_action, 2);
    apply("xid 0 13").unwrap();
    assert_eq!(nvmlEventSetWait_v2(set, &mut data, 0), SUCCESS);
    assert_eq!(
        (data.eventData, data.gpuInstanceId, data.computeInstanceId),
        (13, u32::MAX, u32::MAX)
    );
    assert!(apply("xid 0 13 gi=x").is_err());
    assert!(apply("xid 0 13 1 2").is_err());
    assert_eq!(nvmlEventSetWait_v2(set, &mut data, 0), TIMEOUT);
}

#[test]
fn creating_and_destroying_send_the_mig_event_to_the_gpu_registered() {
    let _serial = install(PARTITIONS);
    let mut set = std::ptr::null_mut();
    assert_eq!(nvmlEventSetCreate(&mut set), SUCCESS);
    assert_eq!(nvmlDeviceRegisterEvents(gpu(0), EVENT_MIG, set), SUCCESS);
    let mut data: nvmlEventData_t = unsafe { std::mem::zeroed() };
    let gi = create_gi(gpu(1), 0, 0, 1).unwrap();
    assert_eq!(nvmlGpuInstanceDestroy(gi), SUCCESS);
    assert_eq!(nvmlEventSetWait_v2(set, &mut data, 0), TIMEOUT);
    let gi = create_gi(gpu(0), 0, 0, 1).unwrap();
    let ci = create_ci(gi, 0).unwrap();
    assert_eq!(nvmlComputeInstanceDestroy(ci), SUCCESS);
    assert_eq!(nvmlGpuInstanceDestroy(gi), SUCCESS);
    for _ in 0..4 {
        assert_eq!(nvmlEventSetWait_v2(set, &mut data, 0), SUCCESS);
        assert_eq!((data.device, data.eventType), (gpu(0), EVENT_MIG));
    }
    assert_eq!(nvmlEventSetWait_v2(set, &mut data, 0), TIMEOUT);
}

#[test]
fn created_instances_outlive_shutdown_and_init() {
    let _serial = install(PARTITIONS);
    let gi = create_gi(gpu(0), 1, 2, 2).unwrap();
    create_ci(gi, 1).unwrap();
    let before = mig_devices(gpu(0));
    assert_eq!(nvmlShutdown(), SUCCESS);
    assert_eq!(nvmlGpuInstanceDestroy(gi), UNINITIALIZED);
    reload(PARTITIONS);
    assert_eq!(mig_devices(gpu(0)), before);
    let mut found = std::ptr::null_mut();
    assert_eq!(nvmlDeviceGetGpuInstanceById(gpu(0), 1, &mut found), SUCCESS);
    assert_eq!(found, gi);
    assert_eq!(create_gi(gpu(0), 1, 2, 2), Err(INSUFFICIENT_RESOURCES));
    // The creation count goes on: the next UUID is new.
    let other = create_gi(gpu(0), 1, 4, 2).unwrap();
    create_ci(other, 1).unwrap();
    let uuids: BTreeSet<String> = mig_devices(gpu(0)).into_iter().map(|d| d.0).collect();
    assert_eq!(uuids.len(), 2);
    // Reloaded with MIG off, they are gone.
    assert_eq!(nvmlShutdown(), SUCCESS);
    reload(&PARTITIONS.replacen("mig: true", "mig: false", 1));
    let mut count = 0;
    let mut list = [std::ptr::null_mut(); 3];
    assert_eq!(
        nvmlDeviceGetGpuInstances(gpu(0), 1, list.as_mut_ptr(), &mut count),
        NOT_SUPPORTED
    );
    assert_eq!(nvmlShutdown(), SUCCESS);
    reload(PARTITIONS);
    assert!(mig_devices(gpu(0)).is_empty());
}

#[test]
fn static_mig_devices_still_answer_as_before() {
    let _serial = install(include_str!("../topologies/a100-mig.yaml"));
    let devices = mig_devices(gpu(0));
    let ids: Vec<(u32, u32)> = devices.iter().map(|d| (d.1, d.2)).collect();
    assert_eq!(ids, [(2, 0), (3, 0), (9, 0), (10, 0)]);
    assert_eq!(devices[0].0, "MIG-a1000000-0000-4000-8000-000000000000");
    let mut mig = std::ptr::null_mut();
    assert_eq!(
        nvmlDeviceGetMigDeviceHandleByIndex(gpu(0), 4, &mut mig),
        NOT_FOUND
    );
    assert_eq!(
        nvmlDeviceGetMigDeviceHandleByIndex(gpu(2), 0, &mut mig),
        NOT_FOUND
    );
    // No mig_profiles here: no instances to create.
    let mut info: nvmlGpuInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
    assert_eq!(
        nvmlDeviceGetGpuInstanceProfileInfo(gpu(0), 0, &mut info),
        NOT_SUPPORTED
    );
    assert_eq!(
        with_state(|s| s.apply("mig 2 all-1g").map_err(|_| UNKNOWN)),
        SUCCESS
    );
    assert_eq!(mig_devices(gpu(2)).len(), 7);
}

#[test]
fn a_broken_driver_fails_every_call_and_init_until_mended() {
    let _serial = install(PARTITIONS);
    let dir = tempfile::tempdir().unwrap();
    let flag = dir.path().join("broken");
    if let Some(state) = lock().as_mut() {
        state.broken_while = Some(flag.clone());
    }
    let mut count = 0;
    assert_eq!(nvmlDeviceGetCount_v2(&mut count), SUCCESS);
    std::fs::write(&flag, "").unwrap();
    assert_eq!(nvmlDeviceGetCount_v2(&mut count), UNKNOWN);
    // A second init while broken fails and leaves the first user's state as it was.
    assert_eq!(nvmlInit_v2(), LIB_RM_VERSION_MISMATCH);
    assert_eq!(lock().as_ref().map(|s| s.users), Some(1));
    std::fs::remove_file(&flag).unwrap();
    assert_eq!(nvmlDeviceGetCount_v2(&mut count), SUCCESS);
    assert_eq!(nvmlShutdown(), SUCCESS);
}
