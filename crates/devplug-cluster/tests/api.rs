//! Against a real kube-apiserver (`KUBEBUILDER_ASSETS`, started once for this binary): node
//! capacity set/list/remove with RFC 6901 escaping, "already gone", the clean-uninstall recipe,
//! `advertise` re-applied and removed, RBAC of the uninstall Job's account, Node events. Each test
//! creates its own Node. Without `KUBEBUILDER_ASSETS` each test prints SKIPPED and returns.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use devplug_cluster::capacity::{self, Removed};
use devplug_testkit::api_server::{admin, new_node};
use k8s_openapi::api::core::v1::Node;
use kube::Api;

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test]
async fn set_list_and_remove_with_escaping() {
    let Some(client) = admin("set_list_and_remove_with_escaping").await else {
        return;
    };
    let nodes: Api<Node> = Api::all(client);
    let node = new_node(&nodes, "capacity").await;

    capacity::set(&nodes, &node, "example.com/dongle", 4)
        .await
        .unwrap();
    capacity::set(&nodes, &node, "vendor.example/gpu-mem", 16)
        .await
        .unwrap();
    let listed = capacity::list(&nodes, &node).await.unwrap();
    assert_eq!(listed["example.com/dongle"].capacity.as_deref(), Some("4"));
    assert_eq!(
        listed["example.com/dongle"].allocatable.as_deref(),
        Some("4")
    );
    assert_eq!(listed.len(), 2, "{listed:?}");
    // The node's other resources are untouched.
    let raw = nodes.get_status(&node).await.unwrap();
    assert_eq!(raw.status.unwrap().capacity.unwrap()["cpu"].0, "4");

    capacity::set(&nodes, &node, "example.com/dongle", 2)
        .await
        .unwrap();
    assert_eq!(
        capacity::list(&nodes, &node).await.unwrap()["example.com/dongle"]
            .capacity
            .as_deref(),
        Some("2")
    );
    assert_eq!(
        capacity::remove(&nodes, &node, "example.com/dongle")
            .await
            .unwrap(),
        Removed::Removed
    );
    assert_eq!(
        capacity::remove(&nodes, &node, "example.com/dongle")
            .await
            .unwrap(),
        Removed::AlreadyGone
    );
    let left = capacity::list(&nodes, &node).await.unwrap();
    assert!(!left.contains_key("example.com/dongle"));
    assert!(left.contains_key("vendor.example/gpu-mem"));

    // `~` travels as `~0` and `/` as `~1`: the server decodes the pointer back to the exact
    // name (the API server does not restrict the characters of node capacity keys).
    capacity::set(&nodes, &node, "example.com/a~b", 1)
        .await
        .unwrap();
    let listed = capacity::list(&nodes, &node).await.unwrap();
    assert_eq!(
        listed["example.com/a~b"].capacity.as_deref(),
        Some("1"),
        "{listed:?}"
    );
    assert!(
        !listed.keys().any(|k| k.contains("~0") || k.contains("~1")),
        "{listed:?}"
    );
    assert_eq!(
        capacity::remove(&nodes, &node, "example.com/a~b")
            .await
            .unwrap(),
        Removed::Removed
    );
    let left = capacity::list(&nodes, &node).await.unwrap();
    assert_eq!(left.keys().collect::<Vec<_>>(), ["vendor.example/gpu-mem"]);
}

