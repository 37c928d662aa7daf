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

/// The control plane of a run, with what reads its metrics; empty where the run uses an
/// existing cluster (`--kubeconfig`), whose control plane it neither starts nor measures.
pub struct Plane {
    /// etcd, kube-apiserver, kube-controller-manager, kube-scheduler.
    pub plane: Option<ControlPlane>,
    /// Its folder.
    pub dir: Option<tempfile::TempDir>,
    /// The scheduler's metrics port (`None`: no scheduler runs, or not the run's own).
    pub scheduler_port: Option<u16>,
    /// The controller manager's metrics port (`None`: not the run's own).
    pub controller_manager_port: Option<u16>,
}

impl Plane {
    /// The folder of the run's own control plane (its processes are found by it).
    pub fn dir(&self) -> Option<&std::path::Path> {
        self.dir.as_ref().map(tempfile::TempDir::path)
    }
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
    let manager_port = free_port()?;
    let mut controllers = vec![
        "--controllers=resourceclaim-controller,job-controller,node-lifecycle-controller,garbage-collector-controller,pod-garbage-collector-controller".to_owned(),
        format!("--secure-port={manager_port}"),
        "--bind-address=127.0.0.1".into(),
        "--authorization-always-allow-paths=/metrics,/healthz".into(),
    ];
    controllers.extend(rate.iter().cloned());
    plane
        .start_controller_manager(&controllers)
        .map_err(anyhow::Error::msg)?;
    let mut scheduler_port = None;
    if scheduler {
        let port = free_port()?;
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
        plane: Some(plane),
        dir: Some(dir),
        scheduler_port,
        controller_manager_port: Some(manager_port),
    })
}

/// A port nothing listens on now, for a component's metrics.
fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
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
    /// Where the workload goes.
    pub(super) target: workload::Target,
    /// Whether the cluster is an existing one, whose Nodes and namespace the run removes at
    /// its end.
    pub(super) shared: bool,
    /// The control plane.
    pub(super) plane: Plane,
}

/// The names of the simulated nodes of a run: `fleet-node-<k>` for each k of the fleet's
/// `nodes`, or of them the ones of `shard` (k modulo its count is its index).
pub fn node_names(nodes: usize, shard: Option<super::Shard>) -> Vec<String> {
    (0..nodes)
        .filter(|k| shard.is_none_or(|s| k % s.count == s.index))
        .map(|k| format!("fleet-node-{k:04}"))
        .collect()
}

/// Starts the control plane and makes the cluster of `options.nodes` nodes: the workload's
/// objects, a Node object for each, their leases renewed from now on.
pub(super) async fn start(options: &FleetOptions) -> anyhow::Result<Cluster> {
    let names = node_names(options.nodes, options.shard);
    let n = names.len();
    anyhow::ensure!(
        n > 0,
        "this shard has no nodes: give --nodes at least the shard count"
    );
    let (plane, kubeconfig) = match &options.kubeconfig {
        Some(path) => (
            Plane {
                plane: None,
                dir: None,
                scheduler_port: None,
                controller_manager_port: None,
            },
            path.clone(),
        ),
        None => {
            let plane =
                start_plane(options.control_plane_rate, options.mode != Mode::Driver).await?;
            let kubeconfig = plane
                .plane
                .as_ref()
                .map(|p| p.server().kubeconfig.clone())
                .context("the control plane has no API server")?;
            (plane, kubeconfig)
        }
    };
    let admin = api_server::client(&kubeconfig)
        .await
        .map_err(anyhow::Error::msg)
        .with_context(|| format!("connect with {}", kubeconfig.display()))?;
    let shared = options.kubeconfig.is_some();
    let target = match options.shard {
        Some(shard) => workload::Target {
            namespace: format!("{}-{}", workload::NAMESPACE, shard.index),
            group: Some(format!("shard-{}", shard.index)),
        },
        None if shared => workload::Target {
            namespace: workload::NAMESPACE.to_owned(),
            group: Some("all".to_owned()),
        },
        None => workload::Target::own(),
    };
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
    if shared {
        report(
            "mode",
            format!(
                "{}: {n} nodes{}, {} devices each, variant {:?}; against the cluster of {} (its control plane as it is, not measured); the workload in namespace {}",
                options.mode.name(),
                options.shard.map_or_else(String::new, |s| format!(" (shard {} of {} of a fleet of {})", s.index, s.count, options.nodes)),
                options.devices,
                options.variant,
                kubeconfig.display(),
                target.namespace,
            ),
        );
    } else {
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
    }

    workload::prepare(&admin, &target, DRIVER, options.variant).await?;
    {
        let mut creates = futures_util::stream::iter(&names)
            .map(|name| node::create_node(&admin, name, target.group.as_deref()))
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
        target,
        shared,
        plane,
    })
}
