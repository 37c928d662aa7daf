//! MIG partitions scheduled for real and made at prepare: a real etcd, kube-apiserver and
//! kube-scheduler (1.36), devplug's DRA driver over the nvidia backend with
//! `mig_strategy: dynamic`, on NVML (the fake `libnvidia-ml.so` of crates/fake-nvml, loaded by
//! nvml-wrapper as the real one is) with two A100-40GB in MIG mode and no MIG device yet. Each
//! GPU is published as a counter set of 8 memory slices and 7 compute slices with its 18
//! profile placements consuming them. A claim for a 7g.40gb takes one GPU; two 3g.20gb go to
//! the other, one per half; a 1g.5gb then fits nowhere and stays unallocated. The kubelet
//! simulator prepares claims: the driver creates the GPU and compute instances in NVML and the
//! container's CDI edits carry the new MIG device; unprepare destroys them (the GPU takes a
//! partition the 7g overlapped afterwards). Skips loudly without `KUBEBUILDER_ASSETS`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use devplug_testkit::dra_node as common;

use devplug::dra::ClaimBackend;
use devplug::Backend;
use devplug_backends::nvidia::{sysfs_bus_id, MigStrategy, NvidiaBackend, NvidiaSettings};
use devplug_testkit::api_server::until;
use devplug_testkit::fake_sysfs::{scratch_dir, FakeSysfs, PciSpec};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use kubelet_sim::DraClaim;
use serde_json::json;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

const DRIVER: &str = "gpu.nvidia.example.com";
const NODE: &str = "dra-mig-node";
const NS: &str = "dra-mig";
/// The topology: two A100-SXM4-40GB in MIG mode, with their profiles and placements.
const TOPOLOGY: &str = "a100-partitions";

/// A node's GPU side: fake sysfs and /dev, `mig-minors`, and a driver root with the fake NVML.
fn gpu_node(root: &Path) -> (FakeSysfs, NvidiaSettings) {
    let tree = FakeSysfs::new(root).unwrap();
    let source = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fake-nvml/topologies")
        .join(format!("{TOPOLOGY}.yaml"));
    let text = std::fs::read_to_string(&source).unwrap();
    let topology: serde_json::Value = serde_saphyr::from_str(&text).unwrap();
    let gpus = topology["gpus"].as_array().unwrap();
    let mut minors = String::from("config 1\nmonitor 2\n");
    for (i, gpu) in gpus.iter().enumerate() {
        tree.pci(&PciSpec {
            address: sysfs_bus_id(gpu["bus_id"].as_str().unwrap()),
            vendor: 0x10de,
            device: 0x20b0,
            class: 0x030200,
            numa: 0,
            iommu_group: i as u32,
        })
        .unwrap();
        tree.file(&format!("dev/nvidia{i}"), "").unwrap();
        // The driver lists every GI and CI access node of every GPU when it loads.
        for gi in 0..15 {
            let base = 3 + i * 135 + gi * 9;
            minors.push_str(&format!("gpu{i}/gi{gi}/access {base}\n"));
            for ci in 0..8 {
                minors.push_str(&format!("gpu{i}/gi{gi}/ci{ci}/access {}\n", base + 1 + ci));
            }
        }
    }
    tree.file("dev/nvidiactl", "").unwrap();
    tree.file("proc/driver/nvidia-caps/mig-minors", &minors)
        .unwrap();
    let lib_dir = root.join("driver/usr/lib/x86_64-linux-gnu");
    std::fs::create_dir_all(&lib_dir).unwrap();
    std::fs::write(lib_dir.join("fake-nvml.yaml"), text).unwrap();
    let exe = std::env::current_exe().unwrap();
    let fake = exe.parent().unwrap().join("libfake_nvml.so");
    std::fs::copy(&fake, lib_dir.join("libnvidia-ml.so.1")).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (cargo builds it: fake-nvml is a dev-dependency)",
            fake.display()
        )
    });
    let settings = NvidiaSettings {
        driver_roots: vec![root.join("driver")],
        sys_root: tree.sys_root(),
        dev_root: tree.dev_root(),
        cdi_dir: tree.path("cdi"),
        proc_root: tree.path("proc"),
        mig_strategy: MigStrategy::Dynamic,
        ..Default::default()
    };
    (tree, settings)
}

