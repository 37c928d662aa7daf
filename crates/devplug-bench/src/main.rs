//! Benchmarks of devplug through the kubelet simulator, printed as a table for
//! `docs/benchmarks.md`. Run with `cargo build --release -p devplug-cli && cargo run --release -p devplug-bench`;
//! `devplug-bench gpus` runs only the AMD/Intel GPU backend figures (no `devplug` binary needed),
//! `devplug-bench accelerators` only the vfio, qat, ascend and fpga figures,
//! `devplug-bench nvidia` only the NVIDIA backend's, `devplug-bench routes` only kubelet
//! restart → streaming by registration route and the PodResources call cost, `devplug-bench dra`
//! the DRA figures (slice publish latency, NodePrepareResources; needs `KUBEBUILDER_ASSETS`),
//! `devplug-bench fleet --nodes N` N simulated nodes' DRA drivers against a real control plane
//! (`--variant whole|share|partitions`, `--churn-secs S`, `--storms`, `--rolling-restart`;
//! `DEVPLUG_HELM_RENDERED` puts each driver on its own node's token under the chart's DRA role;
//! docs/benchmarks.md).
//! `devplug-bench --help` and `devplug-bench fleet --help` list the groups and the flags.
//! Figures depend on the machine; this is not a test and asserts nothing.

mod accelerators;
mod backends;
mod dra;
mod gpus;
mod measure;
mod nvidia;
mod routes;

use anyhow::Context;
use devplug::{Health, Host};
use devplug_backends::{VirtualBackend, VirtualSettings};
use devplug_proto::uds;
use devplug_proto::v1beta1::{self as pb, device_plugin_client::DevicePluginClient};
use kubelet_sim::Kubelet;
use measure::{percentiles, Sample};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) const WAIT: Duration = Duration::from_secs(10);
const RESOURCE: &str = "bench.example/dev";

/// What to measure: everything, or one group.
#[derive(Debug, clap::Parser)]
#[command(
    name = "devplug-bench",
    about = "Benchmarks of devplug through the kubelet simulator, printed as a table for docs/benchmarks.md",
    long_about = "Benchmarks of devplug through the kubelet simulator, printed as a table for \
docs/benchmarks.md. Without a command: every group but dra and fleet (build the release \
`devplug` first: cargo build --release -p devplug-cli). Figures depend on the machine; \
nothing is asserted. DEVPLUG_BENCH_ONLY=process: only the `devplug run` process's memory and \
start."
)]
struct Cli {
    #[command(subcommand)]
    group: Option<Group>,
}

/// The groups that run alone.
#[derive(Debug, clap::Subcommand)]
enum Group {
    /// The AMD and Intel GPU backends (no `devplug` binary needed).
    Gpus,
    /// The vfio, qat, ascend and fpga backends.
    Accelerators,
    /// The NVIDIA backend on the fake NVML.
    Nvidia,
    /// Kubelet restart to streaming, by registration route, and the PodResources call cost.
    Routes,
    /// The DRA driver: slice publish latency, NodePrepareResources (needs KUBEBUILDER_ASSETS).
    Dra,
    /// N simulated nodes, each with devplug's DRA driver, against a real control plane
    /// (etcd, kube-apiserver, kube-controller-manager, kube-scheduler from KUBEBUILDER_ASSETS).
    Fleet(FleetArgs),
}

