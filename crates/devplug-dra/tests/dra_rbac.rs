//! The chart's DRA permissions exactly as rendered (`.ci/render-helm`, release `dra`): its
//! ClusterRole and binding, and the ValidatingAdmissionPolicies that scope them to the node,
//! applied to a real API server, then used with tokens of two nodes. A node's devplug publishes
//! and removes its own slices, and is refused another node's slices, another driver's slices,
//! and everything when its token names no node. Its device status writer keeps the status of
//! the claims allocated on its node (set, following health, removed at unprepare) and is
//! refused another node's claim: by the API server's own check of `resourceclaims/driver`
//! (Kubernetes 1.36), and by the chart's policy where that check is not there (shown by granting
//! the token what a cluster without it would: any node's claim, any allocation).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use devplug::{Device, DeviceList};
use devplug_dra::checkpoint::{PreparedClaim, PreparedDevice};
use devplug_dra::device_status::{DeviceStatusWriter, PreparedClaims};
use devplug_dra::slices::SlicePublisher;
use devplug_dra::Hold;
use devplug_testkit::api_server::{
    admin, client_for_token, create_cluster_scoped, new_node, node_token, until, ApiServer,
};
use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::core::v1::{Node, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::Api;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const DRIVER: &str = "npu.example.com";

/// How long a change may take to show in the API server.
const WAIT: Duration = Duration::from_secs(30);

/// The rendered `dra` release's documents.
fn rendered() -> Vec<Value> {
    let dir = std::env::var_os("DEVPLUG_HELM_RENDERED")
        .expect("DEVPLUG_HELM_RENDERED names the rendered chart");
    let path = std::path::Path::new(&dir).join("dra.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    serde_saphyr::from_multiple(&text).unwrap()
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

fn slice(name: &str, node: &str, driver: &str) -> ResourceSlice {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [],
        },
    }))
    .unwrap()
}

/// The refusal of `write`, or a panic if it was allowed.
fn refused<T: std::fmt::Debug>(write: Result<T, kube::Error>, what: &str) -> String {
    match write {
        Ok(done) => panic!("{what}: allowed ({done:?})"),
        Err(err) => err.to_string(),
    }
}

