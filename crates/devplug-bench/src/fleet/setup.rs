//! The fleet's setup: the control plane ([`start_plane`]), then the cluster the nodes join: the
//! workload's DeviceClass and claim template, a Node object for each simulated node, and their
//! leases renewed as kubelets renew them.

use super::api_count::ClientFactory;
use super::figures::report;
use super::{node, workload, FleetOptions, Mode, DRIVER};
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
    /// The scheduler's metrics port (`None`: no scheduler runs).
    pub scheduler_port: Option<u16>,
}

/// Starts the control plane: the API server's in-flight limits raised for hundreds of nodes;
/// the controller manager (claims from templates, Jobs, the node lifecycle, garbage
/// collection) and, when `scheduler`, the scheduler, both at the client rate and burst `rate`
/// (`None`: their own defaults).
pub async fn start_plane(rate: Option<(u32, u32)>, scheduler: bool) -> anyhow::Result<Plane> {
    let rate: Vec<String> = rate.map_or_else(Vec::new, |(qps, burst)| {
        vec![
            format!("--kube-api-qps={qps}"),
            format!("--kube-api-burst={burst}"),
        ]
    });
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
    let mut controllers = vec![
        "--controllers=resourceclaim-controller,job-controller,node-lifecycle-controller,garbage-collector-controller,pod-garbage-collector-controller".to_owned(),
    ];
    controllers.extend(rate.iter().cloned());
    plane
        .start_controller_manager(&controllers)
        .map_err(anyhow::Error::msg)?;
    let mut scheduler_port = None;
    if scheduler {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let mut args = vec![
            format!("--secure-port={port}"),
            "--bind-address=127.0.0.1".into(),
            "--authorization-always-allow-paths=/metrics,/healthz,/readyz,/livez".into(),
        ];
        args.extend(rate.iter().cloned());
        plane
            .start_scheduler_with(&args)
            .map_err(anyhow::Error::msg)?;
        scheduler_port = Some(port);
    }
    Ok(Plane {
        plane,
        dir,
        scheduler_port,
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
    let plane = start_plane(options.control_plane_rate, options.mode != Mode::Driver).await?;
    let kubeconfig = plane.plane.server().kubeconfig.clone();
    let admin = api_server::client(&kubeconfig)
        .await
        .map_err(anyhow::Error::msg)?;
    let (scheduler, manager) = match options.control_plane_rate {
        Some((qps, burst)) => {
            let rate = format!("{qps} requests/s, burst {burst}");
            (rate.clone(), rate)
        }
        None => (
            "its default client rate (50 requests/s, burst 100)".to_owned(),
            "its default client rate (20 requests/s, burst 30)".to_owned(),
        ),
    };
    report(
        "mode",
        format!(
            "{}: {n} nodes, {} devices each, variant {:?}; {}; kube-controller-manager at {manager}",
            options.mode.name(),
            options.devices,
            options.variant,
            if options.mode == Mode::Driver {
                "no kube-scheduler (the bench allocates and binds)".to_owned()
            } else {
                format!("kube-scheduler at {scheduler}")
            }
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