/// `devplug-bench fleet`: N simulated DRA nodes against a real control plane, in the shape of
/// the upstream test `--mode` names (docs/benchmarks.md, "A fleet of DRA nodes").
#[derive(Debug, clap::Args)]
struct FleetArgs {
    /// What the run is compared with: scheduler-perf (every pod at once, the scheduler at
    /// 5,000 QPS: pods bound a second), clusterloader2 (default client rates, a paced fill of
    /// Jobs, then short-lived Jobs: pod startup against 5 s) or driver (no scheduler: the
    /// bench allocates and binds, bursts of pods on one node).
    #[arg(long, default_value = "clusterloader2")]
    mode: devplug_bench::fleet::Mode,
    /// Simulated nodes.
    #[arg(long, default_value_t = 100)]
    nodes: usize,
    /// How devices are handed out: whole, share (by capacity) or partitions.
    #[arg(long, default_value = "whole")]
    variant: devplug_bench::fleet::Variant,
    /// Pods (Jobs) created a second during the fill (clusterloader2 mode: 10; otherwise as fast
    /// as 20 or 50 creations in flight go).
    #[arg(long, value_name = "R")]
    fill_rate: Option<f64>,
    /// Creations in flight at once during a fill not paced by --fill-rate (scheduler-perf
    /// mode: 50; otherwise 20).
    #[arg(long, value_name = "N")]
    in_flight: Option<usize>,
    /// How long the churn lasts, in seconds (0: none; clusterloader2 mode: 120).
    #[arg(long, value_name = "S")]
    churn_secs: Option<u64>,
    /// Pods (Jobs) created per second during the churn (default 5).
    #[arg(long, value_name = "R")]
    churn_rate: Option<f64>,
    /// How long each churn Job's pod runs before it succeeds, in seconds (clusterloader2
    /// mode; default 30).
    #[arg(long, value_name = "S")]
    job_secs: Option<f64>,
    /// Bursts of pods on one node each (driver mode; default: one a node, 100 at most).
    #[arg(long, value_name = "B")]
    bursts: Option<usize>,
    /// The client rate of kube-scheduler and kube-controller-manager, requests a second (the
    /// burst twice that); default: the mode's (scheduler-perf 5,000; otherwise their own).
    #[arg(long, value_name = "Q")]
    control_plane_qps: Option<u32>,
    /// Run the storms: every driver restarted, the API server away, etcd compacted.
    #[arg(long)]
    storms: bool,
    /// Restart every driver in turn during the churn (from a third of it), as a DaemonSet's
    /// update does; the churn's pods created before and during it are compared.
    #[arg(long)]
    rolling_restart: bool,
    /// How long the API server stays away in its storm, in seconds (default 30).
    #[arg(long, value_name = "S")]
    api_down_secs: Option<u64>,
    /// Run the simulated nodes against the cluster of this kubeconfig (kind, or a real one)
    /// instead of a control plane of the bench's own: their Nodes labelled and tainted so that
    /// nothing else lands there, and removed at the end; its control plane is not measured.
    #[arg(long, value_name = "PATH")]
    kubeconfig: Option<std::path::PathBuf>,
    /// Run part i (from 0) of n of the fleet of --nodes: the nodes whose number is i modulo n,
    /// with a workload of their own (namespace fleet-<i>); one process per part, on one
    /// machine or several, against the cluster of --kubeconfig.
    #[arg(long, value_name = "i/n")]
    shard: Option<devplug_bench::fleet::Shard>,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let cli = <Cli as clap::Parser>::parse();
    let cpu_before = measure::machine_cpu();
    if let Some(Group::Fleet(args)) = cli.group {
        return fleet(args, cpu_before).await;
    }
    // DEVPLUG_BENCH_ONLY=process: only the figures of the `devplug run` process (memory, start).
    if std::env::var("DEVPLUG_BENCH_ONLY").as_deref() == Ok("process") {
        return measure::process_figures().await;
    }
    println!("| measurement | n | p50 | p99 | max |");
    println!("|---|---|---|---|---|");
    match cli.group {
        Some(Group::Gpus) => return gpu_figures(cpu_before).await,
        Some(Group::Accelerators) => {
            accelerators::discovery().await?;
            accelerators::change_latency().await?;
            print_machine(cpu_before);
            return Ok(());
        }
        Some(Group::Nvidia) => {
            nvidia::preferred().await?;
            nvidia::start_to_registered().await?;
            nvidia::xid_to_unhealthy().await?;
            nvidia::process_rss().await?;
            print_machine(cpu_before);
            return Ok(());
        }
        Some(Group::Dra) => return dra::figures(200, 200).await,
        Some(Group::Routes) => {
            routes::restart_by_route(200).await?;
            routes::pod_resources_cost().await?;
            print_machine(cpu_before);
            return Ok(());
        }
        Some(Group::Fleet(_)) | None => {}
    }
    round_trips().await?;
    device_changes().await?;
    restarts().await?;
    routes::restart_by_route(200).await?;
    routes::pod_resources_cost().await?;
    rolling_upgrades().await?;
    start_to_registered().await?;
    backends::file_created().await?;
    backends::hotplug_burst().await?;
    gpus::discovery().await?;
    gpus::late_driver().await?;
    gpus::change_latency().await?;
    gpus::preferred().await?;
    accelerators::discovery().await?;
    accelerators::change_latency().await?;
    nvidia::preferred().await?;
    nvidia::start_to_registered().await?;
    nvidia::xid_to_unhealthy().await?;
    measure::process_figures().await?;
    nvidia::process_rss().await?;
    print_machine(cpu_before);
    Ok(())
}

