//! What tests make on the API server: Nodes (plain, or Ready and schedulable), cluster-scoped
//! objects from manifests and the rendered chart's permissions of one feature; a random
//! number for unique names, and the wait until a condition holds.

/// Creates the manifest `doc` (e.g. one of a rendered chart) as a cluster-scoped `T` with
/// `client`. Panics on an error (a test helper).
pub async fn create_cluster_scoped<T>(client: &kube::Client, doc: &serde_json::Value)
where
    T: kube::Resource<Scope = k8s_openapi::ClusterResourceScope>
        + k8s_openapi::serde::de::DeserializeOwned
        + k8s_openapi::serde::Serialize
        + Clone
        + std::fmt::Debug,
    T::DynamicType: Default,
{
    let object: T = serde_json::from_value(doc.clone()).unwrap_or_else(|e| {
        panic!(
            "{} is not a {}: {e}",
            doc["metadata"]["name"],
            T::kind(&T::DynamicType::default())
        )
    });
    kube::Api::<T>::all(client.clone())
        .create(&kube::api::PostParams::default(), &object)
        .await
        .unwrap_or_else(|e| panic!("create {}: {e}", doc["metadata"]["name"]));
}

/// One feature's permissions as the chart renders them, applied with `admin`: `docs` hold
/// exactly one ClusterRole, ClusterRoleBinding, ValidatingAdmissionPolicy and policy binding
/// (`what` names them in a failure). The binding's service account is made too. Returns that
/// account's namespace API and its name, for [`node_token`](super::node_token). Panics on an error (a test helper).
pub async fn apply_rendered_permissions(
    admin: &kube::Client,
    docs: &[serde_json::Value],
    what: &str,
) -> (
    kube::Api<k8s_openapi::api::core::v1::ServiceAccount>,
    String,
) {
    use k8s_openapi::api::admissionregistration::v1::{
        ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
    };
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
    let one = |kind: &str| {
        let found: Vec<&serde_json::Value> = docs.iter().filter(|d| d["kind"] == kind).collect();
        assert_eq!(found.len(), 1, "{what}: the chart renders one {kind}");
        found[0].clone()
    };
    let binding = one("ClusterRoleBinding");
    let subject = &binding["subjects"][0];
    let account = subject["name"].as_str().unwrap_or_default().to_owned();
    let namespace = subject["namespace"].as_str().unwrap_or_default();
    let accounts = kube::Api::namespaced(admin.clone(), namespace);
    let sa: k8s_openapi::api::core::v1::ServiceAccount = serde_json::from_value(
        serde_json::json!({"metadata": {"name": account, "namespace": namespace}}),
    )
    .unwrap_or_else(|e| panic!("a ServiceAccount: {e}"));
    accounts
        .create(&kube::api::PostParams::default(), &sa)
        .await
        .unwrap_or_else(|e| panic!("create the service account {account}: {e}"));
    create_cluster_scoped::<ClusterRole>(admin, &one("ClusterRole")).await;
    create_cluster_scoped::<ClusterRoleBinding>(admin, &binding).await;
    create_cluster_scoped::<ValidatingAdmissionPolicy>(admin, &one("ValidatingAdmissionPolicy"))
        .await;
    create_cluster_scoped::<ValidatingAdmissionPolicyBinding>(
        admin,
        &one("ValidatingAdmissionPolicyBinding"),
    )
    .await;
    (accounts, account)
}

/// Creates a Node named `<prefix>-<random>` with cpu and memory in its status, as a kubelet
/// would have reported; returns its name. Panics on an API error (a test helper).
pub async fn new_node(nodes: &kube::Api<k8s_openapi::api::core::v1::Node>, prefix: &str) -> String {
    use kube::api::{Patch, PatchParams, PostParams};
    let name = format!("{prefix}-{:08x}", rand_u32());
    let node = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name},
    }));
    let created = match node {
        Ok(node) => nodes.create(&PostParams::default(), &node).await,
        Err(err) => panic!("a Node from JSON: {err}"),
    };
    if let Err(err) = created {
        panic!("create Node {name}: {err}");
    }
    let status = serde_json::json!({"status": {
        "capacity": {"cpu": "4", "memory": "8Gi"},
        "allocatable": {"cpu": "4", "memory": "8Gi"},
    }});
    if let Err(err) = nodes
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
        .await
    {
        panic!("patch the status of Node {name}: {err}");
    }
    name
}

/// Waits until `check` gives a value, asking every 100 ms; panics naming `what` after
/// `timeout` (a test helper: what an API server test waits for, a binding, an allocation).
pub async fn until<T, F, Fut>(what: &str, timeout: std::time::Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// Creates a Node named `name` that the scheduler places pods on: Ready, 4 cpu, 8Gi, 110 pods,
/// the not-ready taint added at admission removed (as a node controller would once the kubelet
/// reports Ready). Panics on an API error (a test helper).
pub async fn schedulable_node(client: &kube::Client, name: &str) {
    use k8s_openapi::api::core::v1::Node;
    use kube::api::{Patch, PatchParams, PostParams};
    let nodes: kube::Api<Node> = kube::Api::all(client.clone());
    let node: Node = match serde_json::from_value(serde_json::json!({
        "metadata": { "name": name, "labels": { "kubernetes.io/hostname": name } },
    })) {
        Ok(node) => node,
        Err(err) => panic!("a Node from JSON: {err}"),
    };
    if let Err(err) = nodes.create(&PostParams::default(), &node).await {
        panic!("create Node {name}: {err}");
    }
    let untaint = serde_json::json!({ "spec": { "taints": [] } });
    if let Err(err) = nodes
        .patch(name, &PatchParams::default(), &Patch::Merge(&untaint))
        .await
    {
        panic!("remove the taints of Node {name}: {err}");
    }
    let status = serde_json::json!({ "status": {
        "capacity": { "cpu": "4", "memory": "8Gi", "pods": "110" },
        "allocatable": { "cpu": "4", "memory": "8Gi", "pods": "110" },
        "conditions": [{ "type": "Ready", "status": "True", "reason": "Test",
                         "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                         "lastTransitionTime": "2026-01-01T00:00:00Z" }],
    } });
    if let Err(err) = nodes
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
    {
        panic!("make Node {name} Ready: {err}");
    }
}

/// A random number for unique names (no `rand` dependency: the std hasher's random keys and
/// the clock).
pub fn rand_u32() -> u32 {
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
