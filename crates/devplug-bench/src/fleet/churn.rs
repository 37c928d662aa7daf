//! The churn: for `options.churn`, `options.churn_rate` times a second, one pod created and
//! the oldest deleted, or in the clusterloader2 mode one short-lived Job created (its pod ends
//! after `options.job_running`, its claim then freed); every new pod Running.

use super::figures::{cpu_now, percentiles, rate, report, report_cpu, thresholds, Sampler};
use super::fill::Filled;
use super::kubelet::Kubelets;
use super::setup::Cluster;
use super::workload::Kind;
use super::{mode, workload, FleetOptions, Mode};
use std::time::{Duration, Instant};

/// Churns the filled fleet (nothing when `options.churn` is zero); fails when a new pod is not
/// Running in time. Returns the names of the pods it created.
pub(super) async fn run(
    options: &FleetOptions,
    cluster: &Cluster,
    sampler: &Sampler,
    kubelets: &Kubelets,
    created: &workload::Created,
    filled: &Filled,
) -> anyhow::Result<Vec<String>> {
    let (plane, admin) = (&cluster.plane, &cluster.admin);
    let (target, fill_names, fill_prepares) = (filled.target, &filled.names, filled.prepares);
    let mut running = kubelets.running.clone();
    // Churn: one pod created and the oldest deleted, `churn_rate` times a second.
    let mut live: std::collections::VecDeque<String> = fill_names.iter().cloned().collect();
    let mut churn_names = Vec::new();
    if !options.churn.is_zero() {
        let cpu_before = cpu_now(plane.dir());
        let requests_before = sampler.now();
        let started = Instant::now();
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / options.churn_rate));
        let mut tasks = Vec::new();
        let mut i = 0usize;
        let kind = match options.mode {
            Mode::Clusterloader2 => Kind::Job(Some(options.job_running)),
            Mode::SchedulerPerf | Mode::Driver => Kind::Pod,
        };
        while started.elapsed() < options.churn {
            tick.tick().await;
            let name = format!("churn-{i:05}");
            i += 1;
            churn_names.push(name.clone());
            // A short-lived Job ends by itself; a pod is deleted when it is the oldest.
            let old = if kind == Kind::Pod {
                live.push_back(name.clone());
                live.pop_front()
            } else {
                None
            };
            let (client, created) = (admin.clone(), created.clone());
            let target = cluster.target.clone();
            tasks.push(tokio::spawn(async move {
                if let Some(old) = old {
                    workload::delete(&client, &target, &old).await?;
                }
                workload::create_kind(&client, &target, &created, &name, kind).await
            }));
        }
        for task in tasks {
            task.await??;
        }
        let churn_requests = sampler.now() - requests_before;
        let churn_took = started.elapsed();
        let want = target + churn_names.len();
        // Short-lived Jobs need free devices while they run: more at once than the fill left
        // free, and they queue for each other (clusterloader2's shape, 5 a second of 30 s each,
        // needs 150 free: a fleet of 188 nodes or more at 8 devices and 90%).
        let mut limit = Duration::from_secs(120);
        if let Kind::Job(Some(running_for)) = kind {
            let capacity = workload::per_node(options.variant, options.devices)
                .saturating_mul(cluster.names.len());
            let free = capacity.saturating_sub(target).max(1);
            let needed = options.churn_rate * running_for.as_secs_f64();
            report(
                "churn: Jobs running at once in the steady state (rate × running time), devices the fill left free",
                format!(
                    "{needed:.0}, {free}{}",
                    if needed > free as f64 {
                        ": the churn's pods queue for devices at this size"
                    } else {
                        ""
                    }
                ),
            );
            limit =
                limit.saturating_add(running_for.mul_f64(churn_names.len() as f64 / free as f64));
        }
        let done = tokio::time::timeout(limit, running.wait_for(|r| *r >= want))
            .await
            .is_ok_and(|r| r.is_ok());
        anyhow::ensure!(
            done,
            "{limit:?} after the churn: {} of {want} pods ever Running",
            *running.borrow()
        );
        let (mut lat, missing) =
            workload::latencies(created, &kubelets.observed.running, &churn_names);
        anyhow::ensure!(missing == 0, "{missing} churn pods never Running");
        report(
            &format!(
                "churn at {}/s for {:.0} s: pod startup ({} created → Running)",
                options.churn_rate,
                churn_took.as_secs_f64(),
                if kind == Kind::Pod {
                    "pod".to_owned()
                } else {
                    format!(
                        "Job of a pod that runs {:.0} s",
                        options.job_running.as_secs_f64()
                    )
                }
            ),
            percentiles(&mut lat),
        );
        if options.mode == Mode::Clusterloader2 {
            report(
                "churn: against clusterloader2's pod startup thresholds",
                thresholds(&mut lat, mode::CL2_STARTUP_THRESHOLD),
            );
        }
        report(
            "churn: driver API requests",
            rate(churn_requests, churn_took),
        );
        report_cpu("the churn", &cpu_before, &cpu_now(plane.dir()), churn_took);
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
    Ok(churn_names)
}
