//! Helpers for the API server tests: the shared control plane and a fresh Node per test.

#![allow(dead_code)] // each test binary uses a part

use devplug_cluster::testenv::{self, ApiServer};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Patch, PatchParams, PostParams};
use kube::Api;

/// The admin client, or `None` (after a loud SKIPPED message) without `KUBEBUILDER_ASSETS`.
pub async fn admin(test: &str) -> Option<kube::Client> {
    let server = ApiServer::shared(test)?;
    Some(testenv::client(&server.kubeconfig).await.unwrap())
}

/// Creates a Node named `<prefix>-<random>` with cpu and memory in its status, as a kubelet
/// would have reported; returns its name.
pub async fn new_node(nodes: &Api<Node>, prefix: &str) -> String {
    let name = format!("{prefix}-{:08x}", rand_u32());
    let node: Node = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name},
    }))
    .unwrap();
    nodes.create(&PostParams::default(), &node).await.unwrap();
    let status = serde_json::json!({"status": {
        "capacity": {"cpu": "4", "memory": "8Gi"},
        "allocatable": {"cpu": "4", "memory": "8Gi"},
    }});
    nodes
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
    name
}

fn rand_u32() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    h.finish() as u32
}
