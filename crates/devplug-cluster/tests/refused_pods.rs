//! Pods the kubelet refused at admission, dealt with against a real kube-apiserver
//! (`KUBEBUILDER_ASSETS`): the pods are made as the kubelet leaves them (bound to the node,
//! status Failed, `UnexpectedAdmissionError` with the device manager's message), their
//! controllers named by owner references. Without `KUBEBUILDER_ASSETS` the test is ignored.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use devplug_cluster::refused_pods::{Policy, RefusedPods, NODE_REASON, POD_REASON};
use devplug_testkit::api_server::{admin, new_node, until};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Patch, PatchParams, PostParams};
use kube::Api;
use serde_json::json;
use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::time::Duration;

const NPU: &str = "example.com/npu";

fn refused_message(resource: &str) -> String {
    format!(
        "Allocate failed due to cannot allocate unregistered device {resource}, which is unexpected"
    )
}

/// Creates pod `name` on `node` asking for `resource`, owned by `owner` (kind, uid), with
/// `labels`; then sets its status to `phase` with `reason` and `message`, as the kubelet does.
#[allow(clippy::too_many_arguments)]
async fn pod(
    pods: &Api<Pod>,
    node: &str,
    name: &str,
    resource: &str,
    owner: Option<(&str, &str)>,
    labels: serde_json::Value,
    status: serde_json::Value,
) {
    let owners: Vec<_> = owner
        .into_iter()
        .map(|(kind, uid)| {
            let api_version = if kind == "Job" { "batch/v1" } else { "apps/v1" };
            json!({"apiVersion": api_version, "kind": kind, "name": format!("{}-owner", kind.to_lowercase()),
                   "uid": uid, "controller": true})
        })
        .collect();
    let object: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels, "ownerReferences": owners},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox",
            "resources": {"limits": {resource: "1"}}}]}
    }))
    .unwrap();
    pods.create(&PostParams::default(), &object).await.unwrap();
    pods.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": status})),
    )
    .await
    .unwrap();
}

fn refused(resource: &str) -> serde_json::Value {
    json!({"phase": "Failed", "reason": "UnexpectedAdmissionError",
           "message": refused_message(resource)})
}

async fn exists(pods: &Api<Pod>, name: &str) -> bool {
    pods.get_opt(name).await.unwrap().is_some()
}

