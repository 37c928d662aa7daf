//! The storms a fleet has: (a) every driver restarts at once (a DaemonSet rollout of every
//! node), (b) the API server is away for a while, (c) etcd compacts its history while the
//! drivers watch. For each: how long until every node's slices are right again, as the
//! drivers say and as the API server has them (an admin's watch compares every node's slices
//! with what its driver would publish), and the drivers' request peak. So that "right" means
//! something after (b) and (c), device `dev-0` of every node breaks while the API server is
//! away and mends at the compaction: the slices must follow.

use super::api_count::DriverClients;
use super::figures::{fmt, rate, report, Sampler};
use super::node::SimNode;
use super::setup::Plane;
use super::slices::{all_published, all_right, slice_count};
use anyhow::Context;
use futures_util::future::join_all;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

/// The device of every node that breaks during storm (b) and mends during (c).
const BREAKS: &str = "dev-0";

pub(super) async fn run(
    plane: &mut Plane,
    admin: &kube::Client,
    nodes: &mut [SimNode],
    drivers: &DriverClients,
    sampler: &Sampler,
    api_down: Duration,
) -> anyhow::Result<()> {
    let n = nodes.len();
    let names: Vec<String> = nodes.iter().map(|n| n.name.clone()).collect();

    // (a) Every driver stops (slices kept, as devplug does at SIGTERM) and starts again
    // with a new client, reading its checkpoint.
    let from = sampler.now();
    let started = sampler.mark();
    let stopped_at = Instant::now();
    let stops = join_all(nodes.iter_mut().map(SimNode::stop_driver)).await;
    anyhow::ensure!(
        stops.iter().all(Vec::is_empty),
        "driver shutdown: {stops:?}"
    );
    for (i, node) in nodes.iter_mut().enumerate() {
        node.start_driver(drivers.client(i)?).await?;
    }
    let took = all_published(nodes, Duration::from_secs(600)).await?;
    let total = started.elapsed();
    report(
        "storm (a) every driver restarts: stop of all → every node's slices published again",
        format!("{} (publish after start {})", fmt(total), fmt(took)),
    );
    let right = all_right(admin, nodes, stopped_at, Duration::from_secs(600)).await?;
    report(
        "storm (a): stop of all → every node's slices right at the API server (admin's watch)",
        fmt(right),
    );
    report(
        "storm (a): driver API requests",
        rate(sampler.now() - from, total),
    );
    report(
        "storm (a): driver API requests, peak in 1 s",
        sampler.peak_per_second(started, sampler.mark()),
    );
    anyhow::ensure!(
        slice_count(admin, &names).await? >= n,
        "slices missing after the restart"
    );

    // (b) The API server away for `api_down`.
    let resyncs = |nodes: &[SimNode]| -> Vec<u64> {
        nodes
            .iter()
            .map(|n| {
                n.driver
                    .as_ref()
                    .map_or(0, |d| d.slices().counters().resyncs.load(Relaxed))
            })
            .collect()
    };
    let before = resyncs(nodes);
    let Some(control) = plane.plane.as_mut() else {
        anyhow::bail!("the storms need the run's own control plane");
    };
    control.stop_api_server().map_err(anyhow::Error::msg)?;
    let broke = nodes
        .iter()
        .filter(|n| {
            n.set_health(
                BREAKS,
                devplug::Health::unhealthy("broke while the API server was away (storm b)"),
            )
        })
        .count();
    anyhow::ensure!(broke == n, "{BREAKS} broke on {broke} of {n} nodes");
    let down_from = sampler.now();
    tokio::time::sleep(api_down).await;
    let down_requests = sampler.now() - down_from;
    let back_from = sampler.now();
    let restart = sampler.mark();
    let restarted_at = Instant::now();
    // The API server started again while every node is watched for its resync (its slices
    // and Node read afresh) and a publish that succeeded after it: drivers may resync before
    // the API server's /readyz says ok.
    let limit = Duration::from_secs(300);
    let resynced = async {
        loop {
            let now = resyncs(nodes);
            let done = nodes
                .iter()
                .zip(now.iter().zip(&before))
                .all(|(node, (now, was))| {
                    now > was
                        && node.driver.as_ref().is_some_and(|d| {
                            d.slices().counters().consecutive_failures.load(Relaxed) == 0
                        })
                });
            if done {
                return Ok(restart.elapsed());
            }
            anyhow::ensure!(
                restart.elapsed() < limit,
                "not every node resynced within {limit:?} of the API server's start"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let ready_and_right = async {
        control
            .start_api_server()
            .await
            .map_err(anyhow::Error::msg)?;
        let ready = restart.elapsed();
        let right = all_right(admin, nodes, restarted_at, limit).await?;
        anyhow::Ok((ready, right))
    };
    let (ready_and_right, recovered) = tokio::join!(ready_and_right, resynced);
    let ((ready, right), recovered) = (ready_and_right?, recovered?);
    report(
        &format!(
            "storm (b) API server away {:.0} s: its start → every node resynced and published",
            api_down.as_secs_f64()
        ),
        format!(
            "{} (its /readyz said ok after {})",
            fmt(recovered),
            fmt(ready)
        ),
    );
    report(
        &format!(
            "storm (b): its start → every node's slices right at the API server ({BREAKS} broke on every node while it was away)"
        ),
        fmt(right),
    );
    report(
        "storm (b): driver API requests while it was away (probes that found no server)",
        rate(down_requests, api_down),
    );
    report(
        "storm (b): driver API requests from its start to every node resynced",
        rate(sampler.now() - back_from, recovered),
    );
    report(
        "storm (b): driver API requests, peak in 1 s after its start",
        sampler.peak_per_second(restart, sampler.mark()),
    );
    anyhow::ensure!(
        slice_count(admin, &names).await? >= n,
        "slices missing after the API server's return"
    );

    // (c) etcd compacts to its current revision while every driver watches.
    let etcd = plane
        .dir()
        .and_then(etcd_client_url)
        .context("etcd's client URL")?;
    let revision = etcd_revision(&etcd).await?;
    let before = resyncs(nodes);
    let errors_before: u64 = nodes
        .iter()
        .filter_map(|n| n.driver.as_ref())
        .map(|d| d.slices().counters().errors.load(Relaxed))
        .sum();
    let from = sampler.now();
    let started = sampler.mark();
    curl_post(
        &etcd,
        "/v3/kv/compaction",
        &format!("{{\"revision\":\"{revision}\",\"physical\":true}}"),
    )
    .await?;
    let compacted_at = Instant::now();
    let mended = nodes
        .iter()
        .filter(|n| n.set_health(BREAKS, devplug::Health::Healthy))
        .count();
    anyhow::ensure!(mended == n, "{BREAKS} mended on {mended} of {n} nodes");
    let right = all_right(admin, nodes, compacted_at, Duration::from_secs(300)).await?;
    report(
        &format!(
            "storm (c): the compaction → every node's slices right at the API server ({BREAKS} mended on every node)"
        ),
        fmt(right),
    );
    tokio::time::sleep(Duration::from_secs(15).saturating_sub(compacted_at.elapsed())).await;
    let after = resyncs(nodes);
    let errors_after: u64 = nodes
        .iter()
        .filter_map(|n| n.driver.as_ref())
        .map(|d| d.slices().counters().errors.load(Relaxed))
        .sum();
    let resynced = after.iter().zip(&before).filter(|(a, b)| a > b).count();
    report(
        &format!("storm (c) etcd compacted to revision {revision}, 15 s after"),
        format!(
            "{resynced} of {n} drivers resynced, {} watch errors, driver API requests {}, peak in 1 s {}",
            errors_after - errors_before,
            rate(sampler.now() - from, started.elapsed()),
            sampler.peak_per_second(started, sampler.mark())
        ),
    );
    anyhow::ensure!(
        slice_count(admin, &names).await? >= n,
        "slices missing after the compaction"
    );
    Ok(())
}

/// etcd's client URL, from its command line.
fn etcd_client_url(dir: &std::path::Path) -> Option<String> {
    let dir = dir.display().to_string();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline);
        if !cmdline.contains(&dir) || !cmdline.contains("--listen-client-urls=") {
            continue;
        }
        return cmdline
            .split('\0')
            .find_map(|a| a.strip_prefix("--listen-client-urls="))
            .map(str::to_owned);
    }
    None
}

async fn curl_post(url: &str, path: &str, body: &str) -> anyhow::Result<String> {
    let out = tokio::process::Command::new("curl")
        .args([
            "-sf",
            "--max-time",
            "10",
            "-X",
            "POST",
            "-d",
            body,
            &format!("{url}{path}"),
        ])
        .output()
        .await?;
    anyhow::ensure!(
        out.status.success(),
        "POST {url}{path}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).to_string())
}

/// etcd's current revision (through its JSON gateway).
async fn etcd_revision(url: &str) -> anyhow::Result<String> {
    let text = curl_post(url, "/v3/kv/range", "{\"key\":\"AA==\"}").await?;
    let value: serde_json::Value = serde_json::from_str(&text)?;
    value["header"]["revision"]
        .as_str()
        .map(str::to_owned)
        .context("no revision in etcd's answer")
}
