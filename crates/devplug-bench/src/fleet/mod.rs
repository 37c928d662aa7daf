//! `devplug-bench fleet`: N simulated nodes in this process against a real control plane
//! (etcd, kube-apiserver, kube-controller-manager for claims from templates and the node
//! lifecycle, kube-scheduler), each node running devplug's real DRA driver ([`node`]) and a
//! kubelet stand-in ([`kubelet`]); clusterloader2's DRA workload ([`workload`]): fill to 90%
//! with pods of one claim each, then churn; then the storms a fleet has ([`storms`]).
//!
//! Every figure is printed as it is measured; correctness (every pod Running, every claim
//! prepared once and unprepared once, no slice left after the drivers stop) is checked and
//! an error returned when it does not hold, so the CI-sized run is a test.

mod api_count;
pub mod kubelet;
pub mod metrics;
pub mod node;
mod storms;
pub mod workload;

use anyhow::Context;
use api_count::{ApiCount, ClientFactory};
use devplug_testkit::api_server::{self, ControlPlane};
use futures_util::future::join_all;
use futures_util::StreamExt;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::Api;
use node::SimNode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The driver every simulated node runs.
pub const DRIVER: &str = "fleet.devplug.example.com";

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
            api_down: Duration::from_secs(30),
            in_flight: 20,
            idle: Duration::from_secs(10),
            control_plane_qps: 100,
        }
    }
}

/// The drivers' request count sampled every 250 ms.
#[derive(Clone)]
pub struct Sampler {
    count: Arc<ApiCount>,
    samples: Arc<Mutex<Vec<(Instant, u64)>>>,
}

impl Sampler {
    fn start(count: Arc<ApiCount>) -> (Sampler, tokio::task::JoinHandle<()>) {
        let sampler = Sampler {
            count,
            samples: Arc::new(Mutex::new(Vec::new())),
        };
        let s = sampler.clone();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(250));
            loop {
                tick.tick().await;
                let value = s.count.get();
                if let Ok(mut v) = s.samples.lock() {
                    v.push((Instant::now(), value));
                }
            }
        });
        (sampler, task)
    }

    /// Requests so far.
    pub fn now(&self) -> u64 {
        self.count.get()
    }

    /// The most requests in any 1 s window between `from` and `to`.
    pub fn peak_per_second(&self, from: Instant, to: Instant) -> u64 {
        let Ok(samples) = self.samples.lock() else {
            return 0;
        };
        let window: Vec<_> = samples
            .iter()
            .filter(|(t, _)| *t >= from && *t <= to)
            .collect();
        let mut peak = 0;
        for (i, (t, c)) in window.iter().enumerate() {
            if let Some((_, later)) = window[i..]
                .iter()
                .take_while(|(u, _)| u.duration_since(*t) <= Duration::from_secs(1))
                .last()
            {
                peak = peak.max(later.saturating_sub(*c));
            }
        }
        peak
    }
}

/// p50/p90/p99/max of `samples`, formatted.
pub fn percentiles(samples: &mut [Duration]) -> String {
    if samples.is_empty() {
        return "no samples".to_owned();
    }
    samples.sort();
    let at = |q: f64| {
        let i = ((samples.len() as f64 * q).ceil() as usize).clamp(1, samples.len()) - 1;
        samples[i]
    };
    format!(
        "n={} p50={} p90={} p99={} max={}",
        samples.len(),
        fmt(at(0.5)),
        fmt(at(0.9)),
        fmt(at(0.99)),
        fmt(at(1.0))
    )
}

fn fmt(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1e3;
    if ms < 1000.0 {
        format!("{ms:.1} ms")
    } else {
        format!("{:.2} s", ms / 1000.0)
    }
}

/// Prints one figure.
pub fn report(what: &str, value: impl std::fmt::Display) {
    println!("{what}: {value}");
}

fn rate(requests: u64, took: Duration) -> String {
    format!(
        "{:.1}/s ({requests} in {:.1} s)",
        requests as f64 / took.as_secs_f64().max(1e-3),
        took.as_secs_f64()
    )
}

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

