//! The intel-gpu backend through the kubelet simulator over real Unix sockets, on fake sysfs
//! and /dev trees (a 2-GPU node with i915 and xe, SR-IOV, GPUs that appear and vanish), with
//! real inotify.
#![allow(clippy::unwrap_used)] // a panic in a test is a failed test

use devplug::{Backend, Host};
use devplug_backends::hostdev::ReplicaPolicy;
use devplug_backends::intel_gpu::IntelDriver;
use devplug_backends::NodeLabelSource;
use devplug_backends::{IntelGpuBackend, IntelGpuSettings};
use devplug_testkit::fake_sysfs::{intel_pair, scratch_dir, FakeSysfs, IntelGpu};
use kubelet_sim::Kubelet;
use std::sync::Arc;

mod support;

use support::WAIT;

fn settings(tree: &FakeSysfs, driver: IntelDriver) -> IntelGpuSettings {
    IntelGpuSettings {
        driver,
        sys_root: tree.sys_root(),
        dev_root: tree.dev_root(),
        cdi_dir: tree.path("cdi"),
        ..Default::default()
    }
}

async fn serve(tree: &FakeSysfs, resources: Vec<(&str, IntelGpuSettings)>) -> (Kubelet, Host) {
    let backends = resources
        .into_iter()
        .map(|(name, settings)| {
            let backend: Arc<dyn Backend> = Arc::new(IntelGpuBackend::start(&settings).unwrap());
            (name, backend)
        })
        .collect();
    support::serve(&tree.path("kubelet/device-plugins"), backends).await
}

/// Waits until the kubelet lists exactly these (id, healthy, NUMA nodes).
async fn devices(kubelet: &Kubelet, resource: &str, want: &[(&str, bool, &[i64])]) {
    support::devices(kubelet, resource, want).await;
}

fn containers(alloc: &kubelet_sim::Allocation) -> (Vec<String>, Vec<(String, bool)>, Vec<String>) {
    let r = &alloc.response;
    (
        r.devices.iter().map(|d| d.container_path.clone()).collect(),
        r.mounts
            .iter()
            .map(|m| (m.container_path.clone(), m.read_only))
            .collect(),
        r.cdi_devices.iter().map(|c| c.name.clone()).collect(),
    )
}

#[tokio::test]
async fn i915_and_xe_gpus_with_shares_by_path_mounts_and_cdi() {
    let tmp = tempfile::tempdir_in(scratch_dir()).unwrap();
    let tree = FakeSysfs::new(tmp.path()).unwrap();
    for gpu in intel_pair() {
        gpu.create(&tree, true).unwrap();
    }
    let xe = IntelGpuSettings {
        count: 2,
        ..settings(&tree, IntelDriver::Xe)
    };
    let (kubelet, host) = serve(
        &tree,
        vec![
            ("gpu.intel.com/i915", settings(&tree, IntelDriver::I915)),
            ("gpu.intel.com/xe", xe),
        ],
    )
    .await;
    devices(&kubelet, "gpu.intel.com/i915", &[("card0", true, &[])]).await;
    devices(
        &kubelet,
        "gpu.intel.com/xe",
        &[("card1-0", true, &[0]), ("card1-1", true, &[0])],
    )
    .await;

    let i915 = kubelet
        .allocate("pod", "main", "gpu.intel.com/i915", 1)
        .await
        .unwrap();
    let (nodes, mounts, cdi) = containers(&i915);
    assert_eq!(nodes, ["/dev/dri/card0", "/dev/dri/renderD128"]);
    assert_eq!(
        mounts,
        [
            ("/dev/dri/by-path/pci-0000:00:02.0-card".to_owned(), true),
            ("/dev/dri/by-path/pci-0000:00:02.0-render".to_owned(), true)
        ]
    );
    assert_eq!(cdi, ["gpu.intel.com/i915=card0"]);
    assert!(i915.response.devices[0]
        .host_path
        .starts_with(&tmp.path().display().to_string()));

    // Two shares of one GPU: its nodes and CDI name once.
    let xe = kubelet
        .allocate("pod", "main", "gpu.intel.com/xe", 2)
        .await
        .unwrap();
    let (nodes, _, cdi) = containers(&xe);
    assert_eq!(nodes, ["/dev/dri/card1", "/dev/dri/renderD129"]);
    assert_eq!(cdi, ["gpu.intel.com/xe=card1"]);

    let spec = std::fs::read_to_string(tree.path("cdi/devplug-gpu.intel.com_xe.json")).unwrap();
    assert!(spec.contains("\"kind\": \"gpu.intel.com/xe\""), "{spec}");
    assert!(spec.contains("\"name\": \"card1\""));
    assert!(spec.contains("pci-0000:03:00.0-render"));
    assert!(tree.path("cdi/devplug-gpu.intel.com_i915.json").exists());
    host.shutdown().await;
}

