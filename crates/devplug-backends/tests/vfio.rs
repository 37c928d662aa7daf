//! The `vfio` and `qat` backends through the kubelet simulator over real Unix sockets, on fake
//! sysfs and /dev trees (GPUs and an audio function bound to `vfio-pci`, a group shared with
//! a device still on its host driver, QAT cards whose VFs come and go with `sriov_numvfs`),
//! with real inotify.
#![allow(clippy::unwrap_used)] // a panic in a test is a failed test

use devplug::{Backend, Host};
use devplug_backends::hostdev::PciMatch;
use devplug_backends::vfio::{self, QatService, VfioEnv};
use devplug_backends::{QatSettings, VfioSettings};
use devplug_testkit::fake_accelerators::QatCard;
use devplug_testkit::fake_sysfs::{scratch_dir, FakeSysfs, PciSpec};
use kubelet_sim::Kubelet;
use std::sync::Arc;

mod support;

const NVIDIA: u32 = 0x10de;

fn pci(address: &str, vendor: u32, device: u32, class: u32, numa: i64, group: u32) -> PciSpec {
    PciSpec {
        address: address.into(),
        vendor,
        device,
        class,
        numa,
        iommu_group: group,
    }
}

fn vfio_settings(tree: &FakeSysfs, vendor: &str) -> VfioSettings {
    VfioSettings {
        sys_root: tree.sys_root(),
        dev_root: tree.dev_root(),
        cdi_dir: tree.path("cdi"),
        ..VfioSettings::new(vec![PciMatch {
            vendor: Some(vendor.into()),
            class: Some("03".into()),
            ..Default::default()
        }])
    }
}

fn qat_settings(tree: &FakeSysfs, service: QatService) -> QatSettings {
    QatSettings {
        service,
        sys_root: tree.sys_root(),
        dev_root: tree.dev_root(),
        cdi_dir: tree.path("cdi"),
        ..QatSettings::default()
    }
}

async fn serve(tree: &FakeSysfs, backends: Vec<(&str, Arc<dyn Backend>)>) -> (Kubelet, Host) {
    support::serve(&tree.path("kubelet/device-plugins"), backends).await
}

/// Waits until the backend's own list says `id` is unhealthy for `reason`.
async fn reason(backend: &Arc<dyn Backend>, id: &str, reason: &str) {
    let mut rx = backend.devices();
    let found = tokio::time::timeout(
        support::WAIT,
        rx.wait_for(|list| {
            list.devices()
                .iter()
                .any(|d| d.id == id && d.health.to_string().contains(reason))
        }),
    )
    .await
    .is_ok_and(|r| r.is_ok());
    if !found {
        panic!("{id}: no {reason:?} in {:?}", *backend.devices().borrow());
    }
}

