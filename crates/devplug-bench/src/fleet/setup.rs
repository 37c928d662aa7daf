//! The fleet's setup: the control plane ([`start_plane`]), then the cluster the nodes join: the
//! workload's DeviceClass and claim template, a Node object for each simulated node, and their
//! leases renewed as kubelets renew them.

use super::api_count::ClientFactory;
use super::figures::report;
use super::{node, workload, FleetOptions, DRIVER};
use anyhow::Context;
use devplug_testkit::api_server::{self, ControlPlane};
use futures_util::StreamExt;
use std::path::PathBuf;
use tokio::task::JoinHandle;

/// The control plane of a run, with what reads its metrics.
pub struct Plane {
    /// etcd, kube-apiserver, kube-controller-manager, kube-scheduler.
    pub plane: ControlPlane,
    /// Its folder.
    pub dir: tempfile::TempDir,
    /// The scheduler's metrics port.
    pub scheduler_port: u16,
}

/// Starts the control plane: the API server's in-flight limits raised for hundreds of nodes,
/// the controller manager and scheduler with the client rates scalability tests give them.
pub async fn start_plane(qps: u32) -> anyhow::Result<Plane> {
    let rate = [
        format!("--kube-api-qps={qps}"),
        format!("--kube-api-burst={}", qps.saturating_mul(2)),
    ];
    let assets = api_server::assets_or_skip("devplug-bench fleet")
        .context("devplug-bench fleet needs KUBEBUILDER_ASSETS (docs/testing.md, \"Tests against a real API server\")")?;
    let dir = tempfile::Builder::new()
        .prefix("devplug-fleet-plane-")
        .tempdir()?;
    let mut plane = ControlPlane::start_with(
        &assets,
        dir.path(),
        &[
            "--max-requests-inflight=1000".into(),
            "--max-mutating-requests-inflight=500".into(),
        ],
    )
    .await
    .map_err(anyhow::Error::msg)?;
    plane
        .start_controller_manager(&[
            "--controllers=resourceclaim-controller,node-lifecycle-controller,garbage-collector-controller,pod-garbage-collector-controller".into(),
            rate[0].clone(),
            rate[1].clone(),
        ])
        .map_err(anyhow::Error::msg)?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    plane
        .start_scheduler_with(&[
            format!("--secure-port={port}"),
            "--bind-address=127.0.0.1".into(),
            "--authorization-always-allow-paths=/metrics,/healthz,/readyz,/livez".into(),
            rate[0].clone(),
            rate[1].clone(),
        ])
        .map_err(anyhow::Error::msg)?;
    Ok(Plane {
        plane,
        dir,
        scheduler_port: port,
    })
}

/// The control plane and the cluster the simulated nodes join (their fields in the order they
/// are dropped: the control plane last).
pub(super) struct Cluster {
    /// The task renewing every node's lease.
    pub(super) leases: JoinHandle<()>,
    /// The stand-ins' own client: the leases, the pod watch, claim reads and status patches.
    pub(super) kubelet_clients: ClientFactory,
    /// The nodes' names.
    pub(super) names: Vec<String>,
    /// The admin's client (the workload's, and the checks').
    pub(super) admin: kube::Client,
    /// The admin's kubeconfig.
    pub(super) kubeconfig: PathBuf,
    /// The control plane.
    pub(super) plane: Plane,
}

/// Starts the control plane and makes the cluster of `options.nodes` nodes: the workload's
/// objects, a Node object for each, their leases renewed from now on.
pub(super) async fn start(options: &FleetOptions) -> anyhow::Result<Cluster> {
    let n = options.nodes;
    let plane = start_plane(options.control_plane_qps).await?;
    let kubeconfig = plane.plane.server().kubeconfig.clone();
    let admin = api_server::client(&kubeconfig)
        .await
        .map_err(anyhow::Error::msg)?;
    report(
        "nodes",
        format!(
            "{n}, {} devices each, variant {:?}; kube-scheduler and kube-controller-manager at {} requests/s",
            options.devices, options.variant, options.control_plane_qps
        ),
    );

    workload::prepare(&admin, DRIVER, options.variant).await?;
    let names: Vec<String> = (0..n).map(|i| format!("fleet-node-{i:04}")).collect();
    {
        let mut creates = futures_util::stream::iter(&names)
            .map(|name| node::create_node(&admin, name))
            .buffer_unordered(16);
        while let Some(result) = creates.next().await {
            result?;
        }
    }
    // The stand-ins' own client: the leases, the pod watch, claim reads and status patches.
    let kubelet_clients = ClientFactory::new(&kubeconfig, "devplug-fleet-kubelet").await?;
    let leases = tokio::spawn(node::renew_leases(kubelet_clients.client()?, names.clone()));
    Ok(Cluster {
        leases,
        kubelet_clients,
        names,
        admin,
        kubeconfig,
        plane,
    })
}
