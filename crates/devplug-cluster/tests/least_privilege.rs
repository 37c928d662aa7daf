//! Every cluster writer of the chart, tried as an attacker holding one node's token would: the
//! rendered `all-options` release's service accounts, roles, bindings and admission policies
//! (the uninstall hook's too) applied to a real kube-apiserver, then pod-bound tokens of two
//! nodes and of the uninstall Job. Each write that must be refused is refused by an admission
//! policy; each write a feature needs is allowed; and the start-up self-check
//! (`devplug_cluster::policy_check`) tells a policy in force from one whose binding is gone.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

mod support;

use devplug_cluster::policy_check::{Feature, PolicyState, Probe};
use devplug_testkit::api_server::{
    admin, client_for_token, new_node, node_token, until, ApiServer,
};
use devplug_testkit::rendered;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::Api;
use serde_json::{json, Value};
use support::{in_force, Attempts, WAIT};

const NAMESPACE: &str = "kube-system";

/// What a node looks like before the attack: a label and annotation of someone else, an
/// address, a Ready condition, the capacity of a device resource and of the advertised one.
async fn dress(nodes: &Api<Node>, node: &str) {
    let meta = json!({"metadata": {
        "labels": {"example.com/keep": "yes", "nvidia.com/gpu.deploy.operands": "true"},
        "annotations": {"example.com/note": "keep"},
    }});
    nodes
        .patch(node, &PatchParams::default(), &Patch::Merge(&meta))
        .await
        .unwrap();
    let status = json!({"status": {
        "capacity": {"cpu": "4", "memory": "8Gi", "example.com/a": "2", "example.com/dongle": "4"},
        "allocatable": {"cpu": "4", "memory": "8Gi", "example.com/a": "2", "example.com/dongle": "4"},
        "addresses": [{"type": "InternalIP", "address": "192.0.2.10"}],
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                        "message": "kubelet is posting ready status",
                        "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                        "lastTransitionTime": "2026-01-01T00:00:00Z"}],
    }});
    nodes
        .patch_status(node, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
}

/// A pod `name` on `node` in `phase`, with `reason` (`UnexpectedAdmissionError`: refused at
/// admission).
async fn pod(pods: &Api<Pod>, name: &str, node: &str, phase: &str, reason: Option<&str>) {
    let object: Pod = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox",
            "resources": {"limits": {"example.com/a": "1"}}}]}
    }))
    .unwrap();
    pods.create(&PostParams::default(), &object).await.unwrap();
    let mut status = json!({"phase": phase});
    if let Some(reason) = reason {
        status["reason"] = json!(reason);
        status["message"] = json!("Allocate failed due to no healthy devices present");
    }
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
async fn each_token_writes_only_its_own_nodes_objects_and_fields() {
    let Some(admin) = admin("least_privilege").await else {
        return;
    };
    let server = ApiServer::shared("least_privilege").unwrap();
    let docs = rendered::release("all-options");
    rendered::apply_permissions(&admin, &docs).await;
    let (namespace, account) = rendered::bound_account(&docs, "devplug-advertise");
    assert_eq!(namespace, NAMESPACE);
    let (_, uninstall_account) = rendered::bound_account(&docs, "devplug-uninstall");

    let nodes: Api<Node> = Api::all(admin.clone());
    let node_a = new_node(&nodes, "lp-a").await;
    let node_b = new_node(&nodes, "lp-b").await;
    dress(&nodes, &node_a).await;
    dress(&nodes, &node_b).await;
    let accounts = Api::namespaced(admin.clone(), NAMESPACE);
    let a = client_for_token(
        server,
        "lp-node-a",
        &node_token(&accounts, &account, Some(&node_a)).await,
    )
    .await;
    let hook = client_for_token(
        server,
        "lp-uninstall",
        &node_token(&accounts, &uninstall_account, Some(&node_a)).await,
    )
    .await;
    // devplug's own pod on node A, the one the refused-pods probe aims at.
    let admin_pods: Api<Pod> = Api::namespaced(admin.clone(), NAMESPACE);
    pod(&admin_pods, "devplug-lp", &node_a, "Running", None).await;

    // Each policy takes effect once the API server has loaded it: the self-check's own probes
    // say when.
    let probe = Probe {
        client: a.clone(),
        node: node_a.clone(),
        namespace: NAMESPACE.to_owned(),
        pod: Some("devplug-lp".to_owned()),
    };
    for feature in [
        Feature::Advertise,
        Feature::NodeLabels,
        Feature::RefusedPods,
        Feature::DraSlices,
    ] {
        in_force(&probe, feature).await;
    }
    let as_hook: Api<Node> = Api::all(hook.clone());
    let hook_probe = Probe {
        client: hook.clone(),
        node: node_b.clone(),
        namespace: NAMESPACE.to_owned(),
        pod: None,
    };
    in_force(&hook_probe, Feature::Uninstall).await;

    let as_a: Api<Node> = Api::all(a.clone());
    let mut t = Attempts::default();
    let merge = |v: Value| Patch::Merge(v);
    let p = PatchParams::default();

    // --- node A's token through nodes/status (the advertise role) ---
    let other_node_capacity = json!({"status": {"capacity": {"example.com/dongle": "64"}}});
    t.refused(
        "node A sets node B's advertised capacity",
        as_a.patch_status(&node_b, &p, &merge(other_node_capacity))
            .await,
    );
    for (what, change) in [
        (
            "a vendor label",
            json!({"metadata": {"labels": {"nvidia.com/gpu.count": "8"}}}),
        ),
        (
            "any label",
            json!({"metadata": {"labels": {"example.com/role": "gpu"}}}),
        ),
        (
            "an annotation",
            json!({"metadata": {"annotations": {"example.com/note": "changed"}}}),
        ),
        (
            "its addresses",
            json!({"status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.99"}]}}),
        ),
    ] {
        t.refused(
            &format!("node A changes {what} of node B through its status"),
            as_a.patch_status(&node_b, &p, &merge(change)).await,
        );
    }
    for (what, change) in [
        (
            "a label outside the vendors' prefixes",
            json!({"metadata": {"labels": {"example.com/role": "gpu"}}}),
        ),
        (
            "a vendor label",
            json!({"metadata": {"labels": {"nvidia.com/gpu.count": "8"}}}),
        ),
        (
            "its addresses",
            json!({"status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.99"}]}}),
        ),
        (
            "the capacity of a resource it does not advertise",
            json!({"status": {"capacity": {"example.com/a": "99"}}}),
        ),
        (
            "a new resource",
            json!({"status": {"capacity": {"example.com/free": "99"}, "allocatable": {"example.com/free": "99"}}}),
        ),
        ("the cpu", json!({"status": {"allocatable": {"cpu": "64"}}})),
    ] {
        t.refused(
            &format!("node A changes {what} of its own Node through its status"),
            as_a.patch_status(&node_a, &p, &merge(change)).await,
        );
    }
    let not_ready =
        json!([{"op": "replace", "path": "/status/conditions/0/status", "value": "False"}]);
    t.refused(
        "node A marks its own Node not Ready",
        as_a.patch_status(
            &node_a,
            &p,
            &Patch::Json::<()>(serde_json::from_value(not_ready).unwrap()),
        )
        .await,
    );
    t.allowed(
        "node A advertises its own resource",
        devplug_cluster::capacity::set(&as_a, &node_a, "example.com/dongle", 3).await,
    );

    // --- node A's token on Nodes (the node-labels role) ---
    let apply = |labels: Value, node: &str| json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": labels}});
    let ssa = PatchParams::apply("devplug-node-labels").force();
    t.refused(
        "node A labels node B under a vendor prefix",
        as_a.patch(
            &node_b,
            &ssa,
            &Patch::Apply(apply(json!({"nvidia.com/gpu.count": "8"}), &node_b)),
        )
        .await,
    );
    for (what, labels) in [
        (
            "a label outside the vendors' prefixes",
            json!({"example.com/role": "gpu"}),
        ),
        (
            "the GPU operator's deploy label",
            json!({"nvidia.com/gpu.deploy.operands": "false"}),
        ),
        (
            "the GPU operator's MIG config label",
            json!({"nvidia.com/mig.config": "all-1g.10gb"}),
        ),
    ] {
        t.refused(
            &format!("node A sets {what} on its own Node"),
            as_a.patch(&node_a, &ssa, &Patch::Apply(apply(labels, &node_a)))
                .await,
        );
    }
    t.refused(
        "node A cordons its own Node",
        as_a.patch(
            &node_a,
            &p,
            &merge(json!({"spec": {"unschedulable": true}})),
        )
        .await,
    );
    t.refused(
        "node A taints node B",
        as_a.patch(
            &node_b,
            &p,
            &merge(json!({"spec": {"taints": [{"key": "x", "effect": "NoSchedule"}]}})),
        )
        .await,
    );
    t.allowed(
        "node A writes its GPU labels",
        devplug_cluster::node_labels::apply_direct(
            &as_a,
            &node_a,
            &[(
                "nvidia.com/gpu.product".to_owned(),
                "NVIDIA-H100".to_owned(),
            )]
            .into_iter()
            .collect(),
        )
        .await,
    );

    // --- node A's token on pods (the refused-pods role) ---
    pod(
        &admin_pods,
        "a-failed-other",
        &node_a,
        "Failed",
        Some("Error"),
    )
    .await;
    pod(
        &admin_pods,
        "b-refused",
        &node_b,
        "Failed",
        Some("UnexpectedAdmissionError"),
    )
    .await;
    pod(
        &admin_pods,
        "a-refused",
        &node_a,
        "Failed",
        Some("UnexpectedAdmissionError"),
    )
    .await;
    let pods_as_a: Api<Pod> = Api::namespaced(a.clone(), NAMESPACE);
    let d = DeleteParams::default();
    t.refused(
        "node A deletes a pod of its node that failed for another reason",
        pods_as_a.delete("a-failed-other", &d).await,
    );
    t.refused(
        "node A deletes a refused pod of node B",
        pods_as_a.delete("b-refused", &d).await,
    );
    t.refused(
        "node A deletes a running pod of its node",
        pods_as_a.delete("devplug-lp", &d).await,
    );
    t.allowed(
        "node A deletes a pod of its node refused at admission",
        pods_as_a.delete("a-refused", &d).await,
    );

    // --- the uninstall hook's token ---
    for (what, change) in [
        (
            "adds a label",
            json!({"metadata": {"labels": {"nvidia.com/gpu.count": "8"}}}),
        ),
        (
            "removes another tool's label",
            json!({"metadata": {"labels": {"example.com/keep": null}}}),
        ),
        (
            "removes the GPU operator's label",
            json!({"metadata": {"labels": {"nvidia.com/gpu.deploy.operands": null}}}),
        ),
        (
            "taints",
            json!({"spec": {"taints": [{"key": "x", "effect": "NoSchedule"}]}}),
        ),
    ] {
        t.refused(
            &format!("the uninstall {what} on node B"),
            as_hook.patch(&node_b, &p, &merge(change)).await,
        );
    }
    for (what, change) in [
        (
            "changes the addresses",
            json!({"status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.99"}]}}),
        ),
        (
            "adds capacity",
            json!({"status": {"capacity": {"example.com/a": "99"}}}),
        ),
        (
            "removes the cpu",
            json!({"status": {"capacity": {"cpu": null}, "allocatable": {"cpu": null}}}),
        ),
        (
            "changes a label",
            json!({"metadata": {"labels": {"example.com/keep": "no"}}}),
        ),
    ] {
        t.refused(
            &format!("the uninstall {what} of node B through its status"),
            as_hook.patch_status(&node_b, &p, &merge(change)).await,
        );
    }
    t.allowed(
        "the uninstall removes a device resource",
        devplug_cluster::capacity::remove(&as_hook, &node_b, "example.com/a").await,
    );
    t.allowed(
        "the uninstall removes an advertised resource",
        devplug_cluster::capacity::remove(&as_hook, &node_b, "example.com/dongle").await,
    );
    t.allowed(
        "the uninstall removes devplug's labels",
        devplug_cluster::node_labels::remove_direct(&as_hook, &node_a).await,
    );

    t.assert_all_right();
    // Nothing of node B changed but what the uninstall removed.
    let b = nodes.get(&node_b).await.unwrap();
    let labels = b.metadata.labels.clone().unwrap_or_default();
    assert_eq!(
        labels.get("example.com/keep").map(String::as_str),
        Some("yes")
    );
    assert!(!labels.contains_key("nvidia.com/gpu.count"), "{labels:?}");
    let a_labels = nodes
        .get(&node_a)
        .await
        .unwrap()
        .metadata
        .labels
        .unwrap_or_default();
    assert!(
        !a_labels.contains_key("nvidia.com/gpu.product"),
        "the uninstall left {a_labels:?}"
    );
    assert_eq!(
        a_labels
            .get("nvidia.com/gpu.deploy.operands")
            .map(String::as_str),
        Some("true")
    );

    // The self-check: with the advertise policy's binding deleted, the probe finds nothing in
    // force, and says so.
    let bindings: Api<
        k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicyBinding,
    > = Api::all(admin.clone());
    bindings
        .delete("devplug-advertise", &DeleteParams::default())
        .await
        .unwrap();
    let missing = until("the advertise policy missing", WAIT, || async {
        match probe.check(Feature::Advertise).await {
            PolicyState::Missing(why) => Some(why),
            _ => None,
        }
    })
    .await;
    assert!(missing.contains("accepted"), "{missing}");
    // The others are still in force.
    assert_eq!(probe.check(Feature::NodeLabels).await, PolicyState::InForce);
    assert_eq!(probe.check(Feature::DraSlices).await, PolicyState::InForce);
    // And the DRA slices' policy, its binding deleted: the probe's slice of another node is
    // accepted (a dry run: nothing is created).
    bindings
        .delete("devplug-dra-slices", &DeleteParams::default())
        .await
        .unwrap();
    let missing = until("the DRA slices policy missing", WAIT, || async {
        match probe.check(Feature::DraSlices).await {
            PolicyState::Missing(why) => Some(why),
            _ => None,
        }
    })
    .await;
    assert!(missing.contains("ResourceSlice"), "{missing}");
    let slices: Api<k8s_openapi::api::resource::v1::ResourceSlice> = Api::all(admin.clone());
    assert!(
        slices
            .get_opt("devplug-policy-probe")
            .await
            .unwrap()
            .is_none(),
        "the probe created a slice"
    );
}