#[tokio::test]
async fn gpus_for_vms_one_device_per_iommu_group_with_kubevirt_env_and_cdi() {
    let tmp = tempfile::tempdir_in(scratch_dir()).unwrap();
    let tree = FakeSysfs::new(tmp.path()).unwrap();
    tree.load_vfio().unwrap();
    // GPU A and its audio function share group 30; GPU B is alone in 31; GPU C shares group
    // 32 with a NIC still on its host driver; GPU D is on the nvidia driver.
    tree.vfio_device(&pci("0000:3b:00.0", NVIDIA, 0x2236, 0x030200, 0, 30))
        .unwrap();
    tree.vfio_device(&pci("0000:3b:00.1", NVIDIA, 0x1aef, 0x040300, 0, 30))
        .unwrap();
    tree.vfio_device(&pci("0000:86:00.0", NVIDIA, 0x2236, 0x030200, 1, 31))
        .unwrap();
    tree.vfio_device(&pci("0000:af:00.0", NVIDIA, 0x2236, 0x030200, 1, 32))
        .unwrap();
    tree.pci(&pci("0000:af:00.1", 0x8086, 0x1572, 0x020000, 1, 32))
        .unwrap();
    tree.bind("0000:af:00.1", "i40e").unwrap();
    tree.pci(&pci("0000:d8:00.0", NVIDIA, 0x2236, 0x030200, 1, 33))
        .unwrap();
    tree.bind("0000:d8:00.0", "nvidia").unwrap();

    const RESOURCE: &str = "nvidia.com/GA102GL_A10";
    let backend: Arc<dyn Backend> =
        Arc::new(vfio::start(RESOURCE, &vfio_settings(&tree, "10de")).unwrap());
    let (kubelet, host) = serve(&tree, vec![(RESOURCE, backend.clone())]).await;
    support::devices(
        &kubelet,
        RESOURCE,
        &[
            ("0000:3b:00.0", true, &[0]),
            ("0000:86:00.0", true, &[1]),
            ("0000:af:00.0", false, &[1]),
        ],
    )
    .await;
    reason(
        &backend,
        "0000:af:00.0",
        "also holds 0000:af:00.1, bound to i40e",
    )
    .await;
    let attributes = support::dra(&backend.devices().borrow(), "0000:3b:00.0");
    assert_eq!(attributes["iommuGroup"], "30");
    assert_eq!(attributes["vendorID"], "10de");
    assert_eq!(
        attributes["resource.kubernetes.io/pciBusID"],
        "0000:3b:00.0"
    );

    let one = kubelet
        .allocate("vm", "compute", RESOURCE, 1)
        .await
        .unwrap();
    assert_eq!(one.device_ids, ["0000:3b:00.0"]);
    assert_eq!(
        support::container_paths(&one),
        ["/dev/vfio/vfio", "/dev/vfio/30"]
    );
    assert_eq!(
        one.env("PCI_RESOURCE_NVIDIA_COM_GA102GL_A10"),
        Some("0000:3b:00.0,0000:3b:00.1"),
        "every function of the group"
    );
    assert_eq!(
        one.response
            .cdi_devices
            .iter()
            .map(|c| c.name.as_str())
            .collect::<Vec<_>>(),
        ["nvidia.com/GA102GL_A10=0000:3b:00.0"]
    );
    let spec =
        std::fs::read_to_string(tree.path("cdi/devplug-nvidia.com_GA102GL_A10.json")).unwrap();
    assert!(spec.contains("/dev/vfio/31"), "{spec}");
    assert!(spec.contains("/dev/vfio/vfio"), "{spec}");

    // The NIC leaves its host driver: GPU C's group opens.
    tree.remove("sys/devices/pci0000:00/0000:af:00.1/driver")
        .unwrap();
    tree.remove("sys/bus/pci/drivers/i40e/0000:af:00.1")
        .unwrap();
    support::counts(&kubelet, RESOURCE, 3, 3).await;
    // GPU B goes back to the nvidia driver: reported, not taken.
    tree.unbind_vfio("0000:86:00.0", 31).unwrap();
    tree.bind("0000:86:00.0", "nvidia").unwrap();
    support::counts(&kubelet, RESOURCE, 3, 2).await;
    reason(&backend, "0000:86:00.0", "is bound to nvidia, not vfio-pci").await;
    // Back on vfio-pci: healthy again.
    tree.bind_vfio("0000:86:00.0", 31).unwrap();
    support::counts(&kubelet, RESOURCE, 3, 3).await;
    host.shutdown().await;
}

