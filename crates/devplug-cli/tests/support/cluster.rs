//! A Node in the shared API server for tests of `devplug run` against it (full build only).

use devplug_testkit::api_server::{self, ApiServer};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Patch, PatchParams, PostParams};
use kube::Api;

/// Creates Node `name` in `nodes`, with a status as a kubelet reports it.
pub async fn node(nodes: &Api<Node>, name: &str) {
    let node: Node = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
    }))
    .unwrap();
    nodes.create(&PostParams::default(), &node).await.unwrap();
    let status =
        serde_json::json!({"status": {"capacity": {"cpu": "2"}, "allocatable": {"cpu": "2"}}});
    nodes
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
}

/// The start of each test against the API server: the shared API server (`None` after the loud SKIPPED message
/// without one), its admin client, and Node `name` created in it, as a kubelet reports it.
pub async fn cluster_with_node(
    test: &str,
    name: &str,
) -> Option<(&'static ApiServer, kube::Client, Api<Node>)> {
    let server = ApiServer::shared(test)?;
    let client = api_server::client(&server.kubeconfig).await.unwrap();
    let nodes: Api<Node> = Api::all(client.clone());
    node(&nodes, name).await;
    Some((server, client, nodes))
}
