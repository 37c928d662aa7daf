//! The chart's DRA permissions exactly as rendered (`.ci/render-helm`, release `dra`): its
//! ClusterRole and binding, and the ValidatingAdmissionPolicy that scopes them to the node,
//! applied to a real API server, then used with tokens of two nodes. A node's devplug publishes
//! and removes its own slices, and is refused another node's slices, another driver's slices,
//! and everything when its token names no node.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use devplug::{Device, DeviceList};
use devplug_dra::slices::SlicePublisher;
use devplug_testkit::api_server::{
    admin, client_for_token, create_cluster_scoped, new_node, node_token, ApiServer,
};
use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::core::v1::{Node, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{DeleteParams, PostParams};
use kube::Api;
use serde_json::{json, Value};
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const DRIVER: &str = "npu.example.com";

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
            .is_some_and(|n| n.ends_with("-dra-slices"))
    };
    let policies: Vec<_> = of_kind(&docs, "ValidatingAdmissionPolicy")
        .into_iter()
        .filter(slices_policy)
        .collect();
    assert_eq!(policies.len(), 1, "the chart ships the node-scoping policy");
    create_cluster_scoped::<ValidatingAdmissionPolicy>(&admin, policies[0]).await;
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
}
