//! The fleet's ResourceSlices: waiting until every node's driver has published, and counting
//! them at the API server.

use super::node::SimNode;
use anyhow::Context;
use futures_util::future::join_all;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::Api;
use std::time::{Duration, Instant};

/// Waits until every node's driver has published its slices; returns how long it took.
pub(super) async fn all_published(nodes: &[SimNode], limit: Duration) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let waits = nodes.iter().filter_map(|n| n.driver.as_ref()).map(|d| {
        let mut rx = d.slices().published();
        async move {
            rx.wait_for(|p| p.as_ref().is_some_and(|p| p.devices > 0))
                .await
                .is_ok()
        }
    });
    let done = tokio::time::timeout(limit, join_all(waits))
        .await
        .context("not every node published its slices in time")?;
    anyhow::ensure!(done.iter().all(|ok| *ok), "a publisher stopped");
    Ok(started.elapsed())
}

/// The slices at the API server.
pub(super) async fn slice_count(client: &kube::Client) -> anyhow::Result<usize> {
    Ok(Api::<ResourceSlice>::all(client.clone())
        .list_metadata(&Default::default())
        .await?
        .items
        .len())
}
