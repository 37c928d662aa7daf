//! The chart's node-label permissions exactly as rendered (`.ci/render-helm`, release
//! `gpu-nvidia`, where `nodeLabels: auto` is direct): its ClusterRole and binding and the
//! ValidatingAdmissionPolicy that limits them, applied to a real API server, then used with
//! tokens of two nodes. A node's devplug writes and keeps its labels with them, and is refused
//! labelling another node, labels outside the GPU vendors' prefixes, and any other change of its
//! Node.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use devplug_cluster::node_labels::{Mode, NodeLabeler};
use devplug_testkit::api_server::{
    admin, apply_rendered_permissions, client_for_token, new_node, node_token, until, ApiServer,
};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Patch, PatchParams};
use kube::Api;
use serde_json::{json, Value};
use std::time::Duration;

/// The rendered `gpu-nvidia` release's node-label documents.
fn rendered() -> Vec<Value> {
    let dir = std::env::var_os("DEVPLUG_HELM_RENDERED")
        .expect("DEVPLUG_HELM_RENDERED names the rendered chart");
    let text = std::fs::read_to_string(std::path::Path::new(&dir).join("gpu-nvidia.yaml")).unwrap();
    serde_saphyr::from_multiple::<Value>(&text)
        .unwrap()
        .into_iter()
        .filter(|d| {
            d["metadata"]["name"]
                .as_str()
                .is_some_and(|n| n.ends_with("-node-labels"))
        })
        .collect()
}

/// A label apply on `node` as `nodes`' user, with `labels`.
async fn apply(nodes: &Api<Node>, node: &str, labels: Value) -> Result<Node, kube::Error> {
    let patch =
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": labels}});
    nodes
        .patch(
            node,
            &PatchParams::apply("test").force(),
            &Patch::Apply(&patch),
        )
        .await
}

#[cfg_attr(
    any(no_api_server, no_helm_rendered),
    ignore = "needs an API server and the rendered chart: set KUBEBUILDER_ASSETS and DEVPLUG_HELM_RENDERED (docs/testing.md)"
)]
#[tokio::test]
async fn the_charts_node_label_permissions_are_scoped_to_the_nodes_gpu_labels() {
    let Some(admin) = admin("node_labels_rbac").await else {
        return;
    };
    let server = ApiServer::shared("node_labels_rbac").unwrap();
    let docs = rendered();
    let (accounts, account) = apply_rendered_permissions(&admin, &docs, "node labels").await;
    let account = account.as_str();

    let nodes: Api<Node> = Api::all(admin.clone());
    let node_a = new_node(&nodes, "labels-a").await;
    let node_b = new_node(&nodes, "labels-b").await;
    let a = client_for_token(
        server,
        "node-a",
        &node_token(&accounts, account, Some(&node_a)).await,
    )
    .await;
    let as_a: Api<Node> = Api::all(a.clone());

    // The policy takes effect once the API server has loaded it: wait for the first refusal
    // (a label it let through is taken off again).
    let refusal = until("the policy in force", Duration::from_secs(30), || async {
        match apply(&as_a, &node_b, json!({"nvidia.com/gpu.count": "8"})).await {
            Err(err) => Some(err.to_string()),
            Ok(_) => {
                apply(&nodes, &node_b, json!({})).await.unwrap();
                None
            }
        }
    })
    .await;
    assert!(
        refusal.contains(&format!("may not change node {node_b}")),
        "{refusal}"
    );
    let refusal = apply(&as_a, &node_a, json!({"example.com/role": "gpu"}))
        .await
        .expect_err("node A's devplug setting a label outside the vendors' prefixes");
    assert!(
        refusal.to_string().contains("not example.com/role"),
        "{refusal}"
    );
    let cordon = json!({"spec": {"unschedulable": true}});
    let refusal = as_a
        .patch(&node_a, &PatchParams::default(), &Patch::Merge(&cordon))
        .await
        .expect_err("node A's devplug cordoning its Node");
    assert!(
        refusal
            .to_string()
            .contains("may change only its Node's labels"),
        "{refusal}"
    );

    // Node A's devplug does its whole job with these permissions: write, update, put back.
    let labeler = NodeLabeler::spawn(a, node_a.clone(), Mode::Direct);
    let labels = |count: &str| -> devplug::NodeLabels {
        [
            ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"),
            ("nvidia.com/gpu.count", count),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
    };
    for count in ["8", "7"] {
        labeler.set(labels(count));
        until("the labels on node A", Duration::from_secs(10), || async {
            let node = nodes.get(&node_a).await.unwrap();
            let now = node.metadata.labels.unwrap_or_default();
            (now.get("nvidia.com/gpu.count").map(String::as_str) == Some(count)).then_some(())
        })
        .await;
    }
    assert_eq!(
        labeler
            .counters()
            .errors
            .load(std::sync::atomic::Ordering::Relaxed),
        0,
        "a request of node A's devplug was refused"
    );
    let b_labels = nodes
        .get(&node_b)
        .await
        .unwrap()
        .metadata
        .labels
        .unwrap_or_default();
    assert!(
        !b_labels.keys().any(|k| k.starts_with("nvidia.com/")),
        "{b_labels:?}"
    );
}