/// Writes what a kubelet writes for a device plugin resource: capacity and allocatable `value`.
async fn kubelet_writes(nodes: &Api<Node>, node: &str, resource: &str, value: &str) {
    let status = serde_json::json!({"status": {
        "capacity": {resource: value},
        "allocatable": {resource: value},
    }});
    nodes
        .patch_status(
            node,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&status),
        )
        .await
        .unwrap();
}

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test]
async fn clean_uninstall_waits_for_zero_removes_and_rechecks() {
    use devplug_cluster::capacity::{CleanError, CleanOptions};
    use std::time::{Duration, Instant};
    let Some(client) = admin("clean_uninstall_waits_for_zero_removes_and_rechecks").await else {
        return;
    };
    let nodes: Api<Node> = Api::all(client);
    let node = new_node(&nodes, "uninstall").await;
    const R: &str = "example.com/gone";

    // A plugin still serving: the recipe refuses to remove it.
    kubelet_writes(&nodes, &node, R, "2").await;
    let quick = CleanOptions {
        wait_for_zero: Duration::from_millis(500),
        recheck_after: Duration::from_millis(500),
        attempts: 3,
    };
    let err = capacity::clean(&nodes, &node, R, quick).await.unwrap_err();
    assert!(matches!(err, CleanError::NotZero { .. }), "{err}");
    assert!(capacity::list(&nodes, &node).await.unwrap().contains_key(R));

    // The plugin is gone; 1.5 s later its grace is over and the kubelet writes 0. After our
    // first removal a restarting kubelet puts the 0 back once, from its checkpoint.
    let kubelet = {
        let (nodes, node) = (nodes.clone(), node.clone());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            kubelet_writes(&nodes, &node, R, "0").await;
            loop {
                if !capacity::list(&nodes, &node).await.unwrap().contains_key(R) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            kubelet_writes(&nodes, &node, R, "0").await;
        })
    };
    let options = CleanOptions {
        wait_for_zero: Duration::from_secs(20),
        recheck_after: Duration::from_secs(1),
        attempts: 3,
    };
    let started = Instant::now();
    let report = capacity::clean(&nodes, &node, R, options).await.unwrap();
    kubelet.await.unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(1500),
        "waited for 0"
    );
    assert_eq!((report.removals, report.came_back), (2, 1));
    let left = capacity::list(&nodes, &node).await.unwrap();
    assert!(!left.contains_key(R), "{left:?}");
    // Already clean: nothing to do.
    let again = capacity::clean(&nodes, &node, R, quick).await.unwrap();
    assert_eq!(again.removals, 0);
}

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test]
async fn advertise_reapplies_after_removal_and_removes_on_config_change() {
    use devplug_cluster::advertise::Advertiser;
    use std::collections::BTreeMap;
    use std::time::Duration;
    let Some(client) =
        admin("advertise_reapplies_after_removal_and_removes_on_config_change").await
    else {
        return;
    };
    let nodes: Api<Node> = Api::all(client.clone());
    let node = new_node(&nodes, "advertise").await;
    let stop = tokio_util::sync::CancellationToken::new();
    let advertiser = Advertiser::spawn(client, node.clone(), stop.clone());

    let wait = |want: Option<&'static str>, resource: &'static str| {
        let (nodes, node) = (nodes.clone(), node.clone());
        async move {
            for _ in 0..200 {
                let now = capacity::list(&nodes, &node).await.unwrap();
                if now.get(resource).and_then(|r| r.capacity.as_deref()) == want {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            panic!("{resource} never became {want:?}");
        }
    };
    advertiser.set(BTreeMap::from([
        ("example.com/dongle".to_owned(), 4),
        ("example.com/licence".to_owned(), 2),
    ]));
    wait(Some("4"), "example.com/dongle").await;
    wait(Some("2"), "example.com/licence").await;

    // Someone removes it (kubectl patch): the watch sees the Node change, it is set again.
    assert_eq!(
        capacity::remove(&nodes, &node, "example.com/dongle")
            .await
            .unwrap(),
        Removed::Removed
    );
    wait(Some("4"), "example.com/dongle").await;
    // Someone changes it: set back.
    capacity::set(&nodes, &node, "example.com/dongle", 9)
        .await
        .unwrap();
    wait(Some("4"), "example.com/dongle").await;

    // The config drops one and changes the other.
    advertiser.set(BTreeMap::from([("example.com/dongle".to_owned(), 3)]));
    wait(None, "example.com/licence").await;
    wait(Some("3"), "example.com/dongle").await;
    let counters = advertiser.counters();
    assert!(counters.applied.load(std::sync::atomic::Ordering::Relaxed) >= 5);
    assert_eq!(
        counters.removed.load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    stop.cancel();
}

/// A backend of fixed devices whose health the test flips.
struct Flip(tokio::sync::watch::Sender<devplug::DeviceList>);

impl devplug::Backend for Flip {
    fn devices(&self) -> tokio::sync::watch::Receiver<devplug::DeviceList> {
        self.0.subscribe()
    }
    fn allocate(&self, _: &[String]) -> Result<devplug::ContainerEdits, devplug::AllocateError> {
        Ok(devplug::ContainerEdits::default())
    }
}

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test]
async fn a_health_flip_becomes_events_on_the_node() {
    use devplug::{Device, DeviceList, Health, Host, ResourceSettings};
    use devplug_cluster::events::NodeEvents;
    use k8s_openapi::api::events::v1::Event;
    use std::sync::Arc;
    use std::time::Duration;
    let Some(client) = admin("a_health_flip_becomes_events_on_the_node").await else {
        return;
    };
    let nodes: Api<Node> = Api::all(client.clone());
    let node = new_node(&nodes, "events").await;
    let dir = tempfile::tempdir().unwrap();
    let kubelet = kubelet_sim::Kubelet::start(dir.path()).await.unwrap();
    let host = Host::new(dir.path()).unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let events = NodeEvents::spawn(client.clone(), node.clone(), "test".into(), stop.clone());
    events.forward(host.events());
    let list = tokio::sync::watch::Sender::new(DeviceList::new([
        Device::new("npu-0"),
        Device::new("npu-1"),
    ]));
    let backend = Arc::new(Flip(list.clone()));
    let settings = ResourceSettings {
        health_hold_down: Duration::ZERO,
        ..Default::default()
    };
    host.add_with("example.com/npu", backend, settings).unwrap();
    kubelet
        .wait_for(Duration::from_secs(10), |n| {
            (n.capacity("example.com/npu") == (2, 2)).then_some(())
        })
        .await
        .unwrap();
    list.send_modify(|l| {
        l.set_health("npu-1", Health::unhealthy("fan stuck at 0 rpm"));
    });
    kubelet
        .wait_for(Duration::from_secs(10), |n| {
            (n.capacity("example.com/npu") == (2, 1)).then_some(())
        })
        .await
        .unwrap();
    list.send_modify(|l| {
        l.set_health("npu-1", Health::Healthy);
    });

    let on_node = Api::<Event>::namespaced(client, "default");
    let mut seen = Vec::new();
    for _ in 0..100 {
        seen = on_node
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(node.as_str()))
            .map(|e| {
                (
                    e.type_.unwrap_or_default(),
                    e.reason.unwrap_or_default(),
                    e.note.unwrap_or_default(),
                )
            })
            .collect::<Vec<_>>();
        if seen.iter().any(|(_, r, _)| r == "DeviceRecovered") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        seen.iter().any(|(t, r, n)| t == "Warning"
            && r == "DeviceUnhealthy"
            && n == "example.com/npu device npu-1 is unhealthy: fan stuck at 0 rpm"),
        "{seen:?}"
    );
    assert!(
        seen.iter()
            .any(|(t, r, _)| t == "Normal" && r == "DeviceRecovered"),
        "{seen:?}"
    );
    assert!(seen.iter().any(|(_, r, _)| r == "Registered"), "{seen:?}");
    host.shutdown().await;
    stop.cancel();
}
