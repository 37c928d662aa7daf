//! A rolling restart of every node's driver while the churn creates pods, as a DaemonSet's
//! update does (one node at a time, each driver back with its slices published before the
//! next stops): whether it leaves a gap, measured as the startup of the pods created during it
//! beside those created before it. The drivers keep their slices at a stop, so the scheduler
//! should see every node's devices throughout; a pod that lands on the node whose driver is
//! away waits for it (the kubelet stand-in retries its prepare, as the kubelet does).

use super::api_count::DriverClients;
use super::figures::{fmt, percentiles, report};
use super::kubelet::Kubelets;
use super::node::SimNode;
use super::workload;
use std::time::{Duration, Instant};

/// The pause between two drivers' restarts: a DaemonSet's update starts the next node's pod once
/// the last one is ready, which takes a container's start, a second or more; without it the
/// restarts would come back to back, 20 in about 2.6 s on two cores, a density no rollout has.
const PAUSE: Duration = Duration::from_secs(1);

/// When the rollout ran.
pub(super) struct Window {
    from: Instant,
    to: Instant,
    drivers: usize,
}

/// After `wait`, restarts every node's driver in turn (stop, start on its own client, wait for
/// its slices); returns when it ran.
pub(super) async fn run(
    nodes: &mut [SimNode],
    drivers: &DriverClients,
    wait: Duration,
) -> anyhow::Result<Window> {
    tokio::time::sleep(wait).await;
    let from = Instant::now();
    for (i, node) in nodes.iter_mut().enumerate() {
        if i > 0 {
            tokio::time::sleep(PAUSE).await;
        }
        let problems = node.stop_driver().await;
        anyhow::ensure!(
            problems.is_empty(),
            "{}: driver shutdown: {problems:?}",
            node.name
        );
        node.start_driver(drivers.client(i)?).await?;
        super::slices::all_published(std::slice::from_mut(node), Duration::from_secs(60)).await?;
    }
    Ok(Window {
        from,
        to: Instant::now(),
        drivers: nodes.len(),
    })
}

/// Reports the rollout and the startup of the churn's pods (`churned`) created before it and
/// during it.
pub(super) fn report_window(
    window: &Window,
    churned: &[String],
    created: &workload::Created,
    kubelets: &Kubelets,
) {
    report(
        &format!(
            "rolling restart during the churn: every driver stopped and started in turn, each until its slices were published, {} apart",
            fmt(PAUSE)
        ),
        format!(
            "{} drivers in {}",
            window.drivers,
            fmt(window.to - window.from)
        ),
    );
    let (before, during) = {
        let Ok(created) = created.lock() else {
            return;
        };
        let mut before = Vec::new();
        let mut during = Vec::new();
        for name in churned {
            match created.get(name) {
                Some(at) if *at < window.from => before.push(name.clone()),
                Some(at) if *at <= window.to => during.push(name.clone()),
                _ => {}
            }
        }
        (before, during)
    };
    for (what, names) in [("before it", before), ("during it", during)] {
        let (mut lat, missing) = workload::latencies(created, &kubelets.observed.running, &names);
        report(
            &format!("rolling restart: churn pods created {what}: startup (created → Running)"),
            format!("{} ({missing} not Running)", percentiles(&mut lat)),
        );
    }
}