#[cfg_attr(
    any(no_api_server, no_helm_rendered),
    ignore = "needs an API server and the rendered chart: set KUBEBUILDER_ASSETS and DEVPLUG_HELM_RENDERED (docs/testing.md)"
)]
#[tokio::test]
async fn the_charts_dra_permissions_are_scoped_to_the_node() {
    let Some(admin) = admin("the_charts_dra_permissions_are_scoped_to_the_node").await else {
        return;
    };
    let server = ApiServer::shared("rbac").unwrap();
    let docs = rendered();
    let binding = of_kind(&docs, "ClusterRoleBinding")
        .into_iter()
        .find(|b| b["metadata"]["name"].as_str().unwrap().ends_with("-dra"))
        .expect("the chart's DRA ClusterRoleBinding");
    let subject = &binding["subjects"][0];
    let (account, namespace) = (
        subject["name"].as_str().unwrap(),
        subject["namespace"].as_str().unwrap(),
    );
    let accounts: Api<ServiceAccount> = Api::namespaced(admin.clone(), namespace);
    let sa: ServiceAccount =
        serde_json::from_value(json!({"metadata": {"name": account, "namespace": namespace}}))
            .unwrap();
    accounts.create(&PostParams::default(), &sa).await.unwrap();
    for role in of_kind(&docs, "ClusterRole") {
        if role["metadata"]["name"].as_str().unwrap().ends_with("-dra") {
            create_cluster_scoped::<ClusterRole>(&admin, role).await;
        }
    }
    create_cluster_scoped::<ClusterRoleBinding>(&admin, binding).await;
    // The slices' policy (the release has the refused pods' policy too).
    let slices_policy = |d: &&Value| {
        d["metadata"]["name"]
            .as_str()
            .is_some_and(|n| n.ends_with("-dra-slices") || n.ends_with("-dra-claim-status"))
    };
    let policies: Vec<_> = of_kind(&docs, "ValidatingAdmissionPolicy")
        .into_iter()
        .filter(slices_policy)
        .collect();
    assert_eq!(
        policies.len(),
        2,
        "the chart ships the node-scoping policies"
    );
    for policy in policies {
        create_cluster_scoped::<ValidatingAdmissionPolicy>(&admin, policy).await;
    }
    for binding in of_kind(&docs, "ValidatingAdmissionPolicyBinding")
        .into_iter()
        .filter(slices_policy)
    {
        create_cluster_scoped::<ValidatingAdmissionPolicyBinding>(&admin, binding).await;
    }

    let nodes: Api<Node> = Api::all(admin.clone());
    let node_a = new_node(&nodes, "rbac-a").await;
    let node_b = new_node(&nodes, "rbac-b").await;
    let a = client_for_token(
        server,
        "node-a",
        &node_token(&accounts, account, Some(&node_a)).await,
    )
    .await;
    let b = client_for_token(
        server,
        "node-b",
        &node_token(&accounts, account, Some(&node_b)).await,
    )
    .await;
    let nowhere = client_for_token(
        server,
        "nowhere",
        &node_token(&accounts, account, None).await,
    )
    .await;
    let as_a: Api<ResourceSlice> = Api::all(a.clone());
    let pp = PostParams::default();

    // The policy takes effect once the API server has loaded it: wait for the first refusal.
    let mut other_node = Err(kube::Error::LinesCodecMaxLineLengthExceeded);
    for _ in 0..100 {
        other_node = as_a
            .create(&pp, &slice("a-writes-b", &node_b, DRIVER))
            .await;
        match &other_node {
            Ok(_) => {
                // The policy can come into force between the create and this delete, which it
                // then refuses too: the admin removes the slice instead.
                if as_a
                    .delete("a-writes-b", &DeleteParams::default())
                    .await
                    .is_err()
                {
                    Api::<ResourceSlice>::all(admin.clone())
                        .delete("a-writes-b", &DeleteParams::default())
                        .await
                        .unwrap();
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(_) => break,
        }
    }
    let why = refused(other_node, "node A writing node B's slice");
    assert!(
        why.contains(&format!("may not write ResourceSlices of node {node_b}")),
        "{why}"
    );

    // The publisher's read of its Node (its probe of a lost API server, a resync): allowed by
    // the role, which lets it list and watch Nodes but not get one.
    let uid = nodes.get(&node_a).await.unwrap().metadata.uid;
    assert_eq!(
        devplug_dra::slices::read_node_uid(a.clone(), &node_a)
            .await
            .unwrap(),
        uid
    );
    assert_eq!(
        devplug_dra::slices::read_node_uid(a.clone(), "no-such-node")
            .await
            .unwrap(),
        None
    );
    let why = refused(
        Api::<kube::core::PartialObjectMeta<Node>>::all(a.clone())
            .get_metadata_opt(&node_a)
            .await,
        "a get of the Node under the DRA role",
    );
    assert!(why.contains("forbidden"), "{why}");

    // Node A's devplug does its whole job on its own node: publish, change, remove.
    let list = DeviceList::new((0..3).map(|i| Device::new(format!("npu-{i}"))));
    let (tx, rx) = watch::channel(list.clone());
    let publisher =
        SlicePublisher::spawn(a.clone(), DRIVER, &node_a, rx, &CancellationToken::new()).unwrap();
    tokio::time::timeout(Duration::from_secs(30), publisher.wait_published(&list))
        .await
        .unwrap()
        .unwrap();
    let fewer = DeviceList::new([Device::new("npu-0")]);
    tx.send_replace(fewer.clone());
    tokio::time::timeout(Duration::from_secs(30), publisher.wait_published(&fewer))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        publisher
            .counters()
            .errors
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    assert_eq!(publisher.remove().await.unwrap(), 1);

    // Another driver's slices, even on its own node.
    let why = refused(
        as_a.create(&pp, &slice("a-fakes-gpus", &node_a, "gpu.nvidia.com"))
            .await,
        "node A writing another driver's slice",
    );
    assert!(why.contains("not one of its dra: resources"), "{why}");
    // Deleting node B's slice (B may write it; A may not remove it).
    let as_b: Api<ResourceSlice> = Api::all(b);
    as_b.create(&pp, &slice("b-own", &node_b, DRIVER))
        .await
        .unwrap();
    let why = refused(
        as_a.delete("b-own", &DeleteParams::default()).await,
        "node A deleting node B's slice",
    );
    assert!(
        why.contains("may not write ResourceSlices of node"),
        "{why}"
    );
    as_b.delete("b-own", &DeleteParams::default())
        .await
        .unwrap();
    // A token that names no node may write nothing.
    let why = refused(
        Api::<ResourceSlice>::all(nowhere)
            .create(&pp, &slice("nowhere", &node_a, DRIVER))
            .await,
        "a token without a node",
    );
    assert!(why.contains("names no node"), "{why}");

    device_status_is_scoped_to_the_node(&admin, &a, &node_a, &node_b, account, namespace).await;
}

const OTHER: &str = "other.example.com";

/// A claim `name` in `default` allocated on `node`: our driver's `npu-0` and another driver's
/// `x-0`, both of `node`'s pools. Returns its UID.
async fn allocated_claim(admin: &kube::Client, name: &str, node: &str) -> String {
    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), "default");
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [
            {"name": "npu", "exactly": {"deviceClassName": "npu"}},
            {"name": "x", "exactly": {"deviceClassName": "x"}},
        ]}},
    }))
    .unwrap();
    let made = claims.create(&PostParams::default(), &claim).await.unwrap();
    let status = json!({"status": {"allocation": {
        "devices": {"results": [
            {"request": "npu", "driver": DRIVER, "pool": node, "device": "npu-0"},
            {"request": "x", "driver": OTHER, "pool": node, "device": "x-0"},
        ]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]},
        ]}]},
    }}});
    claims
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
    made.metadata.uid.unwrap()
}

