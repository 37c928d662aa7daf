//! `devplug run` serving the `vfio`, `qat`, `ascend` and `fpga` backends from one config file,
//! on fake sysfs and /dev trees, through the kubelet simulator: each registers, allocates, and
//! recovers after its device goes away and comes back; a device on another driver is logged.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

mod support;

use devplug_testkit::fake_accelerators::{AscendNode, FpgaCard, QatCard};
use devplug_testkit::fake_sysfs::{scratch_dir, FakeSysfs, PciSpec};
use kubelet_sim::Kubelet;
use std::time::Duration;
use support::Devplug;

const WAIT: Duration = Duration::from_secs(10);
const AFU: &str = "d8424dc4a4a3c413f89e433683f9040b";

async fn capacity(kubelet: &Kubelet, resource: &str, want: (usize, usize)) {
    if kubelet
        .wait_for(WAIT, |n| (n.capacity(resource) == want).then_some(()))
        .await
        .is_err()
    {
        let now = kubelet.read(|n| n.capacity(resource));
        panic!("{resource}: wanted {want:?}, the kubelet has {now:?}");
    }
}

#[tokio::test]
async fn four_accelerator_backends_register_allocate_and_recover() {
    let tmp = tempfile::tempdir_in(scratch_dir()).unwrap();
    let tree = FakeSysfs::new(tmp.path()).unwrap();
    tree.load_vfio().unwrap();
    for (address, group, driver) in [
        ("0000:3b:00.0", 30, "vfio-pci"),
        ("0000:86:00.0", 31, "vfio-pci"),
        ("0000:d8:00.0", 32, "nvidia"),
    ] {
        let spec = PciSpec {
            address: address.into(),
            vendor: 0x10de,
            device: 0x2236,
            class: 0x030200,
            numa: 0,
            iommu_group: group,
        };
        if driver == "vfio-pci" {
            tree.vfio_device(&spec).unwrap();
        } else {
            tree.pci(&spec).unwrap();
            tree.bind(address, driver).unwrap();
        }
    }
    let qat = QatCard::gen4("0000:3d:00.0", 0, "dc", 100);
    qat.create(&tree).unwrap();
    qat.set_numvfs(&tree, 2).unwrap();
    AscendNode::ascend910(2).create(&tree).unwrap();
    FpgaCard {
        address: "0000:5e:00.0".into(),
        numa: 0,
        region: 0,
        interface_id: "ce48969398f05f33946d560708be108a".into(),
        ports: vec![(0, AFU.into())],
    }
    .create(&tree)
    .unwrap();

    let roots = format!(
        "sys_root: {}, dev_root: {}, cdi_dir: {}",
        tree.sys_root().display(),
        tree.dev_root().display(),
        tree.path("cdi").display()
    );
    let config = format!(
        "resources:
  - name: example.com/gpu-vm
    health_hold_down: 0s
    vfio: {{ pci: [ {{ vendor: 10de }} ], {roots} }}
  - name: qat.intel.com/dc
    health_hold_down: 0s
    qat: {{ service: dc, {roots} }}
  - name: huawei.com/Ascend910
    health_hold_down: 0s
    ascend: {{ {roots} }}
  - name: fpga.example.com/nlb0
    health_hold_down: 0s
    fpga: {{ afu_id: {AFU}, env: FPGA_PORTS, {roots} }}
"
    );
    let config_path = tmp.path().join("config.yaml");
    std::fs::write(&config_path, config).unwrap();
    let plugins = tmp.path().join("kubelet");
    let kubelet = Kubelet::start(&plugins).await.unwrap();
    let devplug = Devplug::run(&config_path, &plugins);

    capacity(&kubelet, "example.com/gpu-vm", (2, 2)).await;
    capacity(&kubelet, "qat.intel.com/dc", (2, 2)).await;
    capacity(&kubelet, "huawei.com/Ascend910", (2, 2)).await;
    capacity(&kubelet, "fpga.example.com/nlb0", (1, 1)).await;

    let vm = kubelet
        .allocate("vm", "compute", "example.com/gpu-vm", 2)
        .await
        .unwrap();
    assert_eq!(
        vm.env("PCI_RESOURCE_EXAMPLE_COM_GPU-VM"),
        Some("0000:3b:00.0,0000:86:00.0")
    );
    let zip = kubelet
        .allocate("pod", "zip", "qat.intel.com/dc", 1)
        .await
        .unwrap();
    assert_eq!(zip.env("QAT0"), Some("0000:3d:00.1"));
    let npu = kubelet
        .allocate("pod", "train", "huawei.com/Ascend910", 1)
        .await
        .unwrap();
    assert_eq!(npu.env("ASCEND_VISIBLE_DEVICES"), Some("0"));
    let fpga = kubelet
        .allocate("pod", "nlb", "fpga.example.com/nlb0", 1)
        .await
        .unwrap();
    assert_eq!(fpga.env("FPGA_PORTS"), Some("dfl-port.0"));

    // Each loses its device and gets it back.
    tree.unbind_vfio("0000:86:00.0", 31).unwrap();
    qat.set_numvfs(&tree, 0).unwrap();
    tree.remove("dev/davinci1").unwrap();
    tree.remove("dev/dfl-port.0").unwrap();
    capacity(&kubelet, "example.com/gpu-vm", (2, 1)).await;
    capacity(&kubelet, "qat.intel.com/dc", (0, 0)).await;
    capacity(&kubelet, "huawei.com/Ascend910", (2, 1)).await;
    capacity(&kubelet, "fpga.example.com/nlb0", (1, 0)).await;
    tree.bind_vfio("0000:86:00.0", 31).unwrap();
    qat.set_numvfs(&tree, 2).unwrap();
    tree.file("dev/davinci1", "").unwrap();
    tree.file("dev/dfl-port.0", "").unwrap();
    capacity(&kubelet, "example.com/gpu-vm", (2, 2)).await;
    capacity(&kubelet, "qat.intel.com/dc", (2, 2)).await;
    capacity(&kubelet, "huawei.com/Ascend910", (2, 2)).await;
    capacity(&kubelet, "fpga.example.com/nlb0", (1, 1)).await;

    let (status, log) = devplug.terminate(WAIT).await;
    assert!(status.success(), "{log}");
    assert!(
        log.contains("is bound to nvidia, not vfio-pci: not served"),
        "the GPU left on its driver is reported: {log}"
    );
}

