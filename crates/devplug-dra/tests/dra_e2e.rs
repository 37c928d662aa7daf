//! DRA end to end: a real etcd, kube-apiserver and kube-scheduler (1.36), a
//! Node, devplug's DRA driver for it (ResourceSlices appear), a DeviceClass, a ResourceClaim
//! for 2 devices with a CEL selector on an attribute, and a Pod using it. The real scheduler
//! allocates the claim and binds the pod; the kubelet simulator, as the node's kubelet, calls
//! NodePrepareResources; the CDI spec on disk and the answer match the allocation; the driver
//! restarting keeps the prepared claim; a device turning unhealthy stays in the slice with a
//! NoSchedule taint; a pod that asks for an extended resource, with no claim, gets a device
//! through a DeviceClass naming it, never the tainted one, which it gets once the device
//! recovers; deleting the pod unprepares. Skips loudly without `KUBEBUILDER_ASSETS`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use devplug_testkit::dra_node as common;

use devplug::dra::AttributeValue;
use devplug::{AllocateError, Backend, ContainerEdits, Device, DeviceList, Health};
use devplug_dra::ClaimBackend;
use devplug_testkit::api_server::until;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::Api;
use kubelet_sim::DraClaim;
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

const DRIVER: &str = "npu.example.com";
const NODE: &str = "dra-node-1";
const NS: &str = "dra-e2e";

struct Npus(watch::Sender<DeviceList>);

impl Backend for Npus {
    fn devices(&self) -> watch::Receiver<DeviceList> {
        self.0.subscribe()
    }
    fn allocate(&self, ids: &[String]) -> Result<ContainerEdits, AllocateError> {
        Ok(ContainerEdits::default().env("NPU_VISIBLE_DEVICES", ids.join(",")))
    }
}

/// Devices handed to claims whole, as the device plugin hands them.
impl ClaimBackend for Npus {}

fn npu(i: i64) -> Device {
    Device::new(format!("npu-{i}"))
        .with_numa_nodes([i / 2])
        .with_attribute("model", AttributeValue::String("dummy-x1".into()))
        .with_capacity("memory", 16 << 30)
}