#[tokio::test]
async fn shares_spread_or_pack_and_no_by_path_folder_means_no_mounts() {
    let tmp = tempfile::tempdir_in(scratch_dir()).unwrap();
    let tree = FakeSysfs::new(tmp.path()).unwrap();
    IntelGpu::new("0000:03:00.0", "xe", 0, 1)
        .create(&tree, false)
        .unwrap();
    IntelGpu::new("0000:83:00.0", "xe", 0, 2)
        .create(&tree, false)
        .unwrap();
    let shared = |policy| IntelGpuSettings {
        count: 2,
        policy,
        ..settings(&tree, IntelDriver::Xe)
    };
    let (kubelet, host) = serve(
        &tree,
        vec![
            ("gpu.intel.com/spread", shared(ReplicaPolicy::Spread)),
            ("gpu.intel.com/pack", shared(ReplicaPolicy::Pack)),
        ],
    )
    .await;
    for r in ["gpu.intel.com/spread", "gpu.intel.com/pack"] {
        kubelet
            .wait_for(WAIT, |n| (n.capacity(r) == (4, 4)).then_some(()))
            .await
            .unwrap();
    }
    let spread = kubelet
        .allocate("pod", "main", "gpu.intel.com/spread", 2)
        .await
        .unwrap();
    assert_eq!(spread.device_ids, ["card1-0", "card2-0"]);
    assert_eq!(spread.response.devices.len(), 4);
    assert!(
        spread.response.mounts.is_empty(),
        "no /dev/dri/by-path here"
    );
    let pack = kubelet
        .allocate("pod", "main", "gpu.intel.com/pack", 2)
        .await
        .unwrap();
    assert_eq!(pack.device_ids, ["card1-0", "card1-1"]);
    assert_eq!(pack.response.devices.len(), 2);
    host.shutdown().await;
}

#[tokio::test]
async fn sriov_pf_with_vfs_is_skipped_and_vfs_are_devices() {
    let tmp = tempfile::tempdir_in(scratch_dir()).unwrap();
    let tree = FakeSysfs::new(tmp.path()).unwrap();
    let mut pf = IntelGpu::new("0000:4d:00.0", "i915", 1, 0);
    pf.sriov_numvfs = 2;
    pf.create(&tree, true).unwrap();
    for (k, card) in [(1u32, 1u32), (2, 2)] {
        let mut vf = IntelGpu::new(&format!("0000:4d:00.{k}"), "i915", 1, card);
        vf.physfn = Some("0000:4d:00.0".into());
        vf.create(&tree, true).unwrap();
    }
    let (kubelet, host) = serve(
        &tree,
        vec![("gpu.intel.com/i915", settings(&tree, IntelDriver::I915))],
    )
    .await;
    devices(
        &kubelet,
        "gpu.intel.com/i915",
        &[("card1", true, &[1]), ("card2", true, &[1])],
    )
    .await;
    // VFs disabled: the PF is the device again.
    tree.file(&format!("sys/{}/sriov_numvfs", pf.dir()), "0\n")
        .unwrap();
    tree.remove_drm("devices/pci0000:00/0000:4d:00.1", 1, 129)
        .unwrap();
    tree.remove_drm("devices/pci0000:00/0000:4d:00.2", 2, 130)
        .unwrap();
    tree.remove("sys/bus/pci/devices/0000:4d:00.1").unwrap();
    tree.remove("sys/bus/pci/devices/0000:4d:00.2").unwrap();
    devices(
        &kubelet,
        "gpu.intel.com/i915",
        &[
            ("card0", true, &[1]),
            ("card1", false, &[1]),
            ("card2", false, &[1]),
        ],
    )
    .await;
    host.shutdown().await;
}

/// DRA attributes: PCI identity, card, whether it is a VF; shares carry their GPU's.
#[tokio::test]
async fn dra_attributes_of_gpus_vfs_and_shares() {
    use support::{dra, map};
    let tmp = tempfile::tempdir_in(scratch_dir()).unwrap();
    let tree = FakeSysfs::new(tmp.path()).unwrap();
    for gpu in intel_pair() {
        gpu.create(&tree, true).unwrap();
    }
    let mut vf = IntelGpu::new("0000:4d:00.1", "i915", 1, 2);
    vf.physfn = Some("0000:4d:00.0".into());
    vf.create(&tree, false).unwrap();
    let i915 = IntelGpuBackend::start(&settings(&tree, IntelDriver::I915)).unwrap();
    let list = i915.devices().borrow().clone();
    assert_eq!(
        dra(&list, "card0"),
        map(&[
            ("card", "card0"),
            ("deviceID", "56c0"),
            ("resource.kubernetes.io/pciBusID", "0000:00:02.0"),
            ("resource.kubernetes.io/pcieRoot", "pci0000:00"),
            ("sriovVF", "false"),
        ])
    );
    assert_eq!(dra(&list, "card2")["sriovVF"], "true");
    let xe = IntelGpuBackend::start(&IntelGpuSettings {
        count: 2,
        ..settings(&tree, IntelDriver::Xe)
    })
    .unwrap();
    let list = xe.devices().borrow().clone();
    assert_eq!(dra(&list, "card1-0"), dra(&list, "card1-1"));
    assert_eq!(
        dra(&list, "card1-1")["resource.kubernetes.io/pciBusID"],
        "0000:03:00.0"
    );
}

