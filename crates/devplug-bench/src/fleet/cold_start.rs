//! The cold start: every node's driver started at once, until every node's slices are
//! published (how long, how many requests, the CPU, descriptors and memory it took); then the
//! quiet window after it.

use super::api_count::DriverClients;
use super::figures::{cpu_now, fmt, rate, report, report_cpu, Sampler};
use super::limits::open_files;
use super::metrics;
use super::node::SimNode;
use super::setup::Cluster;
use super::slices::{all_published, slice_count};
use super::{FleetOptions, DRIVER};
use std::time::Duration;
use tokio::task::JoinHandle;

/// The simulated nodes with their drivers running, and what counts the drivers' requests
/// (their fields in the order they are dropped).
pub(super) struct Fleet {
    /// The simulated nodes.
    pub(super) nodes: Vec<SimNode>,
    /// The task sampling the drivers' request count.
    pub(super) sampler_task: JoinHandle<()>,
    /// The drivers' request count, sampled.
    pub(super) sampler: Sampler,
    /// The drivers' clients, counted.
    pub(super) drivers: DriverClients,
}

/// Starts every node's driver at once and waits until every node's slices are published.
pub(super) async fn start(cluster: &Cluster, options: &FleetOptions) -> anyhow::Result<Fleet> {
    let n = cluster.names.len();
    let Cluster {
        plane,
        admin,
        kubeconfig,
        names,
        ..
    } = cluster;
    // Cold start: every node's driver at once.
    let server = plane.plane.as_ref().map(|p| p.server());
    let drivers = DriverClients::new(server, admin, kubeconfig, names).await?;
    report("the drivers' credentials", &drivers.identity);
    let (sampler, sampler_task) = Sampler::start(drivers.count());
    let mut nodes: Vec<SimNode> = names
        .iter()
        .map(|name| SimNode::new(name, DRIVER, options.variant, options.devices))
        .collect::<anyhow::Result<_>>()?;
    report(
        "the nodes' CDI folders",
        if nodes.iter().all(SimNode::cdi_on_tmpfs) {
            "on tmpfs (/dev/shm), as a node's /var/run/cdi; checkpoints on disk"
        } else {
            "on disk where no writable /dev/shm, with the checkpoints"
        },
    );
    let rss_before = metrics::process_usage("self").map_or(0, |(_, rss)| rss);
    let fds_before = open_files();
    let cpu_before = cpu_now(plane.dir());
    let started = sampler.mark();
    for (i, node) in nodes.iter_mut().enumerate() {
        node.start_driver(drivers.client(i)?).await?;
    }
    let cold = all_published(&nodes, Duration::from_secs(600)).await?;
    let cold_at = sampler.mark();
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
        &cpu_now(plane.dir()),
        started.elapsed(),
    );
    let slices = slice_count(admin, names).await?;
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
    Ok(Fleet {
        nodes,
        sampler_task,
        sampler,
        drivers,
    })
}

/// The quiet window after the cold start: the drivers' requests while nothing changes.
pub(super) async fn idle(sampler: &Sampler, idle: Duration) {
    let idle_from = sampler.now();
    tokio::time::sleep(idle).await;
    report(
        "idle: driver API requests",
        rate(sampler.now() - idle_from, idle),
    );
}