/// `devplug-bench fleet`.
async fn fleet(args: FleetArgs, cpu_before: Option<measure::MachineCpu>) -> anyhow::Result<()> {
    use devplug_bench::fleet::{self, FleetOptions};
    let mut options = FleetOptions::new(args.mode, args.nodes);
    options.variant = args.variant;
    options.storms = args.storms;
    options.rolling_restart = args.rolling_restart;
    options.kubeconfig = args.kubeconfig;
    options.shard = args.shard;
    if let Some(rate) = args.fill_rate {
        anyhow::ensure!(
            rate.is_finite() && rate > 0.0,
            "--fill-rate must be above 0 (pods a second)"
        );
        options.fill_rate = Some(rate);
    }
    if let Some(secs) = args.churn_secs {
        options.churn = Duration::from_secs(secs);
    }
    if let Some(rate) = args.churn_rate {
        options.churn_rate = rate;
    }
    if let Some(secs) = args.job_secs {
        options.job_running = Duration::try_from_secs_f64(secs)
            .map_err(|_| anyhow::anyhow!("--job-secs must be 0 or more seconds"))?;
    }
    if let Some(n) = args.in_flight {
        anyhow::ensure!(n > 0, "--in-flight must be at least 1");
        options.in_flight = n;
    }
    if let Some(bursts) = args.bursts {
        options.bursts = bursts;
    }
    if let Some(secs) = args.api_down_secs {
        options.api_down = Duration::from_secs(secs);
    }
    if let Some(qps) = args.control_plane_qps {
        options.control_plane_rate = Some((qps, qps.saturating_mul(2)));
    }
    anyhow::ensure!(
        options.churn_rate.is_finite() && options.churn_rate > 0.0,
        "--churn-rate must be above 0 (pods a second)"
    );
    fleet::run(options).await?;
    print_machine(cpu_before);
    Ok(())
}

/// Only the GPU backends' figures.
async fn gpu_figures(cpu_before: Option<measure::MachineCpu>) -> anyhow::Result<()> {
    gpus::discovery().await?;
    gpus::late_driver().await?;
    gpus::change_latency().await?;
    gpus::preferred().await?;
    print_machine(cpu_before);
    Ok(())
}

fn print_machine(cpu_before: Option<measure::MachineCpu>) {
    if let (Some(before), Some(after)) = (cpu_before, measure::machine_cpu()) {
        println!();
        println!(
            "Machine during the run: {:.0}% busy, {:.1}% of CPU time stolen by the hypervisor \
             (/proc/stat); high steal makes every figure above slower and noisier.",
            after.busy_percent_since(&before),
            after.steal_percent_since(&before)
        );
    }
}