/// The claim's `status.devices`, as (driver, device, Ready's status, Ready's reason).
async fn device_status(
    claims: &Api<ResourceClaim>,
    name: &str,
) -> Vec<(String, String, String, String)> {
    let claim = claims.get(name).await.unwrap();
    let devices = claim.status.and_then(|s| s.devices).unwrap_or_default();
    devices
        .into_iter()
        .map(|d| {
            let ready = d
                .conditions
                .unwrap_or_default()
                .into_iter()
                .find(|c| c.type_ == "Ready")
                .map(|c| (c.status, c.reason))
                .unwrap_or_default();
            (d.driver, d.device, ready.0, ready.1)
        })
        .collect()
}

fn prepared(namespace: &str, name: &str, pool: &str) -> PreparedClaim {
    PreparedClaim {
        namespace: namespace.into(),
        name: name.into(),
        devices: vec![PreparedDevice {
            request_names: vec!["npu".into()],
            pool: pool.into(),
            device: "npu-0".into(),
            id: "npu-0".into(),
            cdi_device_ids: vec![format!("{DRIVER}/claim=npu-0")],
            hold: Hold::Exclusive,
        }],
        cdi_spec: "/var/run/cdi/unused.json".into(),
        cdi_spec_json: None,
    }
}

async fn device_status_is_scoped_to_the_node(
    admin: &kube::Client,
    a: &kube::Client,
    node_a: &str,
    node_b: &str,
    account: &str,
    namespace: &str,
) {
    let uid_a = allocated_claim(admin, "status-a", node_a).await;
    let uid_b = allocated_claim(admin, "status-b", node_b).await;
    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), "default");
    // Node A's writer is told of a claim on its node and, as a compromised one would be, of
    // node B's.
    let healthy = DeviceList::new([Device::new("npu-0").with_attribute(
        "uuid",
        devplug::dra::AttributeValue::String("NPU-0-UUID".into()),
    )]);
    let (devices_tx, devices) = watch::channel(healthy);
    let both: PreparedClaims = std::sync::Arc::new(BTreeMap::from([
        (uid_a.clone(), prepared("default", "status-a", node_a)),
        (uid_b.clone(), prepared("default", "status-b", node_b)),
    ]));
    let (prepared_tx, prepared_rx) = watch::channel(both);
    let stop = CancellationToken::new();
    let writer = DeviceStatusWriter::spawn(a.clone(), DRIVER, prepared_rx, devices, stop.clone());
    let counters = writer.counters();
    until("node A's claim's device status, Ready", WAIT, || async {
        let now = device_status(&claims, "status-a").await;
        (now == [(
            DRIVER.into(),
            "npu-0".into(),
            "True".into(),
            "Prepared".into(),
        )])
        .then_some(())
    })
    .await;
    let claim = claims.get("status-a").await.unwrap();
    let data = claim.status.unwrap().devices.unwrap()[0]
        .data
        .clone()
        .unwrap()
        .0;
    assert_eq!(data["attributes"]["uuid"], "NPU-0-UUID", "{data}");
    assert_eq!(
        data["cdiDevices"][0],
        format!("{DRIVER}/claim=npu-0"),
        "{data}"
    );
    until("node B's claim refused", WAIT, || async {
        (counters.errors.load(Relaxed) >= 1).then_some(())
    })
    .await;
    assert!(device_status(&claims, "status-b").await.is_empty());

    // Another driver's entry in the same claim is its own; health moves our condition.
    let other = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "status-a", "namespace": "default"},
        "status": {"devices": [{"driver": OTHER, "pool": node_a, "device": "x-0"}]},
    });
    claims
        .patch_status(
            "status-a",
            &PatchParams::apply(OTHER),
            &Patch::Apply(&other),
        )
        .await
        .unwrap();
    devices_tx.send_replace(DeviceList::new([Device {
        health: devplug::Health::Unhealthy {
            reason: "the NPU stopped answering".into(),
        },
        ..Device::new("npu-0")
    }]));
    until("the condition to follow health", WAIT, || async {
        let now = device_status(&claims, "status-a").await;
        (now.contains(&(
            DRIVER.into(),
            "npu-0".into(),
            "False".into(),
            "Unhealthy".into(),
        )) && now.iter().any(|d| d.0 == OTHER))
        .then_some(())
    })
    .await;
    // Unprepared: our entry goes, the other driver's stays.
    prepared_tx.send_replace(std::sync::Arc::new(BTreeMap::new()));
    until("our entry removed at unprepare", WAIT, || async {
        let now = device_status(&claims, "status-a").await;
        (now.len() == 1 && now[0].0 == OTHER).then_some(())
    })
    .await;
    stop.cancel();

    // Written directly with node A's token: node B's claim, and node A's claim's allocation.
    let as_a: Api<ResourceClaim> = Api::namespaced(a.clone(), "default");
    let ours = |name: &str, node: &str| {
        json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"},
            "status": {"devices": [{"driver": DRIVER, "pool": node, "device": "npu-0"}]},
        })
    };
    let ssa = PatchParams::apply(DRIVER).force();
    refused(
        as_a.patch_status("status-b", &ssa, &Patch::Apply(&ours("status-b", node_b)))
            .await,
        "node A writing the status of node B's claim",
    );
    let deallocate = json!({"status": {"allocation": null}});
    refused(
        as_a.patch_status(
            "status-a",
            &PatchParams::default(),
            &Patch::Merge(&deallocate),
        )
        .await,
        "node A deallocating its own claim",
    );

    // As on a cluster without the API server's check of resourceclaims/driver: the token may
    // write any node's claim, any driver's entries and any allocation; the chart's policy
    // refuses what the check would have.
    let wide = json!({
        "metadata": {"name": "dra-status-wide"},
        "rules": [{"apiGroups": ["resource.k8s.io"],
                   "resources": ["resourceclaims/driver"],
                   "verbs": ["arbitrary-node:patch", "associated-node:patch"]},
                  {"apiGroups": ["resource.k8s.io"],
                   "resources": ["resourceclaims/binding"],
                   "verbs": ["patch"]}],
    });
    create_cluster_scoped::<ClusterRole>(admin, &wide).await;
    let bind = json!({
        "metadata": {"name": "dra-status-wide"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "dra-status-wide"},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}],
    });
    create_cluster_scoped::<ClusterRoleBinding>(admin, &bind).await;
    let other_driver = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "status-a", "namespace": "default"},
        "status": {"devices": [{"driver": OTHER, "pool": node_a, "device": "x-0",
                                "conditions": []}]},
    });
    let cases = [
        (
            "status-b",
            Patch::Apply(ours("status-b", node_b)),
            ssa.clone(),
            "may not write the status of a claim not allocated on it",
        ),
        (
            "status-a",
            Patch::Merge(deallocate.clone()),
            PatchParams::default(),
            "may not change a claim's allocation",
        ),
        (
            "status-a",
            Patch::Apply(other_driver),
            PatchParams::apply("other-writer").force(),
            "only the device status of its own drivers",
        ),
    ];
    for (name, patch, params, policy_says) in cases {
        // Until the wider role is in force, RBAC refuses first; then the policy does.
        until(policy_says, WAIT, || async {
            let why = refused(as_a.patch_status(name, &params, &patch).await, policy_says);
            why.contains(policy_says).then_some(())
        })
        .await;
    }
}