/// The GPU (`gpu-<index>`) of a partition's device name.
fn gpu_of(device: &str) -> &str {
    device.split("-mig-").next().unwrap()
}

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scheduler_picks_mig_partitions_that_fit_and_prepare_makes_them() {
    let Some(client) = common::scheduled(
        "the_scheduler_picks_mig_partitions_that_fit_and_prepare_makes_them",
        NODE,
    )
    .await
    else {
        return;
    };
    let tmp = tempfile::tempdir_in(scratch_dir()).unwrap();
    let (_tree, settings) = gpu_node(tmp.path());
    let backend = Arc::new(NvidiaBackend::start("nvidia.com/gpu", &settings).unwrap());
    tokio::time::timeout(Duration::from_secs(20), backend.discovered())
        .await
        .unwrap();
    let dra = common::start(&client, NODE, DRIVER, backend.clone()).await;

    // The pool: both GPUs' counter sets, and their 36 partitions.
    let pool = common::pool(
        &client,
        NODE,
        DRIVER,
        "the pool's 36 partitions",
        |slices| {
            let devices: usize = slices
                .iter()
                .map(|s| s.spec.devices.iter().flatten().count())
                .sum();
            devices == 36
        },
    )
    .await;
    let mut sets: Vec<(String, usize)> = pool
        .iter()
        .flat_map(|s| s.spec.shared_counters.iter().flatten())
        .map(|set| (set.name.clone(), set.counters.len()))
        .collect();
    sets.sort();
    assert_eq!(sets, [("gpu-0".to_owned(), 9), ("gpu-1".to_owned(), 9)]);

    common::namespace(&client, NS).await;
    common::device_class(
        &client,
        "mig",
        &format!(
            "device.driver == \"{DRIVER}\" && device.attributes[\"{DRIVER}\"].type == \"mig\""
        ),
    )
    .await;
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), NS);
    let profile = |name: &'static str, profile: &str| {
        let exactly = json!({
            "deviceClassName": "mig",
            "selectors": [{ "cel": { "expression": format!("device.attributes[\"{DRIVER}\"].profile == \"{profile}\"") } }],
        });
        common::claim_and_pod(&client, NS, name, "mig", exactly)
    };
    let allocated = |name: &'static str| {
        let claims = claims.clone();
        async move {
            until(
                &format!("{name} allocated"),
                Duration::from_secs(60),
                || common::allocation(&claims, name),
            )
            .await
        }
    };
    // A whole-GPU partition, then two halves: they go to the other GPU, one per half.
    profile("seven", "7g.40gb").await;
    let seven = allocated("seven").await;
    profile("three-a", "3g.20gb").await;
    let a = allocated("three-a").await;
    profile("three-b", "3g.20gb").await;
    let b = allocated("three-b").await;
    let other = gpu_of(&seven.device);
    assert!(seven.device.ends_with("-mig-7g-40gb-0"), "{seven:?}");
    assert_ne!(gpu_of(&a.device), other, "{a:?} beside {seven:?}");
    assert_eq!(gpu_of(&a.device), gpu_of(&b.device));
    assert_ne!(a.device, b.device, "one per half");
    // Nothing is left for a 1g.5gb.
    profile("one", "1g.5gb").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        common::allocation(&claims, "one").await.is_none(),
        "both GPUs' memory slices are taken"
    );

    // The kubelet prepares the 7g and a 3g: NVML makes them, the CDI edits name them.
    let mut prepared = Vec::new();
    for name in ["seven", "three-a"] {
        let uid = claims.get(name).await.unwrap().metadata.uid.unwrap();
        let sim_claim = DraClaim::new(NS, name, &uid);
        let answer = dra
            .kubelet
            .dra_prepare(DRIVER, std::slice::from_ref(&sim_claim))
            .await
            .unwrap();
        answer[&uid].as_ref().unwrap();
        let spec_path = devplug_dra::prepare::spec_path(&dra.settings.cdi_dir, DRIVER, &uid);
        let spec: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&spec_path).unwrap()).unwrap();
        let edits = &spec["devices"][0]["containerEdits"];
        let env = edits["env"].to_string();
        assert!(env.contains("NVIDIA_VISIBLE_DEVICES=MIG-"), "{env}");
        let nodes = edits["deviceNodes"].to_string();
        assert_eq!(
            nodes
                .matches("\"path\":\"/dev/nvidia-caps/nvidia-cap")
                .count(),
            2,
            "the GI and CI access nodes: {nodes}"
        );
        prepared.push((sim_claim, uid));
    }
    // The 7g exists: a 1g.5gb on its GPU cannot be made beside it.
    let beside = vec![format!("{other}-mig-1g-5gb-0")];
    let err = backend.prepare_devices(&beside).unwrap_err().to_string();
    assert!(err.contains("insufficient resources"), "{err}");
    // Unprepared: NVML destroys it, and the GPU takes the 1g.5gb.
    let (seven_claim, seven_uid) = &prepared[0];
    let answer = dra
        .kubelet
        .dra_unprepare(DRIVER, std::slice::from_ref(seven_claim))
        .await
        .unwrap();
    assert!(answer[seven_uid].is_ok(), "{answer:?}");
    backend.prepare_devices(&beside).unwrap();
    backend.unprepare_devices(&beside).unwrap();
    assert!(dra.driver.shutdown().await.is_empty());
    dra.kubelet.stop().await;
}
