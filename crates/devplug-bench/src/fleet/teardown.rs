//! The teardown: every pod deleted, every claim unprepared exactly once (and prepared exactly
//! once), every driver stopped, no ResourceSlice left; then the stand-ins' figures.

use super::cold_start::Fleet;
use super::figures::{fmt, report};
use super::kubelet::Kubelets;
use super::node::{self, SimNode};
use super::setup::Cluster;
use super::slices::slice_count;
use super::workload;
use futures_util::future::join_all;
use futures_util::StreamExt;
use kube::Api;
use std::time::Duration;

/// Tears the fleet down and stops the control plane; fails when a claim is left prepared, was
/// prepared or unprepared other than once, or a slice is left.
pub(super) async fn run(cluster: Cluster, fleet: Fleet, kubelets: Kubelets) -> anyhow::Result<()> {
    let Cluster {
        leases,
        kubelet_clients,
        admin,
        plane,
        names,
        target,
        shared,
        ..
    } = cluster;
    let Fleet {
        mut nodes,
        sampler_task,
        ..
    } = fleet;
    // Teardown: every Job and pod deleted, every claim unprepared once, no slice left.
    let deleting = std::time::Instant::now();
    workload::delete_jobs(&admin, &target).await?;
    let pods_api: Api<k8s_openapi::api::core::v1::Pod> =
        Api::namespaced(admin.clone(), &target.namespace);
    pods_api
        .delete_collection(&Default::default(), &Default::default())
        .await?;
    // The controllers delete what is left at their client rate (the claims made from templates
    // go one request each, 20 a second at kube-controller-manager's default): allow for it.
    let prepared = kubelets.observed.prepared().len();
    let limit = Duration::from_secs(300).saturating_add(Duration::from_millis(
        u64::try_from(prepared)
            .unwrap_or(u64::MAX)
            .saturating_mul(100),
    ));
    workload::wait_empty(&admin, &target, limit).await?;
    report(
        "teardown: every Job and pod deleted → every pod and claim gone",
        fmt(deleting.elapsed()),
    );
    let mut leftovers = 0;
    for node in &nodes {
        if let Some(driver) = &node.driver {
            leftovers += driver.prepared().await.len();
        }
    }
    if leftovers > 0 {
        let failures = kubelets.observed.failures();
        anyhow::bail!(
            "{leftovers} claims still prepared after every pod is gone; the kubelet stand-ins' \
             failed calls ({}): {:?}",
            failures.len(),
            &failures[..failures.len().min(8)]
        );
    }
    {
        let prepared = kubelets.observed.prepared();
        let unprepared = kubelets.observed.unprepared();
        let twice: Vec<_> = prepared
            .iter()
            .filter(|(_, (count, _))| *count != 1)
            .collect();
        anyhow::ensure!(
            twice.is_empty(),
            "claims prepared more than once: {:?}",
            &twice[..twice.len().min(5)]
        );
        let wrong: Vec<_> = prepared
            .keys()
            .filter(|uid| unprepared.get(*uid) != Some(&1))
            .collect();
        anyhow::ensure!(
            wrong.is_empty(),
            "{} claims not unprepared exactly once",
            wrong.len()
        );
        report(
            "claims prepared (each once, each unprepared once)",
            prepared.len(),
        );
    }
    let failures = kubelets.observed.failures();
    kubelets.stop();
    leases.abort();
    let stops = join_all(nodes.iter_mut().map(SimNode::remove_driver)).await;
    let problems: Vec<String> = stops.into_iter().flatten().collect();
    anyhow::ensure!(problems.is_empty(), "driver shutdown: {problems:?}");
    let left = slice_count(&admin, &names).await?;
    anyhow::ensure!(
        left == 0,
        "{left} ResourceSlices left after every driver stopped"
    );
    report("teardown: ResourceSlices left", left);
    report(
        "kubelet stand-in calls that failed and were retried",
        failures.len(),
    );
    if !failures.is_empty() {
        report(
            "kubelet stand-in calls that failed, the first",
            format!("{:?}", &failures[..failures.len().min(3)]),
        );
    }
    report("kubelet stand-ins' API requests in all (leases, pod watch, claim reads, status patches, final deletes)", kubelet_clients.count().get());
    sampler_task.abort();
    if shared {
        // An existing cluster keeps no trace of the run: its Nodes, their leases and its
        // namespace go (the DeviceClass stays for other shards).
        let mut removals = futures_util::stream::iter(&names)
            .map(|name| node::remove_node(&admin, name))
            .buffer_unordered(16);
        while let Some(result) = removals.next().await {
            result?;
        }
        let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(admin.clone());
        namespaces
            .delete(&target.namespace, &Default::default())
            .await?;
        report(
            "teardown: simulated Nodes removed from the cluster",
            names.len(),
        );
    }
    drop(plane);
    Ok(())
}
