//! Node labels against a real kube-apiserver (`KUBEBUILDER_ASSETS`): in direct mode devplug's
//! labels are set, updated, put back when removed by hand and removed, while labels another
//! manager set (under the same vendor prefix too) stay; in node-feature mode the NodeFeature
//! object NFD reads is written, updated and deleted (NFD's CRD installed by the test, from
//! `tests/node_labels/nodefeature-crd.yaml`). Without `KUBEBUILDER_ASSETS` each test prints
//! SKIPPED and returns.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

mod support;

use devplug_cluster::node_labels::NodeLabels;
use devplug_cluster::node_labels::{self, Mode, NodeLabeler, FIELD_MANAGER};
use devplug_testkit::api_server::{admin, new_node, until};
use k8s_openapi::api::core::v1::Node;
use kube::api::{DynamicObject, Patch, PatchParams};
use kube::Api;
use std::time::Duration;
use support::install_node_feature_crd;

const WAIT: Duration = Duration::from_secs(10);

fn labels(pairs: &[(&str, &str)]) -> NodeLabels {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

async fn node_labels_of(nodes: &Api<Node>, node: &str) -> NodeLabels {
    nodes
        .get(node)
        .await
        .unwrap()
        .metadata
        .labels
        .unwrap_or_default()
}

/// Waits until the Node's labels under `nvidia.com/` are exactly `want`.
async fn until_ours(nodes: &Api<Node>, node: &str, want: &NodeLabels, others: &NodeLabels) {
    until(&format!("labels {want:?}"), WAIT, || async {
        let now = node_labels_of(nodes, node).await;
        let ours: NodeLabels = now
            .iter()
            .filter(|(k, _)| !others.contains_key(*k) && k.starts_with("nvidia.com/"))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        (ours == *want).then_some(())
    })
    .await;
}

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test]
async fn direct_mode_sets_updates_and_removes_only_its_labels() {
    let Some(client) = admin("direct_mode_sets_updates_and_removes_only_its_labels").await else {
        return;
    };
    let nodes: Api<Node> = Api::all(client.clone());
    let node = new_node(&nodes, "labels").await;
    // Another tool's labels, one under the same vendor prefix.
    let others = labels(&[
        ("example.com/keep", "yes"),
        ("nvidia.com/gpu.deploy.operands", "false"),
    ]);
    let patch = serde_json::json!({ "metadata": { "labels": others } });
    nodes
        .patch(&node, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();

    let labeler = NodeLabeler::spawn(client.clone(), node.clone(), Mode::Direct);
    let first = labels(&[
        ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"),
        ("nvidia.com/gpu.count", "8"),
    ]);
    labeler.set(first.clone());
    until_ours(&nodes, &node, &first, &others).await;
    let owned = node_labels::owned_keys(&nodes.get(&node).await.unwrap());
    assert_eq!(
        owned,
        first.keys().cloned().collect(),
        "the keys our manager owns"
    );

    // A GPU lost and MIG capability: updated in place.
    let second = labels(&[
        ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"),
        ("nvidia.com/gpu.count", "7"),
        ("nvidia.com/mig.capable", "true"),
    ]);
    labeler.set(second.clone());
    until_ours(&nodes, &node, &second, &others).await;

    // A key left out is removed from the Node.
    let third = labels(&[
        ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"),
        ("nvidia.com/gpu.count", "7"),
    ]);
    labeler.set(third.clone());
    until_ours(&nodes, &node, &third, &others).await;

    // Removed by hand: put back (the watch of our Node).
    let remove = serde_json::json!({ "metadata": { "labels": { "nvidia.com/gpu.count": null } } });
    nodes
        .patch(&node, &PatchParams::default(), &Patch::Merge(&remove))
        .await
        .unwrap();
    until_ours(&nodes, &node, &third, &others).await;
    // The labeler counts a write once the API server has answered it, which may be after the
    // label shows on the Node: wait for the count itself.
    until("the put-back counted", WAIT, || async {
        (labeler
            .counters()
            .applied
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 4)
            .then_some(())
    })
    .await;

    // The uninstall: ours gone, the others' left as they were.
    drop(labeler);
    let removed = node_labels::remove_direct(&nodes, &node).await.unwrap();
    assert_eq!(removed, third.keys().cloned().collect());
    assert_eq!(node_labels_of(&nodes, &node).await, others);
    // Nothing of ours left: the Node is not touched again.
    let before = nodes.get(&node).await.unwrap().metadata.resource_version;
    let removed = node_labels::remove_direct(&nodes, &node).await.unwrap();
    assert!(removed.is_empty());
    assert_eq!(
        nodes.get(&node).await.unwrap().metadata.resource_version,
        before
    );
    let managers: Vec<String> = nodes
        .get(&node)
        .await
        .unwrap()
        .metadata
        .managed_fields
        .unwrap_or_default()
        .into_iter()
        .filter_map(|m| m.manager)
        .collect();
    assert!(
        node_labels::owned_keys(&nodes.get(&node).await.unwrap()).is_empty(),
        "{FIELD_MANAGER} owns no label: {managers:?}"
    );
}

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test]
async fn node_feature_mode_writes_the_object_nfd_reads() {
    let Some(client) = admin("node_feature_mode_writes_the_object_nfd_reads").await else {
        return;
    };
    install_node_feature_crd(&client).await;
    let nodes: Api<Node> = Api::all(client.clone());
    let node = new_node(&nodes, "nfd").await;
    let before = node_labels_of(&nodes, &node).await;
    let namespace = "default";
    let objects: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        namespace,
        &node_labels::node_feature_resource(),
    );
    let name = node_labels::node_feature_name(&node);
    let spec_labels = |o: &DynamicObject| -> NodeLabels {
        serde_json::from_value(o.data["spec"]["labels"].clone()).unwrap_or_default()
    };

    let labeler = NodeLabeler::spawn(
        client.clone(),
        node.clone(),
        Mode::NodeFeature {
            namespace: namespace.into(),
        },
    );
    let first = labels(&[
        ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"),
        ("nvidia.com/gpu.count", "8"),
    ]);
    labeler.set(first.clone());
    let object = until("the NodeFeature object", WAIT, || async {
        objects.get(&name).await.ok()
    })
    .await;
    assert_eq!(spec_labels(&object), first);
    let meta = object.metadata.labels.unwrap_or_default();
    assert_eq!(meta.get(node_labels::NFD_NODE_LABEL), Some(&node));

    let second = labels(&[("nvidia.com/gpu.count", "7")]);
    labeler.set(second.clone());
    until("the NodeFeature object updated", WAIT, || async {
        let o = objects.get(&name).await.ok()?;
        (spec_labels(&o) == second).then_some(())
    })
    .await;
    // NFD's master writes the Node; devplug does not.
    assert_eq!(node_labels_of(&nodes, &node).await, before);

    drop(labeler);
    let deleted = node_labels::remove_node_feature(&client, namespace, Some(&node))
        .await
        .unwrap();
    assert_eq!(deleted, vec![name.clone()]);
    assert!(objects.get_opt(&name).await.unwrap().is_none());
    let again = node_labels::remove_node_feature(&client, namespace, None)
        .await
        .unwrap();
    assert!(again.is_empty(), "{again:?}");
}

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test]
async fn two_writers_of_one_field_manager_settle_instead_of_looping() {
    use std::sync::atomic::Ordering::Relaxed;
    let Some(client) = admin("two_writers_of_one_field_manager_settle_instead_of_looping").await
    else {
        return;
    };
    let nodes: Api<Node> = Api::all(client.clone());
    let node = new_node(&nodes, "fight").await;
    // An old and a new pod of one release during a surge upgrade that changed the label set.
    let old = NodeLabeler::spawn(client.clone(), node.clone(), Mode::Direct);
    let new = NodeLabeler::spawn(client.clone(), node.clone(), Mode::Direct);
    old.set(labels(&[("nvidia.com/gpu.count", "8")]));
    new.set(labels(&[("nvidia.com/gpu.count", "7")]));
    // Wait for the fight itself: put-backs that follow each other.
    until(
        "a fight over the labels",
        Duration::from_secs(30),
        || async {
            (old.counters().fights.load(Relaxed) + new.counters().fights.load(Relaxed) >= 2)
                .then_some(())
        },
    )
    .await;
    let writes = || old.counters().applied.load(Relaxed) + new.counters().applied.load(Relaxed);
    let before = writes();
    // Unbounded, two writers rewrite the Node at round-trip speed: hundreds of writes in 10 s.
    // With the backoff, whose waits double from 1 s, a few.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let during = writes().saturating_sub(before);
    eprintln!("two writers of one field manager: {during} label writes in 10 s");
    assert!(
        during <= 16,
        "{during} label writes in 10 s between two writers of one field manager"
    );
    assert_eq!(old.counters().errors.load(Relaxed), 0);
}

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test]
async fn a_labeler_whose_policy_is_not_in_force_writes_nothing_where_policies_are_required() {
    use devplug_cluster::node_labels::LabelerOptions;
    use devplug_cluster::policy_check::{Gate, PolicyState, Probe};
    let Some(client) = admin("a_labeler_whose_policy_is_not_in_force_writes_nothing").await else {
        return;
    };
    let nodes: Api<Node> = Api::all(client.clone());
    let node = new_node(&nodes, "ungated").await;
    // The admin's token: nothing limits it, as a token whose policy binding was deleted.
    let (tx, mut found) = tokio::sync::mpsc::unbounded_channel();
    let gate = Gate {
        probe: Probe {
            client: client.clone(),
            node: node.clone(),
            namespace: "default".into(),
            pod: None,
        },
        required: true,
        report: std::sync::Arc::new(move |_, state: &PolicyState| {
            let _ = tx.send(state.clone());
        }),
    };
    let options = LabelerOptions {
        events: None,
        gate: Some(gate),
    };
    let labeler = NodeLabeler::spawn_with(client.clone(), node.clone(), Mode::Direct, options);
    labeler.set(labels(&[("nvidia.com/gpu.count", "8")]));
    // Probed twice, found missing twice: the labeler is still at its gate.
    for _ in 0..2 {
        let state = tokio::time::timeout(Duration::from_secs(30), found.recv())
            .await
            .expect("a probe within 30 s")
            .expect("the gate reports");
        assert!(matches!(state, PolicyState::Missing(_)), "{state:?}");
    }
    assert_eq!(
        labeler
            .counters()
            .applied
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    assert!(
        !node_labels_of(&nodes, &node)
            .await
            .contains_key("nvidia.com/gpu.count"),
        "written without its policy"
    );
}
