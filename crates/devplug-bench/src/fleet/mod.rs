//! `devplug-bench fleet`: N simulated nodes in this process against a real control plane
//! (etcd, kube-apiserver, kube-controller-manager for claims from templates, Jobs and the node
//! lifecycle, kube-scheduler), each node running devplug's real DRA driver ([`node`]) and a
//! kubelet stand-in ([`kubelet`]), in one of three [`mode`]s, each the shape of the upstream
//! test it is compared with: scheduler_perf's (every pod at once, the scheduler at 5,000
//! QPS), clusterloader2's (a paced fill of Jobs, then short-lived Jobs; [`workload`]), or the
//! driver alone (claims allocated and pods bound by the bench, in bursts on one node:
//! `bursts`); then the storms a fleet has ([`storms`]).
//!
//! Every figure is printed as it is measured; correctness (every pod Running, every claim
//! prepared once and unprepared once, no slice left after the drivers stop) is checked and
//! an error returned when it does not hold, so the CI-sized run is a test.
//!
//! [`run`] is the sequence of phases, one a file: `limits` (what the machine must allow),
//! `setup` (the control plane, the workload's objects, the Node objects and their leases),
//! `cold_start` (every driver at once, then the quiet window), `fill` and `churn` (or
//! `bursts`), `control_plane` and `driver_calls` (what the control plane and the drivers did meanwhile), `storms` and
//! `teardown`; `figures` measures and prints, `slices` waits for and counts the fleet's slices.

mod api_count;
mod bursts;
mod churn;
mod cold_start;
mod control_plane;
mod driver_calls;
mod figures;
mod fill;
pub mod kubelet;
mod limits;
pub mod metrics;
pub mod mode;
pub mod node;
mod rollout;
mod setup;
mod slices;
mod storms;
mod teardown;
pub mod workload;

pub use figures::{percentiles, report, Sampler};
pub use mode::Mode;
pub use setup::{node_names, start_plane, Plane};
pub use workload::Target;

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
    /// What the run is compared with ([`Mode`]).
    pub mode: Mode,
    /// Simulated nodes.
    pub nodes: usize,
    /// Devices a node has.
    pub devices: usize,
    /// How devices are handed out.
    pub variant: Variant,
    /// The share of the fleet's capacity the fill takes (0.9; zero: no fill).
    pub fill: f64,
    /// How the fill's pods come: `None`, `in_flight` creations at once, as fast as they go;
    /// `Some(r)`, `r` a second.
    pub fill_rate: Option<f64>,
    /// How long the churn lasts (zero: none).
    pub churn: Duration,
    /// Pods (Jobs in the clusterloader2 mode) created per second during the churn.
    pub churn_rate: f64,
    /// How long a churn Job's pod runs before it succeeds (the clusterloader2 mode).
    pub job_running: Duration,
    /// Whether to run the storms (driver restart, API server away, etcd compaction).
    pub storms: bool,
    /// Whether to restart every driver in turn during the churn (from a third of it).
    pub rolling_restart: bool,
    /// How long the API server stays away in its storm.
    pub api_down: Duration,
    /// Pod creations in flight at once during an unpaced fill.
    pub in_flight: usize,
    /// How long the quiet window after the cold start lasts.
    pub idle: Duration,
    /// The client rate and burst (requests a second) of kube-scheduler and
    /// kube-controller-manager; `None`: their own defaults (50/100 and 20/30).
    pub control_plane_rate: Option<(u32, u32)>,
    /// Bursts of pods on one node each, one node after the other (the driver mode).
    pub bursts: usize,
    /// An existing cluster to run the simulated nodes against (its kubeconfig), instead of a
    /// control plane of the run's own.
    pub kubeconfig: Option<std::path::PathBuf>,
    /// This process's part of a fleet split across processes or machines.
    pub shard: Option<Shard>,
}

/// Part `index` (from 0) of a fleet split into `count`: the nodes whose number is `index`
/// modulo `count`, with a workload of their own in namespace `fleet-<index>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// Which part.
    pub index: usize,
    /// Of how many.
    pub count: usize,
}

impl std::str::FromStr for Shard {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("--shard {s:?}: give i/n, the part i (from 0) of n, as 0/4");
        let (i, n) = s.split_once('/').ok_or_else(bad)?;
        let (index, count) = (
            i.trim().parse::<usize>().map_err(|_| bad())?,
            n.trim().parse::<usize>().map_err(|_| bad())?,
        );
        if count == 0 || index >= count {
            return Err(bad());
        }
        Ok(Shard { index, count })
    }
}

impl FleetOptions {
    /// The shape of `mode` at `nodes` nodes (see [`mode`]).
    pub fn new(mode: Mode, nodes: usize) -> FleetOptions {
        let base = FleetOptions {
            mode,
            nodes,
            devices: 8,
            variant: Variant::Whole,
            fill: 0.0,
            fill_rate: None,
            churn: Duration::ZERO,
            churn_rate: mode::CL2_CHURN_RATE,
            job_running: mode::CL2_JOB_RUNNING,
            storms: false,
            rolling_restart: false,
            api_down: Duration::from_secs(30),
            in_flight: 20,
            idle: Duration::from_secs(10),
            control_plane_rate: None,
            bursts: 0,
            kubeconfig: None,
            shard: None,
        };
        match mode {
            Mode::SchedulerPerf => FleetOptions {
                devices: mode::SCHEDULER_PERF_DEVICES,
                fill: 1.0,
                in_flight: 50,
                control_plane_rate: Some((mode::SCHEDULER_PERF_QPS, mode::SCHEDULER_PERF_QPS)),
                ..base
            },
            Mode::Clusterloader2 => FleetOptions {
                fill: 0.9,
                fill_rate: Some(mode::CL2_FILL_RATE),
                churn: Duration::from_secs(120),
                ..base
            },
            Mode::Driver => FleetOptions {
                bursts: nodes.min(100),
                ..base
            },
        }
    }
}

/// Runs the benchmark; returns an error when a correctness check fails.
pub async fn run(options: FleetOptions) -> anyhow::Result<()> {
    anyhow::ensure!(options.nodes > 0, "--nodes must be at least 1");
    anyhow::ensure!(
        options.mode != Mode::Driver || options.variant == Variant::Whole,
        "--mode driver allocates whole devices itself: leave --variant at whole"
    );
    anyhow::ensure!(
        options.shard.is_none() || options.kubeconfig.is_some(),
        "--shard splits a fleet across processes that share one cluster: give its --kubeconfig too"
    );
    anyhow::ensure!(
        !(options.storms && options.kubeconfig.is_some()),
        "--storms stops and starts the run's own API server: leave it out with --kubeconfig"
    );
    limits::check(options.nodes)?;
    let mut cluster = setup::start(&options).await?;
    let mut fleet = cold_start::start(&cluster, &options).await?;
    cold_start::idle(&fleet.sampler, options.idle).await;

    let kubelets = kubelet::Kubelets::start(
        cluster.kubelet_clients.client()?,
        &cluster.target.namespace,
        &fleet
            .nodes
            .iter()
            .map(|n| (n.name.clone(), n.endpoint()))
            .collect::<Vec<_>>(),
    );
    let created: workload::Created = Default::default();
    let before = control_plane::Before::read(&cluster.plane).await;
    if options.mode == Mode::Driver {
        bursts::run(&options, &cluster, &fleet, &kubelets, &created).await?;
    } else {
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
    }
    control_plane::report_workload(&cluster.plane, &cluster.admin, &before).await;
    driver_calls::report_all(&fleet.nodes, &kubelets);

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
