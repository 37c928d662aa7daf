//! The amdgpu backend through the kubelet simulator over real Unix sockets, on fake sysfs and
//! /dev trees (an MI300X-like node with XGMI and CPX partitions, a node whose driver loads
//! after start, a mixed-partition node), with real inotify; the node labels it describes the
//! node with.
#![allow(clippy::unwrap_used)] // a panic in a test is a failed test

use devplug::{Backend, Host};
use devplug_backends::NodeLabelSource;
use devplug_backends::{AmdgpuBackend, AmdgpuSettings};
use devplug_testkit::fake_sysfs::{pci_dir, scratch_dir, AmdNode, FakeSysfs};
use kubelet_sim::Kubelet;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

mod support;

use support::WAIT;

fn settings(tree: &FakeSysfs) -> AmdgpuSettings {
    AmdgpuSettings {
        sys_root: tree.sys_root(),
        dev_root: tree.dev_root(),
        cdi_dir: tree.path("cdi"),
        ..Default::default()
    }
}

async fn serve(tree: &FakeSysfs, resources: Vec<(&str, AmdgpuSettings)>) -> (Kubelet, Host) {
    let backends = resources
        .into_iter()
        .map(|(name, settings)| {
            let backend: Arc<dyn Backend> = Arc::new(AmdgpuBackend::start(&settings).unwrap());
            (name, backend)
        })
        .collect();
    support::serve(&tree.path("kubelet/device-plugins"), backends).await
}

/// Waits until the kubelet has `healthy` healthy devices out of `total`.
async fn counts(kubelet: &Kubelet, resource: &str, total: usize, healthy: usize) {
    support::counts(kubelet, resource, total, healthy).await;
}

fn host_paths(alloc: &kubelet_sim::Allocation, root: &Path) -> Vec<String> {
    let root = root.display().to_string();
    alloc
        .response
        .devices
        .iter()
        .map(|d| {
            assert_eq!(d.permissions, "rw");
            assert_eq!(
                d.host_path
                    .strip_prefix(&root)
                    .unwrap()
                    .trim_start_matches("/dev"),
                d.container_path.trim_start_matches("/dev"),
            );
            d.container_path.clone()
        })
        .collect()
}

#[tokio::test]
async fn mi300x_partitions_numa_preferred_allocation_and_cdi() {
    let tmp = tempfile::tempdir_in(scratch_dir()).unwrap();
    let tree = FakeSysfs::new(tmp.path()).unwrap();
    let node = AmdNode::mi300x();
    node.create(&tree).unwrap();
    node.load_driver(&tree).unwrap();
    let (kubelet, host) = serve(&tree, vec![("amd.com/gpu", settings(&tree))]).await;
    counts(&kubelet, "amd.com/gpu", 64, 64).await;
    kubelet.read(|n| {
        let devices = n.resource("amd.com/gpu").unwrap().devices();
        assert_eq!(devices["0000:0c:00.0"].numa_nodes, [0]);
        assert_eq!(devices["amdgpu_xcp_56"].numa_nodes, [1]);
    });

    // 8 partitions: all of one GPU (same-GPU links beat XGMI).
    let first = kubelet
        .allocate("pod-a", "main", "amd.com/gpu", 8)
        .await
        .unwrap();
    let mut want: Vec<String> = vec!["0000:0c:00.0".into()];
    want.extend((1..8).map(|k| format!("amdgpu_xcp_{k}")));
    assert_eq!(first.device_ids, want);
    let paths = host_paths(&first, tmp.path());
    assert_eq!(paths[0], "/dev/kfd", "/dev/kfd once");
    assert_eq!(paths.iter().filter(|p| *p == "/dev/kfd").count(), 1);
    assert_eq!(paths.len(), 1 + 16);
    assert_eq!(paths[1..3], ["/dev/dri/card1", "/dev/dri/renderD128"]);
    let cdi: Vec<&str> = first
        .response
        .cdi_devices
        .iter()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(cdi[0], "amd.com/gpu=0000:0c:00.0");
    assert_eq!(cdi.len(), 8);
    let spec = std::fs::read_to_string(tree.path("cdi/devplug-amd.com_gpu.json")).unwrap();
    assert!(spec.contains("\"kind\": \"amd.com/gpu\""));
    assert_eq!(spec.matches("\"name\":").count(), 64);

    // 12 more: one whole GPU plus 4 of a second, both on one NUMA node. NUMA 0 and NUMA 1
    // score the same here; ties go to the earlier devices, so NUMA 0.
    let second = kubelet
        .allocate("pod-b", "main", "amd.com/gpu", 12)
        .await
        .unwrap();
    let gpus: std::collections::BTreeSet<usize> = second
        .device_ids
        .iter()
        .map(|id| node.partitions().iter().find(|p| &p.id == id).unwrap().gpu)
        .collect();
    assert_eq!(gpus.len(), 2, "{:?}", second.device_ids);
    let numa: std::collections::BTreeSet<i64> = gpus.iter().map(|&g| node.gpus[g].numa).collect();
    assert_eq!(numa.len(), 1, "{gpus:?}");
    assert!(
        numa.contains(&0),
        "the tie goes to the earlier devices: {gpus:?}"
    );
    host.shutdown().await;
}