#[tokio::test]
async fn gpus_appear_vanish_and_recover_without_polling() {
    let tmp = tempfile::tempdir_in(scratch_dir()).unwrap();
    let tree = FakeSysfs::new(tmp.path()).unwrap();
    let (kubelet, host) = serve(
        &tree,
        vec![("gpu.intel.com/i915", settings(&tree, IntelDriver::I915))],
    )
    .await;
    kubelet
        .wait_for(WAIT, |n| {
            let r = n.resource("gpu.intel.com/i915")?;
            (r.is_connected() && r.updates() >= 1).then_some(())
        })
        .await
        .unwrap();
    assert_eq!(kubelet.read(|n| n.capacity("gpu.intel.com/i915")), (0, 0));

    // The driver binds after start (no /dev/dri yet either).
    let gpu = IntelGpu::new("0000:00:02.0", "i915", -1, 0);
    gpu.create(&tree, false).unwrap();
    devices(&kubelet, "gpu.intel.com/i915", &[("card0", true, &[])]).await;

    // Its render node vanishes, then comes back.
    std::fs::remove_file(tree.path("dev/dri/renderD128")).unwrap();
    devices(&kubelet, "gpu.intel.com/i915", &[("card0", false, &[])]).await;
    tree.file("dev/dri/renderD128", "").unwrap();
    devices(&kubelet, "gpu.intel.com/i915", &[("card0", true, &[])]).await;

    // The whole GPU goes (driver unbound: its DRM entries vanish): kept, Unhealthy.
    tree.remove_drm(&gpu.dir(), 0, 128).unwrap();
    tree.remove("sys/bus/pci/drivers/i915/0000:00:02.0")
        .unwrap();
    devices(&kubelet, "gpu.intel.com/i915", &[("card0", false, &[])]).await;
    gpu.create(&tree, false).unwrap();
    devices(&kubelet, "gpu.intel.com/i915", &[("card0", true, &[])]).await;
    host.shutdown().await;
}

#[test]
fn bad_settings_name_the_field() {
    let bad = IntelGpuSettings {
        count: 0,
        ..Default::default()
    };
    assert_eq!(bad.validate().unwrap_err().field, "count");
    let bad = IntelGpuSettings {
        sys_root: "sys".into(),
        ..Default::default()
    };
    assert_eq!(bad.validate().unwrap_err().field, "sys_root");
}

/// Node labels as the labeller of Intel's GPU plugin writes them, for the GPUs of the
/// resource's driver, following a GPU that goes.
#[tokio::test]
async fn node_labels_are_intels_and_follow_the_gpus() {
    let tmp = tempfile::tempdir_in(scratch_dir()).unwrap();
    let tree = FakeSysfs::new(tmp.path()).unwrap();
    let pair = intel_pair();
    for gpu in &pair {
        gpu.create(&tree, false).unwrap();
    }
    // The discrete GPU: two tiles of 16 GiB under xe.
    tree.file(
        "sys/class/drm/card1/lmem_total_bytes",
        &format!("{}\n", 16u64 << 30),
    )
    .unwrap();
    for tile in ["tile0", "tile1"] {
        tree.file(&format!("sys/{}/{tile}/.keep", pair[1].dir()), "")
            .unwrap();
    }
    let backend = IntelGpuBackend::start(&settings(&tree, IntelDriver::Xe)).unwrap();
    let mut labels = backend.node_labels();
    let want: devplug_backends::NodeLabels = [
        ("cards", "card1"),
        ("gpu-numbers", "1"),
        ("memory.max", "34359738368"),
        ("millicores", "1000"),
        ("numa-gpu-map", "0-1"),
        ("tiles", "2"),
    ]
    .into_iter()
    .map(|(k, v)| (format!("gpu.intel.com/{k}"), v.to_owned()))
    .collect();
    assert_eq!(*labels.borrow_and_update(), want);
    // The GPU unbound from xe: no labels.
    tree.remove(&format!("sys/{}/driver", pair[1].dir()))
        .unwrap();
    tree.remove(&format!("sys/bus/pci/drivers/xe/{}", pair[1].address))
        .unwrap();
    tokio::time::timeout(WAIT, labels.wait_for(|l| l.is_empty()))
        .await
        .expect("the labels follow the GPU")
        .unwrap();
}
