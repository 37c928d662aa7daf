//! The storms a fleet has: (a) every driver restarts at once (a DaemonSet rollout of every
//! node), (b) the API server is away for a while, (c) etcd compacts its history while the
//! drivers watch. For each: how long until every node's slices are right again, and the
//! drivers' request peak.

use super::api_count::ClientFactory;
use super::figures::{fmt, rate, report, Sampler};
use super::node::SimNode;
use super::setup::Plane;
use super::slices::{all_published, slice_count};
use anyhow::Context;
use futures_util::future::join_all;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

pub(super) async fn run(
    plane: &mut Plane,
    admin: &kube::Client,
    nodes: &mut [SimNode],
    drivers: &ClientFactory,
    sampler: &Sampler,
    api_down: Duration,
) -> anyhow::Result<()> {
    let n = nodes.len();

    // (a) Every driver stops (slices kept, as devplug does at SIGTERM) and starts again
    // with a new client, reading its checkpoint.
    let from = sampler.now();
    let started = sampler.mark();
    let stops = join_all(nodes.iter_mut().map(SimNode::stop_driver)).await;
    anyhow::ensure!(
        stops.iter().all(Vec::is_empty),
        "driver shutdown: {stops:?}"
    );
    for node in nodes.iter_mut() {
        node.start_driver(drivers.client()?).await?;
    }
    let took = all_published(nodes, Duration::from_secs(600)).await?;
    let total = started.elapsed();
    report(
        "storm (a) every driver restarts: stop of all → every node's slices published again",
        format!("{} (publish after start {})", fmt(total), fmt(took)),
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
        slice_count(admin).await? >= n,
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
    plane.plane.stop_api_server().map_err(anyhow::Error::msg)?;
    let down_from = sampler.now();
    tokio::time::sleep(api_down).await;
    let down_requests = sampler.now() - down_from;
    let back_from = sampler.now();
    let restart = sampler.mark();
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
    let ready = async {
        plane
            .plane
            .start_api_server()
            .await
            .map_err(anyhow::Error::msg)?;
        anyhow::Ok(restart.elapsed())
    };
    let (ready, recovered) = tokio::join!(ready, resynced);
    let (ready, recovered) = (ready?, recovered?);
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
        slice_count(admin).await? >= n,
        "slices missing after the API server's return"
    );

    // (c) etcd compacts to its current revision while every driver watches.
    let etcd = etcd_client_url(plane.dir.path()).context("etcd's client URL")?;
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
    tokio::time::sleep(Duration::from_secs(15)).await;
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
        slice_count(admin).await? >= n,
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