async fn slice_devices(slices: &Api<ResourceSlice>) -> Vec<String> {
    let list = slices
        .list(&ListParams::default().fields(&format!("spec.nodeName={NODE},spec.driver={DRIVER}")))
        .await
        .unwrap();
    let mut names: Vec<String> = list
        .items
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten().map(|d| d.name.clone()))
        .collect();
    names.sort();
    names
}

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scheduler_allocates_and_the_kubelet_prepares_through_devplug() {
    let Some(client) = common::scheduled(
        "the_scheduler_allocates_and_the_kubelet_prepares_through_devplug",
        NODE,
    )
    .await
    else {
        return;
    };

    // The node's kubelet (the simulator, with its plugin watcher) and devplug's driver.
    let (devices, _) = watch::channel(DeviceList::new((0..4).map(npu)));
    let backend: Arc<dyn ClaimBackend> = Arc::new(Npus(devices.clone()));
    let common::DraNode {
        root: _root,
        kubelet,
        settings,
        driver,
    } = common::start(&client, NODE, DRIVER, backend.clone()).await;
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let published = until(
        "4 devices in the slices",
        Duration::from_secs(20),
        || async {
            let names = slice_devices(&slices).await;
            (names.len() == 4).then_some(names)
        },
    )
    .await;
    assert_eq!(published, ["npu-0", "npu-1", "npu-2", "npu-3"]);

    // A class, a claim for 2 devices on NUMA node 1, and a pod using it.
    common::namespace(&client, NS).await;
    common::device_class(&client, "npu", &format!("device.driver == \"{DRIVER}\"")).await;
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), NS);
    claims
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": { "name": "two-npus" },
                "spec": { "devices": { "requests": [{
                    "name": "npus",
                    "exactly": {
                        "deviceClassName": "npu",
                        "allocationMode": "ExactCount",
                        "count": 2,
                        "selectors": [{ "cel": { "expression":
                            format!("device.attributes[\"{DRIVER}\"].numa == 1") } }],
                    },
                }] } },
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    pods.create(
        &PostParams::default(),
        &serde_json::from_value(json!({
            "metadata": { "name": "trainer" },
            "spec": {
                "resourceClaims": [{ "name": "npus", "resourceClaimName": "two-npus" }],
                "containers": [{ "name": "main", "image": "example.invalid/trainer",
                                 "resources": { "claims": [{ "name": "npus" }] } }],
            },
        }))
        .unwrap(),
    )
    .await
    .unwrap();

    // The scheduler allocates the claim and binds the pod to our node.
    let bound = until("the pod bound", Duration::from_secs(60), || async {
        let pod = pods.get("trainer").await.ok()?;
        pod.spec?.node_name
    })
    .await;
    assert_eq!(bound, NODE);
    let claim = claims.get("two-npus").await.unwrap();
    let results = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.clone())
        .unwrap();
    let mut allocated: Vec<&str> = results.iter().map(|r| r.device.as_str()).collect();
    allocated.sort();
    assert_eq!(
        allocated,
        ["npu-2", "npu-3"],
        "the CEL selector picked NUMA node 1"
    );
    assert!(results.iter().all(|r| r.driver == DRIVER && r.pool == NODE));

    // The kubelet prepares the pod's claim.
    let uid = claim.metadata.uid.clone().unwrap();
    let sim_claim = DraClaim::new(NS, "two-npus", &uid);
    let started = Instant::now();
    let answer = kubelet
        .dra_prepare(DRIVER, std::slice::from_ref(&sim_claim))
        .await
        .unwrap();
    eprintln!(
        "NodePrepareResources of the first claim: {:?}",
        started.elapsed()
    );
    let prepared = answer[&uid].as_ref().unwrap().clone();
    let mut names: Vec<&str> = prepared.iter().map(|d| d.device_name.as_str()).collect();
    names.sort();
    assert_eq!(names, allocated);
    let cdi_ids: Vec<&String> = prepared.iter().flat_map(|d| &d.cdi_device_ids).collect();
    assert_eq!(cdi_ids, [&format!("{DRIVER}/claim={uid}-npus")]);
    let spec_path = devplug_dra::prepare::spec_path(&settings.cdi_dir, DRIVER, &uid);
    let spec: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&spec_path).unwrap()).unwrap();
    let env = spec["devices"][0]["containerEdits"]["env"][0]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        env == "NPU_VISIBLE_DEVICES=npu-2,npu-3" || env == "NPU_VISIBLE_DEVICES=npu-3,npu-2",
        "{env}"
    );

    // devplug restarts mid-way: the prepared claim is kept, not prepared again.
    assert!(driver.shutdown().await.is_empty());
    let driver = common::start_driver(&settings, backend.clone(), &client).await;
    let again = kubelet
        .dra_prepare(DRIVER, std::slice::from_ref(&sim_claim))
        .await
        .unwrap();
    assert_eq!(again[&uid].as_ref().unwrap(), &prepared);
    assert!(driver.prepared().await.contains_key(&uid));

    // npu-0 turns unhealthy: it stays in the slice with a NoSchedule taint.
    devices.send_modify(|list| {
        list.set_health("npu-0", Health::unhealthy("test"));
    });
    let key = devplug_dra::slices::unhealthy_taint_key(DRIVER);
    until("npu-0 tainted", Duration::from_secs(20), || async {
        let list = slices
            .list(
                &ListParams::default()
                    .fields(&format!("spec.nodeName={NODE},spec.driver={DRIVER}")),
            )
            .await
            .ok()?;
        let tainted: Vec<String> = list
            .items
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .filter(|d| {
                d.taints
                    .iter()
                    .flatten()
                    .any(|t| t.key == key && t.effect == "NoSchedule")
            })
            .map(|d| d.name.clone())
            .collect();
        (tainted == ["npu-0"]).then_some(())
    })
    .await;
    assert_eq!(slice_devices(&slices).await.len(), 4);

    // A pod written for the device plugin: `limits: {example.com/npu: 1}`, no claim. A class
    // naming that extended resource makes the scheduler claim a device of our driver for it
    // (the Node has no example.com/npu of its own). npu-2 and npu-3 are taken and npu-0 is
    // tainted: it gets npu-1.
    let classes: Api<DeviceClass> = Api::all(client.clone());
    classes
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": { "name": "npu-extended" },
                "spec": {
                    "selectors": [{ "cel": { "expression": format!("device.driver == \"{DRIVER}\"") } }],
                    "extendedResourceName": "example.com/npu",
                },
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let plain = |name: &str| -> Pod {
        serde_json::from_value(json!({
            "metadata": { "name": name },
            "spec": { "containers": [{ "name": "main", "image": "example.invalid/plain",
                "resources": { "limits": { "example.com/npu": "1" } } }] },
        }))
        .unwrap()
    };
    let extended_device = |name: &'static str| {
        let pods = pods.clone();
        let claims = claims.clone();
        async move {
            let pod = pods.get(name).await.ok()?;
            pod.spec.as_ref()?.node_name.as_ref()?;
            let status = pod.status?.extended_resource_claim_status?;
            assert_eq!(status.request_mappings[0].resource_name, "example.com/npu");
            let claim = claims.get(&status.resource_claim_name).await.ok()?;
            let results = claim.status?.allocation?.devices?.results?;
            assert_eq!(results.len(), 1, "{results:?}");
            assert_eq!(results[0].driver, DRIVER);
            Some(results[0].device.clone())
        }
    };
    pods.create(&PostParams::default(), &plain("plain"))
        .await
        .unwrap();
    let got = until(
        "the plain pod bound with its extended-resource claim",
        Duration::from_secs(60),
        || extended_device("plain"),
    )
    .await;
    assert_eq!(got, "npu-1", "the untainted free device");

    // A second such pod: only the tainted npu-0 is left, so it waits; npu-0 recovers, the
    // taint goes, and the pod gets it.
    pods.create(&PostParams::default(), &plain("plain-2"))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let waiting = pods.get("plain-2").await.unwrap();
    assert!(
        waiting
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_ref())
            .is_none(),
        "no pod is scheduled onto a tainted device"
    );
    devices.send_modify(|list| {
        list.set_health("npu-0", Health::Healthy);
    });
    let got = until(
        "plain-2 bound once npu-0 recovered",
        Duration::from_secs(60),
        || extended_device("plain-2"),
    )
    .await;
    assert_eq!(got, "npu-0");
    for name in ["plain", "plain-2"] {
        pods.delete(name, &DeleteParams::default().grace_period(0))
            .await
            .unwrap();
    }

    // The pod is deleted: the kubelet unprepares its claim.
    pods.delete("trainer", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    let gone = kubelet
        .dra_unprepare(DRIVER, std::slice::from_ref(&sim_claim))
        .await
        .unwrap();
    assert!(gone[&uid].is_ok());
    assert!(!spec_path.exists(), "the claim's CDI spec is removed");
    assert!(driver.prepared().await.is_empty());

    // A removal (the resource left the config) takes the node's slices of this driver down;
    // a shutdown keeps them for the next start (the crate's slices tests show both).
    assert!(driver.remove().await.is_empty());
    until("the slices removed", Duration::from_secs(20), || async {
        slice_devices(&slices).await.is_empty().then_some(())
    })
    .await;
    kubelet.stop().await;
}
