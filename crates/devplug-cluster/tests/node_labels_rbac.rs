//! The chart's node-label permissions exactly as rendered (`.ci/render-helm`), applied to a real
//! API server, then used with tokens of two nodes.
//!
//! Direct mode (release `gpu-nvidia`, where `nodeLabels: auto` is direct): its ClusterRole and
//! binding and the ValidatingAdmissionPolicy that limits them. A node's devplug writes and keeps
//! its labels with them, and is refused labelling another node, labels outside the GPU vendors'
//! prefixes, and any other change of its Node.
//!
//! Node-feature mode (release `node-labels-nfd`): its Role on NFD's NodeFeature objects and the
//! policy `<release>-node-features`. A node's devplug writes, updates and deletes the object of
//! its own node, and is refused any other node's object, an object of its own pointed at another
//! node, labels it may not write and NFD's `spec.features`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

mod support;

use devplug_cluster::node_labels::{
    self, Mode, NodeLabeler, FIELD_MANAGER, NFD_NODE_LABEL, OWNER, OWNER_LABEL,
};
use devplug_cluster::policy_check::{Feature, Probe};
use devplug_testkit::api_server::{
    admin, client_for_token, new_node, node_token, until, ApiServer,
};
use devplug_testkit::rendered;
use k8s_openapi::api::core::v1::Node;
use kube::api::{DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::Api;
use serde_json::{json, Value};
use std::time::Duration;
use support::{in_force, install_node_feature_crd, Attempts};

/// The rendered `release`'s service accounts and its documents named `name`, which must be one
/// of each of `kinds`: one feature's permissions. Both tests of this binary create the same
/// service account in one API server; [`rendered::apply_permissions`] leaves one that exists
/// already as it is.
fn permissions(release: &str, name: &str, kinds: &[&str]) -> Vec<Value> {
    let docs: Vec<Value> = rendered::release(release)
        .into_iter()
        .filter(|d| d["kind"] == "ServiceAccount" || d["metadata"]["name"] == name)
        .collect();
    let mut found: Vec<&str> = docs
        .iter()
        .filter(|d| d["metadata"]["name"] == name)
        .filter_map(|d| d["kind"].as_str())
        .collect();
    found.sort_unstable();
    let mut want = kinds.to_vec();
    want.sort_unstable();
    assert_eq!(found, want, "the release {release} renders {name} as");
    docs
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
    let docs = permissions(
        "gpu-nvidia",
        "devplug-node-labels",
        &[
            "ClusterRole",
            "ClusterRoleBinding",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
        ],
    );
    rendered::apply_permissions(&admin, &docs).await;
    let (namespace, account) = rendered::bound_account(&docs, "devplug-node-labels");
    let accounts = Api::namespaced(admin.clone(), &namespace);
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
    let labels = |count: &str| -> devplug_cluster::node_labels::NodeLabels {
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

/// A NodeFeature object `name` for `node` (NFD's node label and devplug's owner label), in
/// `namespace`, with `spec`.
fn node_feature(namespace: &str, name: &str, node: &str, spec: Value) -> Value {
    let resource = node_labels::node_feature_resource();
    json!({
        "apiVersion": resource.api_version,
        "kind": resource.kind,
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {NFD_NODE_LABEL: node, OWNER_LABEL: OWNER},
        },
        "spec": spec,
    })
}

/// Deletes the object `name` through `objects` if there is one.
async fn delete_if_there(objects: &Api<DynamicObject>, name: &str) {
    match objects.delete(name, &DeleteParams::default()).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 404 => {}
        Err(e) => panic!("delete NodeFeature {name}: {e}"),
    }
}

#[cfg_attr(
    any(no_api_server, no_helm_rendered),
    ignore = "needs an API server and the rendered chart: set KUBEBUILDER_ASSETS and DEVPLUG_HELM_RENDERED (docs/testing.md)"
)]
#[tokio::test]
async fn the_charts_node_feature_permissions_are_scoped_to_the_nodes_own_object() {
    let Some(admin) = admin("node_labels_rbac").await else {
        return;
    };
    let server = ApiServer::shared("node_labels_rbac").unwrap();
    install_node_feature_crd(&admin).await;
    let docs = permissions(
        "node-labels-nfd",
        "devplug-node-labels",
        &["Role", "RoleBinding"],
    );
    let policy = permissions(
        "node-labels-nfd",
        "devplug-node-features",
        &[
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
        ],
    );
    rendered::apply_permissions(&admin, &docs).await;
    rendered::apply_permissions(&admin, &policy).await;
    let (namespace, account) = rendered::bound_account(&docs, "devplug-node-labels");
    let namespace = namespace.as_str();
    assert_eq!(namespace, "kube-system");

    let nodes: Api<Node> = Api::all(admin.clone());
    let node_a = new_node(&nodes, "nfd-a").await;
    let node_b = new_node(&nodes, "nfd-b").await;
    let accounts = Api::namespaced(admin.clone(), namespace);
    let a = client_for_token(
        server,
        "nfd-node-a",
        &node_token(&accounts, &account, Some(&node_a)).await,
    )
    .await;
    let resource = node_labels::node_feature_resource();
    let objects: Api<DynamicObject> = Api::namespaced_with(admin.clone(), namespace, &resource);
    let as_a: Api<DynamicObject> = Api::namespaced_with(a.clone(), namespace, &resource);

    // The policy takes effect once the API server has loaded it: devplug's own start-up probe
    // says when.
    let probe = Probe {
        client: a.clone(),
        node: node_a.clone(),
        namespace: namespace.to_owned(),
        pod: None,
    };
    in_force(&probe, Feature::NodeFeatures).await;

    let name_a = node_labels::node_feature_name(&node_a);
    let name_b = node_labels::node_feature_name(&node_b);
    let gpu = json!({"labels": {"nvidia.com/gpu.product": "NVIDIA-H100"}});
    let create = |doc: Value| -> DynamicObject { serde_json::from_value(doc).unwrap() };
    let post = PostParams::default();
    let ssa = PatchParams::apply(FIELD_MANAGER).force();
    let p = PatchParams::default();
    let own_with = |spec: Value| node_feature(namespace, &name_a, &node_a, spec);
    // What node A must not write into an object of its own, created or updated.
    let forbidden_content = [
        (
            "a label outside the vendors' prefixes",
            json!({"labels": {"example.com/x": "y"}}),
        ),
        (
            "the GPU operator's deploy label",
            json!({"labels": {"nvidia.com/gpu.deploy.operands": "false"}}),
        ),
        (
            "NFD features",
            json!({"labels": {}, "features": {"attributes": {"cpu.model": {"elements": {"vendor_id": "X"}}}}}),
        ),
    ];
    let mut t = Attempts::default();

    // --- creates, before node A's object exists (one let through is deleted again, so that
    // each create is tried on its own) ---
    t.refused(
        "node A creates node B's object",
        as_a.create(
            &post,
            &create(node_feature(namespace, &name_b, &node_b, gpu.clone())),
        )
        .await,
    );
    t.refused(
        "node A creates its own object pointed at node B",
        as_a.create(
            &post,
            &create(node_feature(namespace, &name_a, &node_b, gpu.clone())),
        )
        .await,
    );
    delete_if_there(&objects, &name_a).await;
    for (what, spec) in &forbidden_content {
        t.refused(
            &format!("node A creates its own object with {what}"),
            as_a.create(&post, &create(own_with(spec.clone()))).await,
        );
        delete_if_there(&objects, &name_a).await;
    }

    // --- node B's object, written by someone else ---
    let b_spec = json!({"labels": {"nvidia.com/gpu.product": "NVIDIA-B200"}});
    objects
        .patch(
            &name_b,
            &PatchParams::apply("test").force(),
            &Patch::Apply(node_feature(namespace, &name_b, &node_b, b_spec.clone())),
        )
        .await
        .unwrap();
    t.refused(
        "node A adds a label to node B's object",
        as_a.patch(
            &name_b,
            &p,
            &Patch::Merge(json!({"spec": {"labels": {"nvidia.com/gpu.count": "8"}}})),
        )
        .await,
    );
    t.refused(
        "node A applies node B's object",
        as_a.patch(
            &name_b,
            &ssa,
            &Patch::Apply(node_feature(namespace, &name_b, &node_b, gpu.clone())),
        )
        .await,
    );
    t.refused(
        "node A deletes node B's object",
        as_a.delete(&name_b, &DeleteParams::default()).await,
    );

    // --- node A's own object ---
    let labels = |product: &str| -> devplug_cluster::node_labels::NodeLabels {
        [("nvidia.com/gpu.product".to_owned(), product.to_owned())]
            .into_iter()
            .collect()
    };
    t.allowed(
        "node A creates its own object",
        node_labels::apply_node_feature(&a, namespace, &node_a, &labels("NVIDIA-H100")).await,
    );
    t.allowed(
        "node A updates its own object",
        node_labels::apply_node_feature(&a, namespace, &node_a, &labels("NVIDIA-H200")).await,
    );
    t.refused(
        "node A points its own object at node B",
        as_a.patch(
            &name_a,
            &p,
            &Patch::Merge(json!({"metadata": {"labels": {NFD_NODE_LABEL: node_b}}})),
        )
        .await,
    );
    // Pointed back at node A, should that have been let through.
    objects
        .patch(
            &name_a,
            &p,
            &Patch::Merge(json!({"metadata": {"labels": {NFD_NODE_LABEL: node_a}}})),
        )
        .await
        .unwrap();
    for (what, spec) in &forbidden_content {
        t.refused(
            &format!("node A updates its own object with {what}"),
            as_a.patch(&name_a, &ssa, &Patch::Apply(own_with(spec.clone())))
                .await,
        );
    }
    let own_before = objects.get(&name_a).await.unwrap();
    let removed = node_labels::remove_node_feature(&a, namespace, Some(&node_a)).await;
    t.allowed("node A deletes its own object", removed.as_ref());

    t.assert_all_right();
    // Node A's object held what it applied last, and is gone; node B's is as it was written.
    assert_eq!(
        own_before.data["spec"],
        json!({"labels": labels("NVIDIA-H200")})
    );
    assert_eq!(
        own_before
            .metadata
            .labels
            .unwrap_or_default()
            .get(NFD_NODE_LABEL),
        Some(&node_a)
    );
    assert_eq!(removed.unwrap(), vec![name_a.clone()]);
    assert!(objects.get_opt(&name_a).await.unwrap().is_none());
    let b = objects.get(&name_b).await.unwrap();
    assert_eq!(b.data["spec"], b_spec);
    assert_eq!(
        b.metadata.labels.unwrap_or_default().get(NFD_NODE_LABEL),
        Some(&node_b)
    );
}