async fn setup(
    count: usize,
) -> anyhow::Result<(tempfile::TempDir, Kubelet, Host, Arc<VirtualBackend>)> {
    let dir = tempfile::tempdir()?;
    let kubelet = Kubelet::start(dir.path()).await?;
    let host = Host::new(dir.path())?;
    let backend = Arc::new(VirtualBackend::new(&VirtualSettings::new(count))?);
    // No hold-down: these figures are about the pipeline, not the recovery policy.
    let settings = devplug::ResourceSettings {
        health_hold_down: Duration::ZERO,
        ..Default::default()
    };
    host.add_with(RESOURCE, backend.clone(), settings)?;
    kubelet
        .wait_for(WAIT, |n| (n.capacity(RESOURCE).0 == count).then_some(()))
        .await?;
    Ok((dir, kubelet, host, backend))
}

/// Allocate of 2 devices vs an (almost) empty RPC, GetDevicePluginOptions, on the same socket.
async fn round_trips() -> anyhow::Result<()> {
    let (_dir, kubelet, host, _backend) = setup(1000).await?;
    let socket = kubelet
        .read(|n| n.resource(RESOURCE).and_then(|r| r.socket().cloned()))
        .context("no socket")?;
    let mut client = DevicePluginClient::new(uds::connect(&socket, WAIT).await?);
    let n = 5000;
    let mut empty = Vec::with_capacity(n);
    let mut allocate = Vec::with_capacity(n);
    for i in 0..(n + 500) {
        let t = Instant::now();
        client.get_device_plugin_options(pb::Empty {}).await?;
        let e = t.elapsed();
        let request = pb::AllocateRequest {
            container_requests: vec![pb::ContainerAllocateRequest {
                devices_ids: vec![
                    format!("virtual-{}", i % 999),
                    format!("virtual-{}", i % 999 + 1),
                ],
            }],
        };
        let t = Instant::now();
        client.allocate(request).await?;
        let a = t.elapsed();
        if i >= 500 {
            empty.push(e);
            allocate.push(a);
        }
    }
    print_row(
        "empty gRPC round trip (GetDevicePluginOptions), same socket",
        &mut empty,
    );
    print_row("Allocate round trip, 2 of 1,000 devices", &mut allocate);
    let ratio =
        percentiles(&mut allocate).p50.as_secs_f64() / percentiles(&mut empty).p50.as_secs_f64();
    println!("| Allocate p50 / empty p50 | | {ratio:.2}x | | |");
    host.shutdown().await;
    Ok(())
}

/// A health change in the backend until the simulated kubelet has it.
async fn device_changes() -> anyhow::Result<()> {
    let (_dir, kubelet, host, backend) = setup(1000).await?;
    let mut samples = Vec::new();
    for i in 0..1000 {
        let healthy = i % 2 == 1;
        let health = if healthy {
            Health::Healthy
        } else {
            Health::unhealthy("bench")
        };
        let t = Instant::now();
        backend.set_health("virtual-7", health);
        kubelet
            .wait_for(WAIT, |n| {
                let d = n.resource(RESOURCE)?.devices().get("virtual-7")?;
                (d.healthy == healthy).then_some(())
            })
            .await?;
        samples.push(t.elapsed());
    }
    print_row(
        "device health change → seen by the kubelet (1,000 devices)",
        &mut samples,
    );
    host.shutdown().await;
    Ok(())
}

/// A simulated kubelet restart (all sockets deleted, a new kubelet.sock bound, listening 1 ms
/// later as a Go kubelet's bind-then-listen gap) until registered again, timed from the moment
/// the new kubelet.sock appeared.
async fn restarts() -> anyhow::Result<()> {
    let (_dir, mut kubelet, host, _backend) = setup(1000).await?;
    let mut samples = Vec::new();
    for round in 0..1000usize {
        kubelet.restart().await?;
        let (bound, at) = kubelet
            .wait_for(WAIT, |n| {
                (n.registration_count(RESOURCE) == round + 2)
                    .then(|| Some((n.socket_bound_at()?, n.registrations().last()?.at)))?
            })
            .await?;
        samples.push(at.saturating_duration_since(bound));
    }
    print_row(
        "kubelet restart (kubelet.sock bound, listening 1 ms later) → registered again",
        &mut samples,
    );
    host.shutdown().await;
    Ok(())
}