/// The events with `reason` about the object named `name` in `namespace`.
async fn events(client: &kube::Client, namespace: &str, name: &str, reason: &str) -> Vec<Event> {
    Api::<Event>::namespaced(client.clone(), namespace)
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| {
            e.reason.as_deref() == Some(reason)
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
        })
        .collect()
}

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test]
async fn refused_pods_are_deleted_when_replaced_and_reported_when_nothing_replaces_them() {
    let Some(client) = admin("refused_pods").await else {
        return;
    };
    let nodes: Api<Node> = Api::all(client.clone());
    let node = new_node(&nodes, "refused").await;
    let namespace = format!("refused-{}", devplug_testkit::api_server::rand_u32());
    Api::<Namespace>::all(client.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": namespace}})).unwrap(),
        )
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    let rs_labels = json!({"app": "web", "pod-template-hash": "abc"});
    // Refused for our resource: a ReplicaSet's (not yet replaced), a StatefulSet's, a Job's, a
    // bare pod. Left alone: refused for another plugin's resource, failed for another reason,
    // and one whose message names our resource though it does not ask for it.
    pod(
        &pods,
        &node,
        "web-1",
        NPU,
        Some(("ReplicaSet", "rs-uid")),
        rs_labels.clone(),
        refused(NPU),
    )
    .await;
    pod(
        &pods,
        &node,
        "db-0",
        NPU,
        Some(("StatefulSet", "ss-uid")),
        json!({"app": "db"}),
        refused(NPU),
    )
    .await;
    pod(
        &pods,
        &node,
        "train-x",
        NPU,
        Some(("Job", "job-uid")),
        json!({"job": "train"}),
        refused(NPU),
    )
    .await;
    pod(&pods, &node, "bare", NPU, None, json!({}), refused(NPU)).await;
    pod(
        &pods,
        &node,
        "gpu-1",
        "nvidia.com/gpu",
        Some(("ReplicaSet", "rs2-uid")),
        json!({"app": "gpu"}),
        refused("nvidia.com/gpu"),
    )
    .await;
    pod(
        &pods,
        &node,
        "crashed",
        NPU,
        Some(("ReplicaSet", "rs-uid")),
        rs_labels.clone(),
        json!({"phase": "Failed", "reason": "Error", "message": "exit code 1"}),
    )
    .await;
    pod(
        &pods,
        &node,
        "other-ask",
        "example.com/other",
        None,
        json!({}),
        refused(NPU),
    )
    .await;

    let stop = tokio_util::sync::CancellationToken::new();
    let served: BTreeSet<String> = [NPU.to_owned()].into();
    let watcher = RefusedPods::spawn(
        client.clone(),
        node.clone(),
        "test".into(),
        Policy::DeleteReplaced,
        served.clone(),
        stop.clone(),
    );

    // The StatefulSet's pod goes at once; its controller makes it again.
    until(
        "the StatefulSet's refused pod deleted",
        Duration::from_secs(20),
        || async { (!exists(&pods, "db-0").await).then_some(()) },
    )
    .await;
    // The bare and Job pods are reported: an event on each, one on the Node naming both.
    for name in ["train-x", "bare"] {
        let got = until(
            &format!("the event on {name}"),
            Duration::from_secs(20),
            || async {
                let found = events(&client, &namespace, name, POD_REASON).await;
                (!found.is_empty()).then_some(found)
            },
        )
        .await;
        let note = got[0].note.clone().unwrap_or_default();
        assert!(
            note.contains(NPU) && note.contains("host service"),
            "{note}"
        );
        assert_eq!(got[0].type_.as_deref(), Some("Warning"));
    }
    let on_node = until("the Node event", Duration::from_secs(20), || async {
        let found = events(&client, "default", &node, NODE_REASON).await;
        (!found.is_empty()).then_some(found)
    })
    .await;
    let note = on_node[0].note.clone().unwrap_or_default();
    // Counts by namespace: the Node's events are read by other tenants, so no pod is named.
    assert!(
        note.contains(&format!("2 in {namespace}"))
            && !note.contains("train-x")
            && !note.contains("bare"),
        "{note}"
    );
    // The ReplicaSet's pod waits for its replacement.
    assert!(
        exists(&pods, "web-1").await,
        "deleted before it was replaced"
    );
    pod(
        &pods,
        &node,
        "web-2",
        NPU,
        Some(("ReplicaSet", "rs-uid")),
        rs_labels,
        json!({"phase": "Pending"}),
    )
    .await;
    until(
        "the replaced pod deleted",
        Duration::from_secs(20),
        || async { (!exists(&pods, "web-1").await).then_some(()) },
    )
    .await;
    assert_eq!(watcher.counters().deleted.load(Ordering::Relaxed), 2);
    assert_eq!(watcher.counters().reported.load(Ordering::Relaxed), 2);
    let requests = watcher.counters().api_requests.load(Ordering::Relaxed);
    // A watch of the node's failed pods, one of the ReplicaSet's pods, two deletes, two event
    // reads and three event writes.
    assert!((9..=12).contains(&requests), "{requests} API requests");
    stop.cancel();

    // A devplug started again (no reboot) deletes nothing and reports nothing again.
    let stop = tokio_util::sync::CancellationToken::new();
    let again = RefusedPods::spawn(
        client.clone(),
        node.clone(),
        "test-2".into(),
        Policy::DeleteReplaced,
        served,
        stop.clone(),
    );
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(again.counters().deleted.load(Ordering::Relaxed), 0);
    assert_eq!(again.counters().reported.load(Ordering::Relaxed), 0);
    for name in ["train-x", "bare", "gpu-1", "crashed", "other-ask", "web-2"] {
        assert!(exists(&pods, name).await, "{name} was deleted");
    }
    for name in ["train-x", "bare"] {
        assert_eq!(
            events(&client, &namespace, name, POD_REASON).await.len(),
            1,
            "{name}"
        );
    }
    for name in ["gpu-1", "crashed", "other-ask", "web-2"] {
        assert!(
            events(&client, &namespace, name, POD_REASON)
                .await
                .is_empty(),
            "{name}"
        );
    }
    stop.cancel();
}

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test]
async fn with_report_only_nothing_is_deleted() {
    let Some(client) = admin("refused_pods_report").await else {
        return;
    };
    let nodes: Api<Node> = Api::all(client.clone());
    let node = new_node(&nodes, "refused-report").await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let name = format!("ss-{}", devplug_testkit::api_server::rand_u32());
    pod(
        &pods,
        &node,
        &name,
        NPU,
        Some(("StatefulSet", "ss-r")),
        json!({}),
        refused(NPU),
    )
    .await;
    let stop = tokio_util::sync::CancellationToken::new();
    let watcher = RefusedPods::spawn(
        client.clone(),
        node,
        "test".into(),
        Policy::Report,
        [NPU.to_owned()].into(),
        stop.clone(),
    );
    until("the report", Duration::from_secs(20), || async {
        (!events(&client, "default", &name, POD_REASON)
            .await
            .is_empty())
        .then_some(())
    })
    .await;
    assert!(exists(&pods, &name).await);
    assert_eq!(watcher.counters().deleted.load(Ordering::Relaxed), 0);
    stop.cancel();
}
