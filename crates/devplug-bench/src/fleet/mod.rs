//! `devplug-bench fleet`: N simulated nodes in this process against a real control plane
//! (etcd, kube-apiserver, kube-controller-manager for claims from templates and the node
//! lifecycle, kube-scheduler), each node running devplug's real DRA driver ([`node`]) and a
//! kubelet stand-in ([`kubelet`]); clusterloader2's DRA workload ([`workload`]): fill to 90%
//! with pods of one claim each, then churn; then the storms a fleet has ([`storms`]).
//!
//! Every figure is printed as it is measured; correctness (every pod Running, every claim
//! prepared once and unprepared once, no slice left after the drivers stop) is checked and
//! an error returned when it does not hold, so the CI-sized run is a test.
//!
//! [`run`] is the sequence of phases, one a file: `limits` (what the machine must allow),
//! `setup` (the control plane, the workload's objects, the Node objects and their leases),
//! `cold_start` (every driver at once, then the quiet window), `fill`, `churn`,
//! `control_plane` (what the control plane did meanwhile), `storms` and `teardown`;
//! `figures` measures and prints, `slices` waits for and counts the fleet's slices.

mod api_count;
mod churn;
mod cold_start;
mod control_plane;
mod figures;
mod fill;
pub mod kubelet;
mod limits;
pub mod metrics;
pub mod node;
mod rollout;
mod setup;
mod slices;
mod storms;
mod teardown;
pub mod workload;

pub use figures::{percentiles, report, Sampler};
pub use setup::{start_plane, Plane};

use std::time::Duration;

/// The driver every simulated node runs: the chart's example driver, the one its rendered DRA
/// role and slices policy name (the drivers run under them where the chart is rendered).
pub const DRIVER: &str = "npu.example.com";

/// How each device is handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// One claim, one whole device.
    Whole,
    /// Devices shared by capacity: a claim gets 50 of a device's 100 cores.
    Share,
    /// Partitionable devices: a claim gets one of a device's 2 slices.
    Partitions,
}

impl std::str::FromStr for Variant {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "whole" => Ok(Variant::Whole),
            "share" => Ok(Variant::Share),
            "partitions" => Ok(Variant::Partitions),
            other => Err(format!(
                "--variant {other:?}: give whole, share or partitions"
            )),
        }
    }
}

/// What a run does.
#[derive(Debug, Clone)]
pub struct FleetOptions {
    /// Simulated nodes.
    pub nodes: usize,
    /// Devices a node has.
    pub devices: usize,
    /// How devices are handed out.
    pub variant: Variant,
    /// The share of the fleet's capacity the fill takes (0.9).
    pub fill: f64,
    /// How long the churn lasts (zero: none).
    pub churn: Duration,
    /// Pods created (and as many deleted) per second during the churn.
    pub churn_rate: f64,
    /// Whether to run the storms (driver restart, API server away, etcd compaction).
    pub storms: bool,
    /// Whether to restart every driver in turn during the churn (from a third of it).
    pub rolling_restart: bool,
    /// How long the API server stays away in its storm.
    pub api_down: Duration,
    /// Pod creations in flight at once during the fill.
    pub in_flight: usize,
    /// How long the quiet window after the cold start lasts.
    pub idle: Duration,
    /// The client rate (requests a second; the burst is twice that) of kube-scheduler and
    /// kube-controller-manager.
    pub control_plane_qps: u32,
}

impl FleetOptions {
    /// clusterloader2's DRA shape at `nodes` nodes: 8 devices each, fill to 90%, churn at
    /// 5 pods/s for 2 minutes.
    pub fn new(nodes: usize) -> FleetOptions {
        FleetOptions {
            nodes,
            devices: 8,
            variant: Variant::Whole,
            fill: 0.9,
            churn: Duration::from_secs(120),
            churn_rate: 5.0,
            storms: false,
            rolling_restart: false,
            api_down: Duration::from_secs(30),
            in_flight: 20,
            idle: Duration::from_secs(10),
            control_plane_qps: 100,
        }
    }
}

/// Runs the benchmark; returns an error when a correctness check fails.
pub async fn run(options: FleetOptions) -> anyhow::Result<()> {
    anyhow::ensure!(options.nodes > 0, "--nodes must be at least 1");
    limits::check(options.nodes)?;
    let mut cluster = setup::start(&options).await?;
    let mut fleet = cold_start::start(&cluster, &options).await?;
    cold_start::idle(&fleet.sampler, options.idle).await;

    let kubelets = kubelet::Kubelets::start(
        cluster.kubelet_clients.client()?,
        workload::NAMESPACE,
        &fleet
            .nodes
            .iter()
            .map(|n| (n.name.clone(), n.endpoint()))
            .collect::<Vec<_>>(),
    );
    let created: workload::Created = Default::default();
    let sched_before = metrics::scheduler_metrics(cluster.plane.scheduler_port).await;
    let filled = fill::run(
        &options,
        &cluster,
        &fleet.nodes,
        &fleet.sampler,
        &kubelets,
        &created,
    )
    .await?;
    let churn = churn::run(
        &options,
        &cluster,
        &fleet.sampler,
        &kubelets,
        &created,
        &filled,
    );
    if options.rolling_restart && !options.churn.is_zero() {
        let rollout = rollout::run(&mut fleet.nodes, &fleet.drivers, options.churn / 3);
        let (churned, rolled) = tokio::join!(churn, rollout);
        rollout::report_window(&rolled?, &churned?, &created, &kubelets);
    } else {
        churn.await?;
    }
    control_plane::report_workload(&cluster.plane, &cluster.admin, &sched_before).await;

    if options.storms {
        storms::run(
            &mut cluster.plane,
            &cluster.admin,
            &mut fleet.nodes,
            &fleet.drivers,
            &fleet.sampler,
            options.api_down,
        )
        .await?;
    }

    teardown::run(cluster, fleet, kubelets).await
}