/// A rolling upgrade on a kubelet that keys clients by resource name (1.25 to 1.36): instance A
/// serves, instance B registers, A stops. The kubelet's end of A's stream disconnects B; the
/// figure is how long allocatable stays at 0 before B is registered again.
async fn rolling_upgrades() -> anyhow::Result<()> {
    let mut zero = Vec::new();
    let mut cut_off = 0;
    let runs = 50;
    for _ in 0..runs {
        let dir = tempfile::tempdir()?;
        let kubelet = Kubelet::start(dir.path()).await?;
        let a = Host::new(dir.path())?;
        a.add(RESOURCE, VirtualBackend::new(&VirtualSettings::new(8))?)?;
        kubelet
            .wait_for(WAIT, |n| {
                (n.registration_count(RESOURCE) == 1).then_some(())
            })
            .await?;
        let b = Host::new(dir.path())?;
        b.add(RESOURCE, VirtualBackend::new(&VirtualSettings::new(8))?)?;
        kubelet
            .wait_for(WAIT, |n| {
                (n.registration_count(RESOURCE) == 2 && n.capacity(RESOURCE) == (8, 8))
                    .then_some(())
            })
            .await?;
        let stopping = a.shutdown();
        // Watch allocatable while A stops: when it drops to 0, and when it is back at 8.
        let window = kubelet.wait_for(WAIT, {
            let mut dropped: Option<Instant> = None;
            move |n| {
                let (_, allocatable) = n.capacity(RESOURCE);
                match dropped {
                    None if allocatable == 0 => {
                        dropped = Some(Instant::now());
                        None
                    }
                    Some(at) if allocatable == 8 => Some(at.elapsed()),
                    _ => None,
                }
            }
        });
        let (_, window) = tokio::join!(
            stopping,
            tokio::time::timeout(Duration::from_secs(3), window)
        );
        match window {
            Ok(Ok(window)) => {
                cut_off += 1;
                zero.push(window);
            }
            // Never dropped to 0 within the time: B was not cut off in this run.
            _ => zero.push(Duration::ZERO),
        }
        b.shutdown().await;
        kubelet.stop().await;
    }
    print_row(
        &format!(
            "rolling upgrade A → B → stop A (kubelet ≤ 1.36): allocatable at 0 ({cut_off} of {runs} runs cut B off)"
        ),
        &mut zero,
    );
    Ok(())
}

/// Host::new + add until the kubelet accepted the registration.
async fn start_to_registered() -> anyhow::Result<()> {
    let mut samples = Vec::new();
    for _ in 0..100 {
        let dir = tempfile::tempdir()?;
        let kubelet = Kubelet::start(dir.path()).await?;
        let backend = VirtualBackend::new(&VirtualSettings::new(1000))?;
        let t = Instant::now();
        let host = Host::new(dir.path())?;
        host.add(RESOURCE, backend)?;
        let at = kubelet
            .wait_for(WAIT, |n| n.registrations().first().map(|r| r.at))
            .await?;
        samples.push(at.saturating_duration_since(t));
        host.shutdown().await;
        kubelet.stop().await;
    }
    print_row(
        "start (Host::new + add) → registered, in process",
        &mut samples,
    );
    Ok(())
}

pub(crate) fn print_row(what: &str, samples: &mut [Duration]) {
    let Sample { p50, p99, max, n } = percentiles(samples);
    println!(
        "| {what} | {n} | {} | {} | {} |",
        fmt(p50),
        fmt(p99),
        fmt(max)
    );
}

fn fmt(d: Duration) -> String {
    let us = d.as_secs_f64() * 1e6;
    if us < 1000.0 {
        format!("{us:.0} µs")
    } else {
        format!("{:.2} ms", us / 1000.0)
    }
}
