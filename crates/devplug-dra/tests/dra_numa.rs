//! Two DRA drivers of one node aligned by NUMA node: devplug publishes every device's standard
//! attribute `resource.kubernetes.io/numaNode` (Kubernetes 1.37, KEP-6072), and a claim asking
//! for an accelerator of one driver and a NIC of another with `matchAttribute` on it gets a pair
//! from one NUMA node, from the real kube-scheduler (1.36). Skips loudly without
//! `KUBEBUILDER_ASSETS`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use devplug::{AllocateError, Backend, ContainerEdits, Device, DeviceList};
use devplug_dra::ClaimBackend;
use devplug_testkit::api_server::until;
use devplug_testkit::dra_node as common;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::PostParams;
use kube::Api;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

const NODE: &str = "dra-numa-node";
const NS: &str = "dra-numa";

struct Devices(watch::Sender<DeviceList>);

impl Backend for Devices {
    fn devices(&self) -> watch::Receiver<DeviceList> {
        self.0.subscribe()
    }
    fn allocate(&self, ids: &[String]) -> Result<ContainerEdits, AllocateError> {
        Ok(ContainerEdits::default().env("VISIBLE_DEVICES", ids.join(",")))
    }
}

impl ClaimBackend for Devices {}

fn backend(devices: Vec<Device>) -> Arc<dyn ClaimBackend> {
    let (tx, _) = watch::channel(DeviceList::new(devices));
    Arc::new(Devices(tx))
}

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_aligns_two_drivers_devices_by_the_standard_numa_node_attribute() {
    let Some(client) = common::scheduled(
        "a_claim_aligns_two_drivers_devices_by_the_standard_numa_node_attribute",
        NODE,
    )
    .await
    else {
        return;
    };
    // Accelerators on NUMA nodes 0, 0, 1, 1; the only NIC on NUMA node 1. Without the
    // constraint the scheduler is free to pick accel-0.
    let accels = backend(
        (0..4)
            .map(|i| Device::new(format!("accel-{i}")).with_numa_nodes([i / 2]))
            .collect(),
    );
    let nics = backend(vec![Device::new("nic-1").with_numa_nodes([1])]);
    let accel = common::start(&client, NODE, "accel.numa.example.com", accels).await;
    let nic = common::start(&client, NODE, "nic.numa.example.com", nics).await;
    let published = common::pool(
        &client,
        NODE,
        "nic.numa.example.com",
        "the NIC's slice",
        |slices| !slices.is_empty(),
    )
    .await;
    let attributes = published[0].spec.devices.as_ref().unwrap()[0]
        .attributes
        .clone()
        .unwrap();
    assert_eq!(
        attributes["resource.kubernetes.io/numaNode"].int,
        Some(1),
        "{attributes:?}"
    );
    common::pool(
        &client,
        NODE,
        "accel.numa.example.com",
        "the accelerators' slice",
        |slices| !slices.is_empty(),
    )
    .await;

    common::namespace(&client, NS).await;
    for driver in ["accel.numa.example.com", "nic.numa.example.com"] {
        common::device_class(&client, driver, &format!("device.driver == \"{driver}\"")).await;
    }
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), NS);
    claims
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": { "name": "aligned" },
                "spec": { "devices": {
                    "requests": [
                        { "name": "accel", "exactly": {
                            "deviceClassName": "accel.numa.example.com", "count": 1 } },
                        { "name": "nic", "exactly": {
                            "deviceClassName": "nic.numa.example.com", "count": 1 } },
                    ],
                    "constraints": [{
                        "requests": ["accel", "nic"],
                        "matchAttribute": "resource.kubernetes.io/numaNode",
                    }],
                } },
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    pods.create(
        &PostParams::default(),
        &serde_json::from_value(json!({
            "metadata": { "name": "aligned" },
            "spec": {
                "resourceClaims": [{ "name": "devices", "resourceClaimName": "aligned" }],
                "containers": [{ "name": "main", "image": "example.invalid/job",
                                 "resources": { "claims": [{ "name": "devices" }] } }],
            },
        }))
        .unwrap(),
    )
    .await
    .unwrap();
    let mut allocated = until("the claim allocated", Duration::from_secs(60), || async {
        let claim = claims.get("aligned").await.ok()?;
        let results = claim.status?.allocation?.devices?.results?;
        Some(
            results
                .into_iter()
                .map(|r| (r.request, r.device))
                .collect::<Vec<_>>(),
        )
    })
    .await;
    allocated.sort();
    assert_eq!(allocated.len(), 2, "{allocated:?}");
    assert_eq!(allocated[1], ("nic".to_owned(), "nic-1".to_owned()));
    assert!(
        ["accel-2", "accel-3"].contains(&allocated[0].1.as_str()),
        "an accelerator on the NIC's NUMA node: {allocated:?}"
    );
    for node in [accel, nic] {
        assert!(node.driver.remove().await.is_empty());
        node.kubelet.stop().await;
    }
}