/// Node labels as AMD's labeller writes them, from sysfs and KFD, once the driver loads.
#[tokio::test]
async fn node_labels_follow_the_driver_as_amds_labeller_names_them() {
    let tmp = tempfile::tempdir_in(scratch_dir()).unwrap();
    let tree = FakeSysfs::new(tmp.path()).unwrap();
    let node = AmdNode::mi300x();
    node.create(&tree).unwrap();
    let backend = AmdgpuBackend::start(&settings(&tree)).unwrap();
    let mut labels = backend.node_labels();
    assert!(
        labels.borrow().is_empty(),
        "no GPU bound yet: {:?}",
        *labels.borrow()
    );
    node.load_driver(&tree).unwrap();
    let got = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        labels.wait_for(|l| !l.is_empty()),
    )
    .await
    .expect("labels once the driver loads")
    .unwrap()
    .clone();
    let want: devplug_backends::NodeLabels = [
        ("compute-memory-partition", "cpx_nps4"),
        ("cu-count", "76"),
        ("device-id", "74a1"),
        (
            "driver-version",
            devplug_testkit::fake_sysfs::AMDGPU_VERSION,
        ),
        ("product-name", "AMD-Instinct-MI300X"),
        ("simd-count", "304"),
        ("vram", "48G"),
    ]
    .into_iter()
    .map(|(k, v)| (format!("amd.com/gpu.{k}"), v.to_owned()))
    .collect();
    assert_eq!(got, want);
}

/// DRA attributes: a partition carries its GPU's PCI identity and partition mode.
#[tokio::test]
async fn dra_attributes_of_gpus_and_partitions() {
    use support::{dra, map};
    let tmp = tempfile::tempdir_in(scratch_dir()).unwrap();
    let tree = FakeSysfs::new(tmp.path()).unwrap();
    let node = AmdNode::mi300x();
    node.create(&tree).unwrap();
    node.load_driver(&tree).unwrap();
    let backend = AmdgpuBackend::start(&settings(&tree)).unwrap();
    let list = backend.devices().borrow().clone();
    let gpu = map(&[
        ("deviceID", "74a1"),
        ("partition", "cpx_nps4"),
        ("resource.kubernetes.io/pciBusID", "0000:0c:00.0"),
        ("resource.kubernetes.io/pcieRoot", "pci0000:00"),
    ]);
    assert_eq!(dra(&list, "0000:0c:00.0"), gpu);
    assert_eq!(
        dra(&list, "amdgpu_xcp_7"),
        gpu,
        "partitions of the first GPU"
    );
    assert_eq!(
        dra(&list, "amdgpu_xcp_8")["resource.kubernetes.io/pciBusID"],
        "0000:1c:00.0"
    );
}

#[tokio::test]
async fn driver_loading_after_start_is_picked_up_and_vanishing_nodes_turn_unhealthy() {
    let tmp = tempfile::tempdir_in(scratch_dir()).unwrap();
    let tree = FakeSysfs::new(tmp.path()).unwrap();
    let node = AmdNode::new(2, 1, "SPX", "NPS1", true);
    node.create(&tree).unwrap(); // PCI devices only: amdgpu not loaded
    let (kubelet, host) = serve(&tree, vec![("amd.com/gpu", settings(&tree))]).await;
    kubelet
        .wait_for(WAIT, |n| {
            let r = n.resource("amd.com/gpu")?;
            (r.is_connected() && r.updates() >= 1).then_some(())
        })
        .await
        .unwrap();
    assert_eq!(kubelet.read(|n| n.capacity("amd.com/gpu")), (0, 0));
    assert!(
        !tree.path("cdi/devplug-amd.com_gpu.json").exists(),
        "no devices, no spec"
    );

    node.load_driver(&tree).unwrap();
    counts(&kubelet, "amd.com/gpu", 2, 2).await;
    assert!(tree.path("cdi/devplug-amd.com_gpu.json").exists());

    // A render node vanishes: that GPU is Unhealthy, and healthy again when it is back.
    std::fs::remove_file(tree.path("dev/dri/renderD129")).unwrap();
    counts(&kubelet, "amd.com/gpu", 2, 1).await;
    assert!(!kubelet.read(|n| n.resource("amd.com/gpu").unwrap().devices()["0000:1c:00.0"].healthy));
    tree.file("dev/dri/renderD129", "").unwrap();
    counts(&kubelet, "amd.com/gpu", 2, 2).await;

    // The GPU is unbound from amdgpu (its DRM nodes go too): kept, Unhealthy; back on rebind.
    let gpu = "0000:1c:00.0";
    tree.remove(&format!("sys/bus/pci/drivers/amdgpu/{gpu}"))
        .unwrap();
    tree.remove(&format!("sys/{}/driver", pci_dir(gpu)))
        .unwrap();
    tree.remove_drm(&pci_dir(gpu), 2, 129).unwrap();
    counts(&kubelet, "amd.com/gpu", 2, 1).await;
    let err = kubelet
        .allocate("pod", "main", "amd.com/gpu", 2)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("Available: 1"), "{err}");
    tree.bind(gpu, "amdgpu").unwrap();
    tree.drm(&pci_dir(gpu), 2, 129).unwrap();
    counts(&kubelet, "amd.com/gpu", 2, 2).await;

    // /dev/kfd vanishing makes every GPU Unhealthy.
    std::fs::remove_file(tree.path("dev/kfd")).unwrap();
    counts(&kubelet, "amd.com/gpu", 2, 0).await;
    host.shutdown().await;
}

