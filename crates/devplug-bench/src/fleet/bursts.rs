//! The driver mode: no scheduler; the bench does its part. For each burst, one node after the
//! other: a claim for each of the node's devices (one device each, allocated on that node by
//! the bench, as the scheduler writes an allocation) and a pod of each claim, made beforehand;
//! then every pod bound to the node at once (a `Binding` each, as the scheduler binds), so the
//! node's kubelet stand-in prepares them all together. Measured: binding → Running, the
//! `NodePrepareResources` round trip, and the driver's own account of its calls
//! (`driver_calls`, from the counters its `/metrics` exports).

use super::cold_start::Fleet;
use super::figures::{percentiles, report};
use super::kubelet::Kubelets;
use super::node::SimNode;
use super::setup::Cluster;
use super::{mode, workload, FleetOptions, DRIVER};
use anyhow::Context;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Patch, PatchParams, PostParams};
use kube::Api;
use serde_json::json;
use std::time::{Duration, Instant};

/// The scheduler name of the bench's pods: no scheduler binds them but the bench.
const BOUND_BY: &str = "devplug-bench";

/// Runs `options.bursts` bursts (at most one a node), each on the next node; fails when a
/// burst's pods are not all Running in time.
pub(super) async fn run(
    options: &FleetOptions,
    cluster: &Cluster,
    fleet: &Fleet,
    kubelets: &Kubelets,
    created: &workload::Created,
) -> anyhow::Result<()> {
    let admin = &cluster.admin;
    let bursts = options.bursts.min(fleet.nodes.len());
    let size = mode::DRIVER_BURST.min(options.devices);
    let prepares_before = kubelets
        .observed
        .prepare_times
        .lock()
        .map_or(0, |t| t.len());
    let mut running = kubelets.running.clone();
    let mut names = Vec::with_capacity(bursts.saturating_mul(size));
    let started = Instant::now();
    for (round, node) in fleet.nodes.iter().take(bursts).enumerate() {
        let burst: Vec<String> = (0..size).map(|k| format!("burst-{round:04}-{k}")).collect();
        let made = futures_util::future::try_join_all(
            burst
                .iter()
                .enumerate()
                .map(|(k, name)| make_pod(admin, &cluster.target, node, name, k)),
        )
        .await?;
        anyhow::ensure!(
            made.len() == burst.len(),
            "a burst's pods were not all made"
        );
        let bound = futures_util::future::try_join_all(
            burst
                .iter()
                .map(|name| bind(admin, &cluster.target, created, name, &node.name)),
        );
        bound.await?;
        names.extend(burst);
        let want = names.len();
        let done = tokio::time::timeout(Duration::from_secs(60), running.wait_for(|r| *r >= want))
            .await
            .is_ok_and(|r| r.is_ok());
        if !done {
            let failures = kubelets.observed.failures();
            anyhow::bail!(
                "burst {round} on {}: {} of {want} pods Running after 60 s; failures: {:?}",
                node.name,
                *running.borrow(),
                &failures[..failures.len().min(5)]
            );
        }
    }
    report(
        "bursts",
        format!(
            "{bursts} bursts of {size} pods, each on its own node, one after the other, in {:.1} s",
            started.elapsed().as_secs_f64()
        ),
    );
    let (mut latencies, missing) = workload::latencies(created, &kubelets.observed.running, &names);
    anyhow::ensure!(missing == 0, "{missing} burst pods never Running");
    report(
        &format!("bursts: pod startup (bound → Running, {size} pods on one node at once)"),
        percentiles(&mut latencies),
    );
    let mut times = kubelets
        .observed
        .prepare_times
        .lock()
        .map(|t| t[prepares_before.min(t.len())..].to_vec())
        .unwrap_or_default();
    report(
        "bursts: NodePrepareResources round trip (1 claim; the stand-in's clock)",
        percentiles(&mut times),
    );
    Ok(())
}

/// Makes claim `name` (one device of the fleet's class) allocated device `dev-<device>` on
/// `node`, and pod
/// `name` of that claim, not bound yet; the claim reserved for the pod, as the scheduler
/// leaves it before binding. Returns the pod's UID.
async fn make_pod(
    admin: &kube::Client,
    target: &workload::Target,
    node: &SimNode,
    name: &str,
    device: usize,
) -> anyhow::Result<String> {
    let device = format!("dev-{device}");
    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), &target.namespace);
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": { "devices": { "requests": [{ "name": "dev", "exactly": { "deviceClassName": "fleet" } }] } },
    }))?;
    claims
        .create(&PostParams::default(), &claim)
        .await
        .with_context(|| format!("create claim {name}"))?;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &target.namespace);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": name, "labels": { "app": "fleet" } },
        "spec": {
            "schedulerName": BOUND_BY,
            "containers": [{ "name": "c", "image": "registry.k8s.io/pause:3.10",
                "resources": { "requests": { "cpu": "10m", "memory": "16Mi" }, "claims": [{ "name": "dev" }] } }],
            "resourceClaims": [{ "name": "dev", "resourceClaimName": name }],
        },
    }))?;
    let pod = pods
        .create(&PostParams::default(), &pod)
        .await
        .with_context(|| format!("create pod {name}"))?;
    let uid = pod.metadata.uid.unwrap_or_default();
    let status = json!({ "status": {
        "allocation": {
            "devices": { "results": [{ "request": "dev", "driver": DRIVER, "pool": node.name, "device": device }] },
            "nodeSelector": { "nodeSelectorTerms": [{ "matchFields": [
                { "key": "metadata.name", "operator": "In", "values": [node.name] }] }] },
        },
        "reservedFor": [{ "resource": "pods", "name": name, "uid": uid }],
    } });
    claims
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .with_context(|| format!("allocate claim {name}"))?;
    Ok(uid)
}

/// Binds pod `name` to `node` as the scheduler does, noting when.
async fn bind(
    admin: &kube::Client,
    target: &workload::Target,
    created: &workload::Created,
    name: &str,
    node: &str,
) -> anyhow::Result<()> {
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &target.namespace);
    let binding = json!({
        "apiVersion": "v1", "kind": "Binding",
        "metadata": { "name": name },
        "target": { "apiVersion": "v1", "kind": "Node", "name": node },
    });
    if let Ok(mut c) = created.lock() {
        c.insert(name.to_owned(), Instant::now());
    }
    pods.create_subresource::<serde_json::Value, serde_json::Value>(
        "binding",
        name,
        &PostParams::default(),
        &binding,
    )
    .await
    .with_context(|| format!("bind pod {name} to {node}"))?;
    Ok(())
}