/// inotify instances left for this user's other processes when the limit is checked (the
/// default limit of 128 fits the CI-sized fleet of 20 nodes).
const INOTIFY_MARGIN: usize = 32;

/// Descriptors a simulated node may hold, for the check of the open-files limit.
const FDS_PER_NODE: usize = 24;

/// This process's soft limit of open files.
fn open_files_limit() -> Option<usize> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// Descriptors this process holds.
fn open_files() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// Waits until every node's driver has published its slices; returns how long it took.
async fn all_published(nodes: &[SimNode], limit: Duration) -> anyhow::Result<Duration> {
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
async fn slice_count(client: &kube::Client) -> anyhow::Result<usize> {
    Ok(Api::<ResourceSlice>::all(client.clone())
        .list_metadata(&Default::default())
        .await?
        .items
        .len())
}

/// CPU seconds of each control-plane process and of this one, for a phase's CPU use.
fn cpu_now(dir: &std::path::Path) -> Vec<(String, f64)> {
    let mut out: Vec<(String, f64)> = metrics::control_plane_processes(dir)
        .into_iter()
        .map(|(name, (cpu, _))| (name, cpu))
        .collect();
    if let Some((cpu, _)) = metrics::process_usage("self") {
        out.push(("devplug-bench (drivers + stand-ins + workload)".into(), cpu));
    }
    out
}

fn report_cpu(phase: &str, before: &[(String, f64)], after: &[(String, f64)], took: Duration) {
    let parts: Vec<String> = after
        .iter()
        .map(|(name, cpu)| {
            let was = before
                .iter()
                .find(|(n, _)| n == name)
                .map_or(0.0, |(_, c)| *c);
            format!(
                "{name} {:.0}%",
                (cpu - was) / took.as_secs_f64().max(1e-3) * 100.0
            )
        })
        .collect();
    report(
        &format!("CPU during {phase} (100% = one core)"),
        parts.join(", "),
    );
}

/// Runs the benchmark; returns an error when a correctness check fails.
pub async fn run(options: FleetOptions) -> anyhow::Result<()> {
    let n = options.nodes;
    anyhow::ensure!(n > 0, "--nodes must be at least 1");
    // Each node holds a dozen or so descriptors (its client's connection, its sockets, its
    // registration folder's inotify, the stand-in's connection to its socket).
    let want = n.saturating_mul(FDS_PER_NODE).saturating_add(256);
    // Each node's driver follows the kubelet's plugin-registry folder with an inotify instance
    // of its own, as on a real node; one user may hold `max_user_instances` of them (128 by
    // default), shared by every process of that user on the machine.
    let inotify = "/proc/sys/fs/inotify/max_user_instances";
    if let Some(limit) = std::fs::read_to_string(inotify)
        .ok()
        .and_then(|t| t.trim().parse::<usize>().ok())
    {
        let want = n.saturating_add(INOTIFY_MARGIN);
        anyhow::ensure!(
            limit >= want,
            "{n} nodes need {n} inotify instances (one per driver) beside what this user's other \
             processes hold, but {inotify} is {limit}: raise it first \
             (`sysctl -w fs.inotify.max_user_instances={want}`, as root)"
        );
    }
    if let Some(limit) = open_files_limit() {
        anyhow::ensure!(
            limit >= want,
            "{n} nodes need about {want} open files but this process may open {limit}: \
             raise the limit first (`ulimit -n {want}`)"
        );
    }
    let mut plane = start_plane(options.control_plane_qps).await?;
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
    let mut creates = futures_util::stream::iter(&names)
        .map(|name| node::create_node(&admin, name))
        .buffer_unordered(16);
    while let Some(result) = creates.next().await {
        result?;
    }
    // The stand-ins' own client: the leases, the pod watch, claim reads and status patches.
    let kubelet_clients = ClientFactory::new(&kubeconfig, "devplug-fleet-kubelet").await?;
    let leases = tokio::spawn(node::renew_leases(kubelet_clients.client()?, names.clone()));

    // Cold start: every node's driver at once.
    let drivers = ClientFactory::new(&kubeconfig, api_count::DRIVER_USER_AGENT).await?;
    let (sampler, sampler_task) = Sampler::start(drivers.count());
    let mut nodes: Vec<SimNode> = names
        .iter()
        .map(|name| SimNode::new(name, DRIVER, options.variant, options.devices))
        .collect::<anyhow::Result<_>>()?;
    let rss_before = metrics::process_usage("self").map_or(0, |(_, rss)| rss);
    let fds_before = open_files();
    let cpu_before = cpu_now(plane.dir.path());
    let started = Instant::now();
    for node in &mut nodes {
        node.start_driver(drivers.client()?).await?;
    }
    let cold = all_published(&nodes, Duration::from_secs(600)).await?;
    let cold_at = Instant::now();
    let cold_requests = sampler.now();
    report(
        "cold start: every driver started → every node's slices published",
        fmt(cold),
    );
    report("cold start: driver API requests", rate(cold_requests, cold));
    report(
        "cold start: driver API requests, peak in 1 s",
        sampler.peak_per_second(started, cold_at),
    );
    report_cpu(
        "the cold start",
        &cpu_before,
        &cpu_now(plane.dir.path()),
        started.elapsed(),
    );
    let slices = slice_count(&admin).await?;
    anyhow::ensure!(slices >= n, "{slices} ResourceSlices for {n} nodes");
    let rss_after = metrics::process_usage("self").map_or(0, |(_, rss)| rss);
    report(
        "open files per simulated node's driver",
        format!(
            "{:.1}",
            open_files().saturating_sub(fds_before) as f64 / n as f64
        ),
    );
    report(
        "resident memory per simulated node's driver (process RSS growth over the start / nodes)",
        format!(
            "{:.0} KiB",
            rss_after.saturating_sub(rss_before) as f64 / 1024.0 / n as f64
        ),
    );

    // Idle.
    let idle_from = sampler.now();
    tokio::time::sleep(options.idle).await;
    report(
        "idle: driver API requests",
        rate(sampler.now() - idle_from, options.idle),
    );

    let kubelets = kubelet::Kubelets::start(
        kubelet_clients.client()?,
        workload::NAMESPACE,
        &nodes
            .iter()
            .map(|n| (n.name.clone(), n.endpoint()))
            .collect::<Vec<_>>(),
    );
    let created: workload::Created = Default::default();
    let sched_before = metrics::scheduler_metrics(plane.scheduler_port).await;

    // Fill.
    let capacity = workload::per_node(options.variant, options.devices).saturating_mul(n);
    let target = ((capacity as f64) * options.fill).floor() as usize;
    let fill_names: Vec<String> = (0..target).map(|i| format!("fill-{i:05}")).collect();
    let cpu_before = cpu_now(plane.dir.path());
    let requests_before = sampler.now();
    let started = Instant::now();
    let mut running = kubelets.running.clone();
    workload::create_all(&admin, &created, &fill_names, options.in_flight).await?;
    let limit = Duration::from_secs(60).max(Duration::from_millis(200 * target as u64));
    let filled = tokio::time::timeout(limit, running.wait_for(|r| *r >= target))
        .await
        .is_ok_and(|r| r.is_ok());
    let fill_took = started.elapsed();
    let failures = kubelets
        .observed
        .failures
        .lock()
        .map(|f| f.clone())
        .unwrap_or_default();
    if !filled {
        anyhow::bail!(
            "the fill did not finish in {limit:?}: {} of {target} pods Running; failures: {:?}",
            *running.borrow(),
            &failures[..failures.len().min(10)]
        );
    }
    report(
        "fill",
        format!(
            "{target} pods ({:.0}% of {capacity}) in {:.1} s: {:.1} pods/s",
            options.fill * 100.0,
            fill_took.as_secs_f64(),
            target as f64 / fill_took.as_secs_f64()
        ),
    );
    let (mut fill_lat, missing) =
        workload::latencies(&created, &kubelets.observed.running, &fill_names);
    anyhow::ensure!(missing == 0, "{missing} fill pods never Running");
    report(
        "fill: pod startup (created → Running)",
        percentiles(&mut fill_lat),
    );
    report(
        "fill: driver API requests",
        rate(sampler.now() - requests_before, fill_took),
    );
    report_cpu(
        "the fill",
        &cpu_before,
        &cpu_now(plane.dir.path()),
        fill_took,
    );
    let fill_prepares = kubelets
        .observed
        .prepare_times
        .lock()
        .map(|t| t.len())
        .unwrap_or(0);
    {
        let mut times = kubelets
            .observed
            .prepare_times
            .lock()
            .map(|t| t.clone())
            .unwrap_or_default();
        report(
            "fill: NodePrepareResources round trip (1 claim)",
            percentiles(&mut times),
        );
    }
    check_prepared(&nodes, &kubelets.observed, target).await?;

    // Churn: one pod created and the oldest deleted, `churn_rate` times a second.
    let mut live: std::collections::VecDeque<String> = fill_names.iter().cloned().collect();
    let mut churn_names = Vec::new();
    if !options.churn.is_zero() {
        let cpu_before = cpu_now(plane.dir.path());
        let requests_before = sampler.now();
        let started = Instant::now();
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / options.churn_rate));
        let mut tasks = Vec::new();
        let mut i = 0usize;
        while started.elapsed() < options.churn {
            tick.tick().await;
            let name = format!("churn-{i:05}");
            i += 1;
            churn_names.push(name.clone());
            live.push_back(name.clone());
            let old = live.pop_front();
            let (client, created) = (admin.clone(), created.clone());
            tasks.push(tokio::spawn(async move {
                if let Some(old) = old {
                    workload::delete(&client, &old).await?;
                }
                workload::create(&client, &created, &name).await
            }));
        }
        for task in tasks {
            task.await??;
        }
        let churn_requests = sampler.now() - requests_before;
        let churn_took = started.elapsed();
        let want = target + churn_names.len();
        let done = tokio::time::timeout(Duration::from_secs(120), running.wait_for(|r| *r >= want))
            .await
            .is_ok_and(|r| r.is_ok());
        anyhow::ensure!(
            done,
            "after the churn: {} of {want} pods ever Running",
            *running.borrow()
        );
        let (mut lat, missing) =
            workload::latencies(&created, &kubelets.observed.running, &churn_names);
        anyhow::ensure!(missing == 0, "{missing} churn pods never Running");
        report(
            &format!(
                "churn at {}/s for {:.0} s: pod startup (created → Running)",
                options.churn_rate,
                churn_took.as_secs_f64()
            ),
            percentiles(&mut lat),
        );
        report(
            "churn: driver API requests",
            rate(churn_requests, churn_took),
        );
        report_cpu(
            "the churn",
            &cpu_before,
            &cpu_now(plane.dir.path()),
            churn_took,
        );
        let mut times = kubelets
            .observed
            .prepare_times
            .lock()
            .map(|t| t[fill_prepares.min(t.len())..].to_vec())
            .unwrap_or_default();
        report(
            "churn: NodePrepareResources round trip (1 claim)",
            percentiles(&mut times),
        );
    }
    let sched_after = metrics::scheduler_metrics(plane.scheduler_port).await;
    let attempts = metrics::metric_sum(&sched_after, "scheduler_pod_scheduling_attempts_sum")
        - metrics::metric_sum(&sched_before, "scheduler_pod_scheduling_attempts_sum");
    let pods = metrics::metric_sum(&sched_after, "scheduler_pod_scheduling_attempts_count")
        - metrics::metric_sum(&sched_before, "scheduler_pod_scheduling_attempts_count");
    report(
        "scheduler attempts per pod (scheduler_pod_scheduling_attempts sum/count)",
        format!(
            "{:.3} ({attempts:.0} attempts, {pods:.0} pods)",
            attempts / pods.max(1.0)
        ),
    );
    let apiserver = metrics::apiserver_metrics(&admin).await;
    report(
        "API server: requests served in all (apiserver_request_total)",
        metrics::metric_sum(&apiserver, "apiserver_request_total"),
    );
    report(
        "API server: requests rejected for overload (apiserver_flowcontrol_rejected_requests_total)",
        metrics::metric_sum(&apiserver, "apiserver_flowcontrol_rejected_requests_total"),
    );
    let waited = metrics::metric_sum(
        &apiserver,
        "apiserver_flowcontrol_request_wait_duration_seconds_sum",
    ) / metrics::metric_sum(
        &apiserver,
        "apiserver_flowcontrol_request_wait_duration_seconds_count",
    )
    .max(1.0);
    report(
        "API server: mean wait of a request in its priority queue (apiserver_flowcontrol_request_wait_duration_seconds)",
        format!("{:.1} ms", waited * 1e3),
    );
    for (name, (cpu, rss)) in metrics::control_plane_processes(plane.dir.path()) {
        report(
            &format!("{name}: CPU time so far, resident memory"),
            format!("{cpu:.1} s, {} MiB", rss >> 20),
        );
    }

    if options.storms {
        storms::run(
            &mut plane,
            &admin,
            &mut nodes,
            &drivers,
            &sampler,
            options.api_down,
        )
        .await?;
    }

    // Teardown: every pod deleted, every claim unprepared once, no slice left.
    let pods_api: Api<k8s_openapi::api::core::v1::Pod> =
        Api::namespaced(admin.clone(), workload::NAMESPACE);
    pods_api
        .delete_collection(&Default::default(), &Default::default())
        .await?;
    let emptied = workload::wait_empty(&admin, Duration::from_secs(300)).await?;
    report("teardown: every pod and claim gone", fmt(emptied));
    let mut leftovers = 0;
    for node in &nodes {
        if let Some(driver) = &node.driver {
            leftovers += driver.prepared().await.len();
        }
    }
    anyhow::ensure!(
        leftovers == 0,
        "{leftovers} claims still prepared after every pod is gone"
    );
    {
        let prepared = kubelets
            .observed
            .prepared
            .lock()
            .map(|p| p.clone())
            .unwrap_or_default();
        let unprepared = kubelets
            .observed
            .unprepared
            .lock()
            .map(|p| p.clone())
            .unwrap_or_default();
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
    let failures = kubelets
        .observed
        .failures
        .lock()
        .map(|f| f.len())
        .unwrap_or(0);
    kubelets.stop();
    leases.abort();
    let stops = join_all(nodes.iter_mut().map(SimNode::stop_driver)).await;
    let problems: Vec<String> = stops.into_iter().flatten().collect();
    anyhow::ensure!(problems.is_empty(), "driver shutdown: {problems:?}");
    let left = slice_count(&admin).await?;
    anyhow::ensure!(
        left == 0,
        "{left} ResourceSlices left after every driver stopped"
    );
    report("teardown: ResourceSlices left", left);
    report(
        "kubelet stand-in calls that failed and were retried",
        failures,
    );
    report("kubelet stand-ins' API requests in all (leases, pod watch, claim reads, status patches, final deletes)", kubelet_clients.count().get());
    sampler_task.abort();
    drop(plane);
    Ok(())
}

/// Every Running pod's claim is in its node's checkpoint, and the stand-ins prepared each
/// claim once.
async fn check_prepared(
    nodes: &[SimNode],
    observed: &kubelet::Observed,
    target: usize,
) -> anyhow::Result<()> {
    let mut in_checkpoints = 0usize;
    let prepared = observed
        .prepared
        .lock()
        .map(|p| p.clone())
        .unwrap_or_default();
    for node in nodes {
        let Some(driver) = &node.driver else { continue };
        for uid in driver.prepared().await.keys() {
            in_checkpoints += 1;
            let on = prepared.get(uid).map(|(_, n)| n.as_str());
            anyhow::ensure!(
                on == Some(node.name.as_str()),
                "claim {uid} is prepared on {} but the stand-in prepared it on {on:?}",
                node.name
            );
        }
    }
    anyhow::ensure!(
        in_checkpoints == target,
        "{in_checkpoints} claims in the drivers' checkpoints for {target} Running pods"
    );
    anyhow::ensure!(
        prepared.values().all(|(c, _)| *c == 1),
        "a claim was prepared more than once"
    );
    Ok(())
}
