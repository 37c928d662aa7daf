//! The `ascend` and `fpga` backends through the kubelet simulator over real Unix sockets, on
//! fake sysfs and /dev trees (an 8-NPU Ascend 910 node, a DFL FPGA card with two ports), with
//! real inotify: what a container gets, NUMA, and health that follows the device nodes.
#![allow(clippy::unwrap_used)] // a panic in a test is a failed test

use devplug::Backend;
use devplug_backends::{ascend, fpga, AscendSettings, FpgaSettings};
use devplug_testkit::fake_accelerators::{AscendNode, FpgaCard};
use devplug_testkit::fake_sysfs::{scratch_dir, FakeSysfs};
use std::sync::Arc;

mod support;

const NPU: &str = "huawei.com/Ascend910";
const AFU: &str = "d8424dc4a4a3c413f89e433683f9040b";
const OTHER_AFU: &str = "f7df405cbd7acf7222f144b0b93acd18";
const INTERFACE: &str = "ce48969398f05f33946d560708be108a";

#[tokio::test]
async fn ascend_npus_with_shared_nodes_visible_devices_and_health_from_dev() {
    let tmp = tempfile::tempdir_in(scratch_dir()).unwrap();
    let tree = FakeSysfs::new(tmp.path()).unwrap();
    AscendNode::ascend910(8).create(&tree).unwrap();
    let settings = AscendSettings {
        sys_root: tree.sys_root(),
        dev_root: tree.dev_root(),
        cdi_dir: tree.path("cdi"),
        ..AscendSettings::default()
    };
    let backend: Arc<dyn Backend> = Arc::new(ascend::start(NPU, &settings).unwrap());
    let (kubelet, host) = support::serve(&tree.path("kubelet"), vec![(NPU, backend.clone())]).await;
    support::counts(&kubelet, NPU, 8, 8).await;
    let attributes = support::dra(&backend.devices().borrow(), "davinci5");
    assert_eq!(attributes["index"], "5");
    assert_eq!(attributes["chip"], "Ascend910");
    assert_eq!(
        attributes["resource.kubernetes.io/pciBusID"],
        "0000:c6:00.0"
    );

    // Two NPUs, preferred on one NUMA node.
    let two = kubelet.allocate("pod", "train", NPU, 2).await.unwrap();
    assert_eq!(two.device_ids, ["davinci0", "davinci1"]);
    assert_eq!(two.env("ASCEND_VISIBLE_DEVICES"), Some("0,1"));
    assert_eq!(
        support::container_paths(&two),
        [
            "/dev/davinci_manager",
            "/dev/devmm_svm",
            "/dev/hisi_hdc",
            "/dev/davinci0",
            "/dev/davinci1"
        ]
    );
    assert_eq!(
        two.response.cdi_devices[0].name,
        "huawei.com/Ascend910=davinci0"
    );

    // An NPU's node vanishes (reset): Unhealthy until it is back.
    tree.remove("dev/davinci3").unwrap();
    support::counts(&kubelet, NPU, 8, 7).await;
    let health = backend
        .devices()
        .borrow()
        .devices()
        .iter()
        .find(|d| d.id == "davinci3")
        .map(|d| d.health.to_string());
    assert_eq!(
        health.as_deref(),
        Some("Unhealthy (NPU davinci3 is gone from /dev)")
    );
    tree.file("dev/davinci3", "").unwrap();
    support::counts(&kubelet, NPU, 8, 8).await;
    // Without the manager node no NPU works.
    tree.remove("dev/davinci_manager").unwrap();
    support::counts(&kubelet, NPU, 8, 0).await;
    host.shutdown().await;
}

#[tokio::test]
async fn fpga_ports_by_afu_and_by_interface() {
    let tmp = tempfile::tempdir_in(scratch_dir()).unwrap();
    let tree = FakeSysfs::new(tmp.path()).unwrap();
    let card = FpgaCard {
        address: "0000:5e:00.0".into(),
        numa: 1,
        region: 0,
        interface_id: INTERFACE.into(),
        ports: vec![(0, AFU.into()), (1, OTHER_AFU.into())],
    };
    card.create(&tree).unwrap();
    let roots = |s: FpgaSettings| FpgaSettings {
        sys_root: tree.sys_root(),
        dev_root: tree.dev_root(),
        cdi_dir: tree.path("cdi"),
        env: Some("FPGA_PORTS".into()),
        ..s
    };
    let by_afu = roots(FpgaSettings::afu("D8424DC4-A4A3-C413-F89E-433683F9040B"));
    let by_interface = roots(FpgaSettings {
        afu_id: None,
        interface_id: Some(INTERFACE.into()),
        ..FpgaSettings::afu(AFU)
    });
    let afu: Arc<dyn Backend> = Arc::new(fpga::start("fpga.example.com/nlb0", &by_afu).unwrap());
    let region: Arc<dyn Backend> =
        Arc::new(fpga::start("fpga.example.com/region", &by_interface).unwrap());
    let (kubelet, host) = support::serve(
        &tree.path("kubelet"),
        vec![
            ("fpga.example.com/nlb0", afu.clone()),
            ("fpga.example.com/region", region),
        ],
    )
    .await;
    support::devices(
        &kubelet,
        "fpga.example.com/nlb0",
        &[("dfl-port.0", true, &[1])],
    )
    .await;
    support::counts(&kubelet, "fpga.example.com/region", 2, 2).await;
    let attributes = support::dra(&afu.devices().borrow(), "dfl-port.0");
    assert_eq!(attributes["afuID"], AFU);
    assert_eq!(attributes["interfaceID"], INTERFACE);
    assert_eq!(
        attributes["resource.kubernetes.io/pciBusID"],
        "0000:5e:00.0"
    );

    let one = kubelet
        .allocate("pod", "main", "fpga.example.com/nlb0", 1)
        .await
        .unwrap();
    assert_eq!(support::container_paths(&one), ["/dev/dfl-port.0"]);
    assert_eq!(one.env("FPGA_PORTS"), Some("dfl-port.0"));

    // Port 0 is reprogrammed with the other AFU, and its node goes and comes back as the
    // driver re-creates the port: the AFU resource lists it Unhealthy, saying why.
    card.set_afu(&tree, 0, OTHER_AFU).unwrap();
    tree.remove("dev/dfl-port.0").unwrap();
    tree.file("dev/dfl-port.0", "").unwrap();
    support::counts(&kubelet, "fpga.example.com/nlb0", 1, 0).await;
    let health = afu.devices().borrow().devices()[0].health.to_string();
    assert!(
        health.contains(&format!("now carries AFU {OTHER_AFU}")),
        "{health}"
    );
    host.shutdown().await;
}
