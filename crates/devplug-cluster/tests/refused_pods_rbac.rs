//! The chart's refused-pods permissions exactly as rendered (`.ci/render-helm`, release
//! `defaults`): its ClusterRole and binding and the ValidatingAdmissionPolicy that limits its
//! deletes, applied to a real API server, then used with tokens of two nodes. A node's devplug
//! does its whole job with them (watch, replacement watch, delete, events), and is refused
//! deleting another node's pod or a pod that is not Failed.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use devplug_cluster::refused_pods::{Policy, RefusedPods};
use devplug_testkit::api_server::{
    admin, apply_rendered_permissions, client_for_token, new_node, node_token, until, ApiServer,
};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::Api;
use serde_json::{json, Value};
use std::time::Duration;

const NPU: &str = "example.com/npu";

/// The rendered `demo` release's refused-pods documents (the chart with the demo's values).
fn rendered() -> Vec<Value> {
    let dir = std::env::var_os("DEVPLUG_HELM_RENDERED")
        .expect("DEVPLUG_HELM_RENDERED names the rendered chart");
    let text = std::fs::read_to_string(std::path::Path::new(&dir).join("demo.yaml")).unwrap();
    serde_saphyr::from_multiple::<Value>(&text)
        .unwrap()
        .into_iter()
        .filter(|d| {
            d["metadata"]["name"]
                .as_str()
                .is_some_and(|n| n.ends_with("-refused-pods"))
        })
        .collect()
}

/// Pod `name` on `node` asking for the NPU, owned by ReplicaSet `rs` when given, in `phase`
/// (Failed: refused at admission).
async fn pod(pods: &Api<Pod>, name: &str, node: &str, rs: Option<&str>, phase: &str) {
    let owners: Vec<Value> = rs
        .map(|uid| json!({"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web", "uid": uid, "controller": true}))
        .into_iter()
        .collect();
    let object: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"app": "web"}, "ownerReferences": owners},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox",
            "resources": {"limits": {NPU: "1"}}}]}
    }))
    .unwrap();
    pods.create(&PostParams::default(), &object).await.unwrap();
    let status = if phase == "Failed" {
        json!({"phase": "Failed", "reason": "UnexpectedAdmissionError",
               "message": format!("Allocate failed due to cannot allocate unregistered device {NPU}, which is unexpected")})
    } else {
        json!({"phase": phase})
    };
    pods.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({ "status": status })),
    )
    .await
    .unwrap();
}

#[cfg_attr(
    any(no_api_server, no_helm_rendered),
    ignore = "needs an API server and the rendered chart: set KUBEBUILDER_ASSETS and DEVPLUG_HELM_RENDERED (docs/testing.md)"
)]
#[tokio::test]
async fn the_charts_refused_pods_permissions_are_scoped_to_the_nodes_failed_pods() {
    let Some(admin) = admin("refused_pods_rbac").await else {
        return;
    };
    let server = ApiServer::shared("refused_pods_rbac").unwrap();
    let docs = rendered();
    let (accounts, account) = apply_rendered_permissions(&admin, &docs, "refused pods").await;
    let account = account.as_str();

    let nodes: Api<Node> = Api::all(admin.clone());
    let node_a = new_node(&nodes, "refused-a").await;
    let node_b = new_node(&nodes, "refused-b").await;
    let a = client_for_token(
        server,
        "node-a",
        &node_token(&accounts, account, Some(&node_a)).await,
    )
    .await;
    let admin_pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    pod(&admin_pods, "b-failed", &node_b, None, "Failed").await;
    pod(&admin_pods, "a-running", &node_a, None, "Running").await;
    let as_a: Api<Pod> = Api::namespaced(a.clone(), "default");

    // The policy takes effect once the API server has loaded it: wait for the first refusal
    // (a deletion it let through is made again).
    let refusal = until("the policy in force", Duration::from_secs(30), || async {
        match as_a.delete("b-failed", &DeleteParams::default()).await {
            Err(err) => Some(err.to_string()),
            Ok(_) => {
                pod(&admin_pods, "b-failed", &node_b, None, "Failed").await;
                None
            }
        }
    })
    .await;
    assert!(
        refusal.contains(&format!("may not delete pods of node {node_b}")),
        "{refusal}"
    );
    let refusal = as_a
        .delete("a-running", &DeleteParams::default())
        .await
        .expect_err("node A's devplug deleting a running pod of its node");
    assert!(
        refusal
            .to_string()
            .contains("may delete only pods the kubelet refused at admission"),
        "{refusal}"
    );

    // Node A's devplug does its whole job with these permissions.
    pod(&admin_pods, "web-1", &node_a, Some("rs-1"), "Failed").await;
    pod(&admin_pods, "web-2", &node_a, Some("rs-1"), "Pending").await;
    pod(&admin_pods, "bare", &node_a, None, "Failed").await;
    let stop = tokio_util::sync::CancellationToken::new();
    let watch = RefusedPods::spawn(
        a,
        node_a.clone(),
        "test".into(),
        Policy::DeleteReplaced,
        [NPU.to_owned()].into(),
        stop.clone(),
    );
    until(
        "the replaced pod deleted",
        Duration::from_secs(30),
        || async { (admin_pods.get_opt("web-1").await.unwrap().is_none()).then_some(()) },
    )
    .await;
    until("the bare pod reported", Duration::from_secs(30), || async {
        (watch
            .counters()
            .reported
            .load(std::sync::atomic::Ordering::Relaxed)
            == 1)
            .then_some(())
    })
    .await;
    assert_eq!(
        watch
            .counters()
            .failed
            .load(std::sync::atomic::Ordering::Relaxed),
        0,
        "a request of node A's devplug was refused"
    );
    for name in ["b-failed", "a-running", "web-2", "bare"] {
        assert!(
            admin_pods.get_opt(name).await.unwrap().is_some(),
            "{name} deleted"
        );
    }
    stop.cancel();
}