#[tokio::test]
async fn mixed_partition_types_are_one_resource_each() {
    let tmp = tempfile::tempdir_in(scratch_dir()).unwrap();
    let tree = FakeSysfs::new(tmp.path()).unwrap();
    let mut node = AmdNode::new(2, 8, "CPX", "NPS4", true);
    node.gpus[1].compute = Some("SPX".into());
    node.gpus[1].memory = Some("NPS1".into());
    node.gpus[1].partitions = 1;
    node.create(&tree).unwrap();
    node.load_driver(&tree).unwrap();
    let typed = |t: &str| AmdgpuSettings {
        partition_type: Some(t.into()),
        ..settings(&tree)
    };
    let (kubelet, host) = serve(
        &tree,
        vec![
            ("amd.com/cpx_nps4", typed("cpx_nps4")),
            ("amd.com/spx_nps1", typed("spx_nps1")),
        ],
    )
    .await;
    counts(&kubelet, "amd.com/cpx_nps4", 8, 8).await;
    counts(&kubelet, "amd.com/spx_nps1", 1, 1).await;
    let spx = kubelet
        .allocate("pod", "main", "amd.com/spx_nps1", 1)
        .await
        .unwrap();
    assert_eq!(spx.device_ids, ["0000:1c:00.0"]);
    assert!(tree.path("cdi/devplug-amd.com_gpu-cpx_nps4.json").exists());
    assert!(tree.path("cdi/devplug-amd.com_gpu-spx_nps1.json").exists());

    // GPU 1 is repartitioned to CPX (its nodes are made again): it moves to the other resource
    // and is dropped from this one, not kept as a vanished, Unhealthy GPU.
    let dir = pci_dir("0000:1c:00.0");
    tree.file(&format!("sys/{dir}/current_compute_partition"), "CPX\n")
        .unwrap();
    tree.file(&format!("sys/{dir}/current_memory_partition"), "NPS4\n")
        .unwrap();
    tree.remove_drm(&dir, 9, 136).unwrap();
    tree.drm(&dir, 9, 136).unwrap();
    counts(&kubelet, "amd.com/cpx_nps4", 9, 9).await;
    counts(&kubelet, "amd.com/spx_nps1", 0, 0).await;
    host.shutdown().await;
    drop(kubelet);
}

#[tokio::test]
async fn the_cdi_spec_goes_when_the_backend_stops() {
    let tmp = tempfile::tempdir_in(scratch_dir()).unwrap();
    let tree = FakeSysfs::new(tmp.path()).unwrap();
    let node = AmdNode::new(1, 1, "SPX", "NPS1", false);
    node.create(&tree).unwrap();
    node.load_driver(&tree).unwrap();
    let spec = tree.path("cdi/devplug-amd.com_gpu.json");
    let backend = AmdgpuBackend::start(&settings(&tree)).unwrap();
    assert!(spec.exists(), "written before the first list is published");
    drop(backend);
    for _ in 0..100 {
        if !spec.exists() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{} is still there", spec.display());
}

#[test]
fn bad_settings_name_the_field() {
    let bad = AmdgpuSettings {
        partition_type: Some("CPX".into()),
        ..Default::default()
    };
    assert_eq!(bad.validate().unwrap_err().field, "partition_type");
    let bad = AmdgpuSettings {
        cdi_dir: "cdi".into(),
        ..Default::default()
    };
    assert_eq!(bad.validate().unwrap_err().field, "cdi_dir");
    assert!(AmdgpuSettings::default().validate().is_ok());
}