#[tokio::test]
async fn numbered_env_no_iommu_group_and_missing_container_node() {
    let tmp = tempfile::tempdir_in(scratch_dir()).unwrap();
    let tree = FakeSysfs::new(tmp.path()).unwrap();
    std::fs::create_dir_all(tree.path("sys/bus/pci/drivers/vfio-pci")).unwrap();
    tree.vfio_device(&pci("0000:3b:00.0", NVIDIA, 0x2236, 0x030200, 0, 30))
        .unwrap();
    tree.vfio_device(&pci("0000:86:00.0", NVIDIA, 0x2236, 0x030200, 0, 31))
        .unwrap();
    tree.remove("sys/devices/pci0000:00/0000:86:00.0/iommu_group")
        .unwrap();
    let settings = VfioSettings {
        env: VfioEnv::Numbered,
        env_prefix: Some("GPU".into()),
        cdi: false,
        ..vfio_settings(&tree, "10de")
    };
    let backend: Arc<dyn Backend> = Arc::new(vfio::start("example.com/gpu", &settings).unwrap());
    let (kubelet, host) = serve(&tree, vec![("example.com/gpu", backend.clone())]).await;
    support::counts(&kubelet, "example.com/gpu", 2, 0).await;
    reason(&backend, "0000:86:00.0", "has no IOMMU group").await;
    reason(&backend, "0000:3b:00.0", "/dev/vfio/vfio missing").await;
    tree.file("dev/vfio/vfio", "").unwrap();
    support::counts(&kubelet, "example.com/gpu", 2, 1).await;
    let one = kubelet
        .allocate("pod", "main", "example.com/gpu", 1)
        .await
        .unwrap();
    assert_eq!(one.env("GPU0"), Some("0000:3b:00.0"));
    assert!(one.response.cdi_devices.is_empty(), "cdi: false");
    host.shutdown().await;
}

#[tokio::test]
async fn qat_vfs_by_service_follow_sriov_numvfs() {
    let tmp = tempfile::tempdir_in(scratch_dir()).unwrap();
    let tree = FakeSysfs::new(tmp.path()).unwrap();
    tree.load_vfio().unwrap();
    let cy = QatCard::gen4("0000:3d:00.0", 0, "sym;asym", 100);
    let dc = QatCard::gen4("0000:3f:00.0", 1, "dc", 120);
    let gen2 = QatCard::c62x("0000:b1:00.0", 1, 140);
    for card in [&cy, &dc, &gen2] {
        card.create(&tree).unwrap();
    }
    cy.set_numvfs(&tree, 2).unwrap();
    gen2.set_numvfs(&tree, 1).unwrap();
    let start = |name: &str, service| -> (String, Arc<dyn Backend>) {
        let backend = vfio::start_qat(name, &qat_settings(&tree, service)).unwrap();
        (name.to_owned(), Arc::new(backend))
    };
    let started = [
        start("qat.intel.com/cy", QatService::Cy),
        start("qat.intel.com/dc", QatService::Dc),
        start("qat.intel.com/generic", QatService::Generic),
    ];
    let (kubelet, host) = serve(
        &tree,
        started
            .iter()
            .map(|(n, b)| (n.as_str(), b.clone()))
            .collect(),
    )
    .await;
    support::devices(
        &kubelet,
        "qat.intel.com/cy",
        &[("0000:3d:00.1", true, &[0]), ("0000:3d:00.2", true, &[0])],
    )
    .await;
    support::devices(
        &kubelet,
        "qat.intel.com/generic",
        &[("0000:b1:00.1", true, &[1])],
    )
    .await;
    support::counts(&kubelet, "qat.intel.com/dc", 0, 0).await;
    let attributes = support::dra(&started[0].1.devices().borrow(), "0000:3d:00.1");
    assert_eq!(attributes["service"], "cy");
    assert_eq!(attributes["generation"], "4xxx");

    // VFs enabled on the dc card: they appear, by events.
    dc.set_numvfs(&tree, 4).unwrap();
    support::counts(&kubelet, "qat.intel.com/dc", 4, 4).await;
    let two = kubelet
        .allocate("pod", "zip", "qat.intel.com/dc", 2)
        .await
        .unwrap();
    assert_eq!(two.device_ids, ["0000:3f:00.1", "0000:3f:00.2"]);
    assert_eq!(two.env("QAT0"), Some("0000:3f:00.1"));
    assert_eq!(two.env("QAT1"), Some("0000:3f:00.2"));
    assert_eq!(two.env("QAT2"), None);
    assert_eq!(
        support::container_paths(&two),
        ["/dev/vfio/vfio", "/dev/vfio/120", "/dev/vfio/121"]
    );

    // Fewer VFs: the others were configured away, not lost, so they are dropped.
    dc.set_numvfs(&tree, 1).unwrap();
    support::devices(
        &kubelet,
        "qat.intel.com/dc",
        &[("0000:3f:00.1", true, &[1])],
    )
    .await;
    host.shutdown().await;
}
