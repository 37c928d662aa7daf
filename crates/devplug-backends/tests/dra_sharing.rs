//! Devices shared by capacity, scheduled for real: a real etcd, kube-apiserver and
//! kube-scheduler (1.36), devplug's DRA driver publishing two virtual GPUs of 100 `cores` and
//! 16Gi `memory` each with `allowMultipleAllocations`, and four pods whose claims ask for 40, 40,
//! 40 and 70 cores. The scheduler packs the first three (two share one device, the third gets
//! the other) and leaves the fourth unallocated (20 and 60 cores are left). The kubelet
//! simulator prepares two shares of one device: each container's CDI edits carry the device and
//! what that share got. And partitions: one GPU of 4 slices published whole, in halves and in
//! quarters, consuming a shared counter set; the scheduler never gives out two that overlap.
//! Skips loudly without `KUBEBUILDER_ASSETS`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use devplug_testkit::dra_node as common;

use devplug::dra::ClaimBackend;
use devplug_backends::virtual_devices::{
    VirtualBackend, VirtualPartitions, VirtualSettings, VirtualShare,
};
use devplug_testkit::api_server::until;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceClaim, ResourceSlice};
use kube::Api;
use kubelet_sim::DraClaim;
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

const DRIVER: &str = "gpu.example.com";
const NODE: &str = "dra-sharing-node";
const NS: &str = "dra-sharing";

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scheduler_packs_shares_and_each_container_gets_its_limits() {
    let Some(client) = common::scheduled(
        "the_scheduler_packs_shares_and_each_container_gets_its_limits",
        NODE,
    )
    .await
    else {
        return;
    };

    // The node's kubelet (the simulator) and devplug's driver for two shared virtual GPUs.
    let settings = VirtualSettings {
        env: "GPU_VISIBLE_DEVICES".into(),
        id_prefix: "gpu-".into(),
        share: Some(VirtualShare {
            cores: 100,
            memory: Some("16Gi".into()),
            memory_step: "1Gi".into(),
        }),
        ..VirtualSettings::new(2)
    };
    let backend: Arc<dyn ClaimBackend> = Arc::new(VirtualBackend::new(&settings).unwrap());
    let dra = common::start(&client, NODE, DRIVER, backend).await;
    let (kubelet, driver_settings) = (&dra.kubelet, &dra.settings);

    // Both devices are published as shareable, with their capacities' policies.
    let device_count = |slices: &[ResourceSlice]| -> usize {
        slices
            .iter()
            .map(|s| s.spec.devices.iter().flatten().count())
            .sum()
    };
    let published: Vec<_> = common::pool(&client, NODE, DRIVER, "2 shared devices", |slices| {
        device_count(slices) == 2
    })
    .await
    .into_iter()
    .flat_map(|s| s.spec.devices.unwrap_or_default())
    .collect();
    for device in &published {
        assert_eq!(device.allow_multiple_allocations, Some(true), "{device:?}");
        let capacity = device.capacity.as_ref().unwrap();
        assert_eq!(capacity["cores"].value.0, "100");
        assert_eq!(capacity["memory"].value.0, (16u64 << 30).to_string());
        let policy = capacity["memory"].request_policy.as_ref().unwrap();
        assert_eq!(policy.default.as_ref().unwrap().0, (1u64 << 30).to_string());
    }

    // A class, four claims (40, 40, 40 and 70 cores; the first also 4Gi of memory), a pod each.
    common::namespace(&client, NS).await;
    common::device_class(
        &client,
        "gpu-share",
        &format!("device.driver == \"{DRIVER}\""),
    )
    .await;
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), NS);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let asks = [
        ("share-1", json!({ "cores": "40", "memory": "4Gi" })),
        ("share-2", json!({ "cores": "40" })),
        ("share-3", json!({ "cores": "40" })),
        ("share-4", json!({ "cores": "70" })),
    ];
    for (name, requests) in &asks {
        let exactly =
            json!({ "deviceClassName": "gpu-share", "capacity": { "requests": requests } });
        common::claim_and_pod(&client, NS, name, "gpu", exactly).await;
    }

    // The first three are allocated: two share one device, the third is on the other.
    let mut on: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    for (name, _) in &asks[..3] {
        let result = until(
            &format!("{name} allocated"),
            Duration::from_secs(60),
            || common::allocation(&claims, name),
        )
        .await;
        assert_eq!(
            (result.driver.as_str(), result.pool.as_str()),
            (DRIVER, NODE)
        );
        assert!(result.share_id.is_some(), "a share: {result:?}");
        let consumed = result.consumed_capacity.clone().unwrap();
        assert_eq!(consumed["cores"].0, "40", "{name}: {consumed:?}");
        on.entry(result.device.clone()).or_default().push(name);
    }
    let mut counts: Vec<usize> = on.values().map(Vec::len).collect();
    counts.sort();
    assert_eq!(
        counts,
        [1, 2],
        "two shares on one device, one on the other: {on:?}"
    );
    // The fourth (70 cores) fits neither device (20 and 60 left): it stays unallocated.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        common::allocation(&claims, "share-4").await.is_none(),
        "70 cores do not fit"
    );
    let waiting = pods.get("share-4").await.unwrap();
    assert!(
        waiting.spec.and_then(|s| s.node_name).is_none(),
        "share-4 waits"
    );

    // The kubelet prepares the two shares of the shared device: each container gets the device
    // and its own limits.
    let (shared_device, pair) = on.iter().find(|(_, r)| r.len() == 2).unwrap();
    for &name in pair {
        let claim = claims.get(name).await.unwrap();
        let uid = claim.metadata.uid.clone().unwrap();
        let sim_claim = DraClaim::new(NS, name, &uid);
        let started = Instant::now();
        let answer = kubelet
            .dra_prepare(DRIVER, std::slice::from_ref(&sim_claim))
            .await
            .unwrap();
        eprintln!("NodePrepareResources of {name}: {:?}", started.elapsed());
        let prepared = answer[&uid].as_ref().unwrap();
        assert_eq!(prepared.len(), 1);
        assert_eq!(&prepared[0].device_name, shared_device);
        let spec_path = devplug_dra::prepare::spec_path(&driver_settings.cdi_dir, DRIVER, &uid);
        let spec: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&spec_path).unwrap()).unwrap();
        let env: Vec<&str> = spec["devices"][0]["containerEdits"]["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e.as_str().unwrap())
            .collect();
        assert!(
            env.contains(&format!("GPU_VISIBLE_DEVICES={shared_device}").as_str()),
            "{env:?}"
        );
        assert!(env.contains(&"GPU_VISIBLE_DEVICES_CORES=40"), "{env:?}");
        let memory = if name == "share-1" {
            4u64 << 30
        } else {
            1 << 30
        };
        assert!(
            env.contains(&format!("GPU_VISIBLE_DEVICES_MEMORY={memory}").as_str()),
            "{name}: what it asked for, else one step: {env:?}"
        );
        let gone = kubelet
            .dra_unprepare(DRIVER, std::slice::from_ref(&sim_claim))
            .await
            .unwrap();
        assert!(gone[&uid].is_ok());
        assert!(!spec_path.exists());
    }

    assert!(dra.driver.shutdown().await.is_empty());
    dra.kubelet.stop().await;
}

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scheduler_never_gives_out_overlapping_partitions() {
    const DRIVER: &str = "part.example.com";
    const NODE: &str = "dra-partition-node";
    const NS: &str = "dra-partitions";
    let Some(client) =
        common::scheduled("the_scheduler_never_gives_out_overlapping_partitions", NODE).await
    else {
        return;
    };
    // One GPU of 4 slices: whole, in halves (s2) and in quarters (s1).
    let settings = VirtualSettings {
        env: "GPU_VISIBLE_DEVICES".into(),
        id_prefix: "gpu-".into(),
        partitions: Some(VirtualPartitions {
            slices: 4,
            sizes: vec![2, 1],
        }),
        ..VirtualSettings::new(1)
    };
    let backend: Arc<dyn ClaimBackend> = Arc::new(VirtualBackend::new(&settings).unwrap());
    let dra = common::start(&client, NODE, DRIVER, backend).await;
    let (kubelet, driver_settings) = (&dra.kubelet, &dra.settings);

    // The pool: a slice with the GPU's counter set, a slice with its 7 devices.
    let pool = common::pool(&client, NODE, DRIVER, "the pool's 2 slices", |slices| {
        slices.len() == 2
    })
    .await;
    let sets: Vec<_> = pool
        .iter()
        .flat_map(|s| s.spec.shared_counters.iter().flatten())
        .collect();
    assert_eq!(sets.len(), 1);
    assert_eq!(
        (sets[0].name.as_str(), sets[0].counters.len()),
        ("gpu-0", 4)
    );
    let devices: usize = pool
        .iter()
        .map(|s| s.spec.devices.iter().flatten().count())
        .sum();
    assert_eq!(devices, 7);

    common::namespace(&client, NS).await;
    common::device_class(
        &client,
        "gpu-part",
        &format!("device.driver == \"{DRIVER}\""),
    )
    .await;
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), NS);
    let size = |n: i64| format!("device.attributes[\"{DRIVER}\"].slices == {n}");
    let part = |name: &'static str, selector: String| {
        let exactly = json!({
            "deviceClassName": "gpu-part",
            "selectors": [{ "cel": { "expression": selector } }],
        });
        common::claim_and_pod(&client, NS, name, "part", exactly)
    };
    let offset = |r: &DeviceRequestAllocationResult| -> u32 {
        r.device.rsplit('-').next().unwrap().parse().unwrap()
    };
    // A quarter, then a half: the half is the one the quarter is not in.
    part("quarter-1", size(1)).await;
    let q1 = until("quarter-1 allocated", Duration::from_secs(60), || {
        common::allocation(&claims, "quarter-1")
    })
    .await;
    part("half-1", size(2)).await;
    let h1 = until("half-1 allocated", Duration::from_secs(60), || {
        common::allocation(&claims, "half-1")
    })
    .await;
    assert!(
        q1.device.starts_with("gpu-0-s1-") && h1.device.starts_with("gpu-0-s2-"),
        "{q1:?} {h1:?}"
    );
    assert!(
        offset(&q1) / 2 != offset(&h1) / 2,
        "{} overlaps {}",
        h1.device,
        q1.device
    );
    // No second half and no whole GPU fit; another quarter does, beside the first.
    part("half-2", size(2)).await;
    part("whole", format!("device.attributes[\"{DRIVER}\"].whole")).await;
    part("quarter-2", size(1)).await;
    let q2 = until("quarter-2 allocated", Duration::from_secs(60), || {
        common::allocation(&claims, "quarter-2")
    })
    .await;
    assert_eq!(
        offset(&q2) / 2,
        offset(&q1) / 2,
        "the free quarter of the first half: {q2:?}"
    );
    assert_ne!(q2.device, q1.device);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        common::allocation(&claims, "half-2").await.is_none(),
        "no half is free"
    );
    assert!(
        common::allocation(&claims, "whole").await.is_none(),
        "the GPU is not whole any more"
    );

    // The kubelet prepares the half: its container is told the partition and its slices.
    let claim = claims.get("half-1").await.unwrap();
    let uid = claim.metadata.uid.clone().unwrap();
    let sim_claim = DraClaim::new(NS, "half-1", &uid);
    let answer = kubelet
        .dra_prepare(DRIVER, std::slice::from_ref(&sim_claim))
        .await
        .unwrap();
    assert_eq!(answer[&uid].as_ref().unwrap()[0].device_name, h1.device);
    let spec_path = devplug_dra::prepare::spec_path(&driver_settings.cdi_dir, DRIVER, &uid);
    let spec: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&spec_path).unwrap()).unwrap();
    let env = spec["devices"][0]["containerEdits"]["env"].to_string();
    let first = offset(&h1);
    assert!(
        env.contains(&format!("GPU_VISIBLE_DEVICES={}", h1.device)),
        "{env}"
    );
    assert!(
        env.contains(&format!("GPU_VISIBLE_DEVICES_SLICES={first}-{}", first + 1)),
        "{env}"
    );
    assert!(dra.driver.shutdown().await.is_empty());
    dra.kubelet.stop().await;
}
