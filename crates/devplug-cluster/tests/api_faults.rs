//! `advertise:` across an API server restart, against a control plane of this test's own
//! (etcd and kube-apiserver from `KUBEBUILDER_ASSETS`): capacity removed by someone right after
//! the API server came back is set again at once, not after the watch's backoff. Prints the
//! repair time as a `figure:` line.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use devplug_cluster::advertise::Advertiser;
use devplug_cluster::capacity::{self, Removed};
use devplug_testkit::api_server::{self, new_node};
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const RESOURCE: &str = "example.com/dongle";

/// Waits until `RESOURCE`'s capacity on `node` is `want` (60 s at most); how long it took.
async fn wait_for(nodes: &Api<Node>, node: &str, want: Option<&str>) -> Duration {
    let started = Instant::now();
    loop {
        let now = capacity::list(nodes, node).await.ok();
        let got = now
            .as_ref()
            .and_then(|n| n.get(RESOURCE))
            .and_then(|r| r.capacity.as_deref());
        if now.is_some() && got == want {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{RESOURCE} on {node} is not {want:?} after 60 s: {got:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test]
async fn advertised_capacity_removed_after_an_api_server_restart_is_repaired_at_once() {
    let Some((_dir, mut plane, client)) =
        api_server::own_control_plane("advertise_after_an_api_server_restart").await
    else {
        return;
    };
    let nodes: Api<Node> = Api::all(client.clone());
    let node = new_node(&nodes, "advertise-restart").await;
    let stop = tokio_util::sync::CancellationToken::new();
    let advertiser = Advertiser::spawn(client, node.clone(), stop.clone());
    advertiser.set(BTreeMap::from([(RESOURCE.to_owned(), 4)]));
    wait_for(&nodes, &node, Some("4")).await;

    plane.stop_api_server().unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    plane.start_api_server().await.unwrap();
    // Someone removes it as soon as the API server is back.
    assert_eq!(
        capacity::remove(&nodes, &node, RESOURCE).await.unwrap(),
        Removed::Removed
    );
    let took = wait_for(&nodes, &node, Some("4")).await;
    println!(
        "figure: advertised capacity removed right after an API server restart → set again in {:.2} s",
        took.as_secs_f64()
    );
    stop.cancel();
    plane.stop();
}
