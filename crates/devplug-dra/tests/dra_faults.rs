//! The DRA driver's slices when the cluster has a bad day, against a control plane of each
//! test's own (etcd and kube-apiserver from `KUBEBUILDER_ASSETS`): an API server outage during
//! which the devices change, and an etcd restored empty (the API server restarted on it, as a
//! restore does) with the Node created again. Each prints its recovery time as a `figure:`
//! line; `DEVPLUG_DRA_OUTAGE_S` sets the outage's length (default 3 s). The outage's publisher
//! has the chart's DRA permissions alone (the rendered chart, `DEVPLUG_HELM_RENDERED`).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use devplug::{Device, DeviceList};
use devplug_dra::slices::SlicePublisher;
use devplug_testkit::api_server;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{ListParams, PostParams};
use kube::Api;
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const DRIVER: &str = "npu.example.com";
const NODE: &str = "etcd-wipe-node";

async fn create_node(nodes: &Api<Node>) -> String {
    let node: Node = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE},
    }))
    .unwrap();
    let created = nodes.create(&PostParams::default(), &node).await.unwrap();
    created.metadata.uid.unwrap()
}

/// A publisher of three devices for `NODE`, once they are published; and its device list.
async fn publishing(client: &kube::Client) -> (watch::Sender<DeviceList>, SlicePublisher) {
    let list = DeviceList::new((0..3).map(|i| Device::new(format!("npu-{i}"))));
    let (tx, rx) = watch::channel(list.clone());
    let publisher =
        SlicePublisher::spawn(client.clone(), DRIVER, NODE, rx, &CancellationToken::new()).unwrap();
    tokio::time::timeout(Duration::from_secs(30), publisher.wait_published(&list))
        .await
        .unwrap()
        .unwrap();
    (tx, publisher)
}

/// Our slices, listed (`None` while the API server does not answer): polled, as after an etcd
/// wipe a watch of the test's own would have the same trouble as the one under test.
async fn our_slices(api: &Api<ResourceSlice>) -> Option<Vec<ResourceSlice>> {
    let fields = format!("spec.nodeName={NODE},spec.driver={DRIVER}");
    let listed = api
        .list(&ListParams::default().fields(&fields))
        .await
        .ok()?;
    Some(listed.items)
}

/// Our slices' (owner UID, device count).
async fn ours(api: &Api<ResourceSlice>) -> Option<(String, usize)> {
    let listed = our_slices(api).await?;
    let owner = listed
        .first()?
        .metadata
        .owner_references
        .as_ref()?
        .first()?
        .uid
        .clone();
    let devices = listed
        .iter()
        .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
        .sum();
    Some((owner, devices))
}

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test]
async fn slices_come_back_after_an_etcd_wipe_and_a_new_node() {
    let Some((_dir, mut plane, client)) =
        api_server::own_control_plane("slices_come_back_after_an_etcd_wipe").await
    else {
        return;
    };
    // The publisher's log, shown when the test fails.
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_max_level(tracing::Level::DEBUG)
        .try_init();
    let nodes: Api<Node> = Api::all(client.clone());
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let first_uid = create_node(&nodes).await;
    let (_tx, publisher) = publishing(&client).await;
    assert_eq!(ours(&slices).await, Some((first_uid, 3)));

    let wiped = Instant::now();
    plane.restore_empty().await.unwrap();
    let restored = wiped.elapsed();
    // The node's kubelet creates its Node again: a new object.
    let second_uid = create_node(&nodes).await;
    let node_back = Instant::now();
    let deadline = wiped + Duration::from_secs(60);
    let mut now = ours(&slices).await;
    while now.as_ref() != Some(&(second_uid.clone(), 3)) {
        assert!(
            Instant::now() < deadline,
            "no slice owned by the new Node 60 s after the etcd wipe: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        now = ours(&slices).await;
    }
    println!(
        "figure: etcd restored empty and the API server restarted ({:.1} s), Node created again → our slices back, owned by it: {:.2} s (resyncs: {})",
        restored.as_secs_f64(),
        node_back.elapsed().as_secs_f64(),
        publisher
            .counters()
            .resyncs
            .load(std::sync::atomic::Ordering::Relaxed)
    );
    drop(publisher);
    plane.stop();
}

/// Our slices' device names, sorted.
async fn device_names(api: &Api<ResourceSlice>) -> Option<Vec<String>> {
    let mut names: Vec<String> = our_slices(api)
        .await?
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten().map(|d| d.name.clone()))
        .collect();
    names.sort();
    Some(names)
}

/// A client with the chart's DRA permissions alone, as a node's devplug has them: the `dra`
/// release's DRA role, its binding and the slices' admission policy applied with `admin`, and
/// a token of its service account bound to `NODE` (which must exist).
async fn on_the_charts_dra_role(
    admin: &kube::Client,
    plane: &api_server::ControlPlane,
) -> kube::Client {
    let (accounts, account) = devplug_testkit::rendered::apply_dra_role(admin).await;
    let token = api_server::node_token(&accounts, &account, Some(NODE)).await;
    api_server::client_for_token(plane.server(), "node", &token).await
}

/// An API server outage while a device leaves, under the chart's DRA role: once the server
/// answers, the change is published. The role lists and watches Nodes but may not get one, so
/// this also shows that nothing the publisher needs to come back is refused to it.
#[cfg_attr(
    any(no_api_server, no_helm_rendered),
    ignore = "needs an API server and the rendered chart: set KUBEBUILDER_ASSETS and DEVPLUG_HELM_RENDERED (docs/testing.md)"
)]
#[tokio::test]
async fn a_change_during_an_api_server_outage_is_published_when_it_answers() {
    let Some((_dir, mut plane, admin)) =
        api_server::own_control_plane("a_change_during_an_api_server_outage").await
    else {
        return;
    };
    let outage = std::env::var("DEVPLUG_DRA_OUTAGE_S")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(Duration::from_secs(3), Duration::from_secs);
    let nodes: Api<Node> = Api::all(admin.clone());
    let slices: Api<ResourceSlice> = Api::all(admin.clone());
    create_node(&nodes).await;
    let client = on_the_charts_dra_role(&admin, &plane).await;
    let (tx, publisher) = publishing(&client).await;

    plane.stop_api_server().unwrap();
    // A device leaves while the API server is away: the publish fails and is retried.
    tx.send_replace(DeviceList::new(
        (0..2).map(|i| Device::new(format!("npu-{i}"))),
    ));
    tokio::time::sleep(outage).await;
    let failures = || {
        publisher
            .counters()
            .consecutive_failures
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    assert!(
        failures() > 0,
        "the failed publish is counted (probes read it)"
    );
    plane.start_api_server().await.unwrap();
    let back = Instant::now();
    let want = Some(vec!["npu-0".to_owned(), "npu-1".to_owned()]);
    let mut now = device_names(&slices).await;
    while now != want {
        assert!(
            back.elapsed() < Duration::from_secs(60),
            "the change is not published 60 s after the API server came back: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
        now = device_names(&slices).await;
    }
    for _ in 0..100 {
        if failures() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(failures(), 0, "a publish that worked clears the count");
    println!(
        "figure: API server outage of {:.0} s with a device change → slices right {:.2} s after the API server was ready again",
        outage.as_secs_f64(),
        back.elapsed().as_secs_f64()
    );
    drop(publisher);
    plane.stop();
}