/// `check-config --discover` on a backend that writes a CDI spec: the container's CDI device is
/// reported as `run` would give it, and the config's CDI folder is not created (the spec goes to
/// a scratch folder, removed before the command exits).
#[test]
fn check_config_discover_writes_no_cdi_spec_on_the_node() {
    let tmp = tempfile::tempdir_in(scratch_dir()).unwrap();
    let tree = FakeSysfs::new(tmp.path()).unwrap();
    AscendNode::ascend910(2).create(&tree).unwrap();
    let cdi = tree.path("cdi");
    let config = format!(
        "resources:\n  - name: huawei.com/Ascend910\n    ascend: {{ sys_root: {}, dev_root: {}, cdi_dir: {} }}\n",
        tree.sys_root().display(),
        tree.dev_root().display(),
        cdi.display()
    );
    let config_path = tmp.path().join("config.yaml");
    std::fs::write(&config_path, config).unwrap();
    let scratch = tempfile::tempdir_in(scratch_dir()).unwrap();
    let out = std::process::Command::new(support::BIN)
        .args(["check-config", "--discover", "--config"])
        .arg(&config_path)
        .env("TMPDIR", scratch.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("huawei.com/Ascend910: 2 devices, 2 healthy"),
        "{stdout}"
    );
    assert!(
        stdout.contains("    cdi "),
        "the spec was written: {stdout}"
    );
    assert!(!cdi.exists(), "check-config created {}", cdi.display());
    let left: Vec<_> = std::fs::read_dir(scratch.path()).unwrap().collect();
    assert!(left.is_empty(), "scratch folder left behind: {left:?}");
}
