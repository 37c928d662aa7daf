//! The fill: pods of one claim each (Jobs of one such pod in the clusterloader2 mode, which
//! run until the teardown) created until the fleet's capacity is taken to `options.fill`,
//! every one Running, every claim prepared once on its pod's node. In the scheduler-perf
//! mode the pods bound a second are reported apart, beside upstream's threshold.

use super::figures::{cpu_now, percentiles, rate, report, report_cpu, thresholds, Sampler};
use super::kubelet::{self, Kubelets};
use super::node::SimNode;
use super::setup::Cluster;
use super::workload::{Kind, Pace};
use super::{mode, workload, FleetOptions, Mode};
use std::time::{Duration, Instant};

/// What the fill left for the churn.
pub(super) struct Filled {
    /// How many pods it made Running.
    pub(super) target: usize,
    /// Their names, oldest first.
    pub(super) names: Vec<String>,
    /// `NodePrepareResources` calls the stand-ins had made when it ended.
    pub(super) prepares: usize,
}

/// Fills the fleet to `options.fill` of its capacity, `options.in_flight` creations at once;
/// fails when a pod is not Running in time or a claim is not prepared once on its pod's node.
pub(super) async fn run(
    options: &FleetOptions,
    cluster: &Cluster,
    nodes: &[SimNode],
    sampler: &Sampler,
    kubelets: &Kubelets,
    created: &workload::Created,
) -> anyhow::Result<Filled> {
    let n = cluster.names.len();
    let (plane, admin) = (&cluster.plane, &cluster.admin);
    let capacity = workload::per_node(options.variant, options.devices).saturating_mul(n);
    let target = ((capacity as f64) * options.fill).floor() as usize;
    let fill_names: Vec<String> = (0..target).map(|i| format!("fill-{i:05}")).collect();
    let cpu_before = cpu_now(plane.dir());
    let requests_before = sampler.now();
    let started = Instant::now();
    let mut running = kubelets.running.clone();
    let kind = match options.mode {
        Mode::Clusterloader2 => Kind::Job(None),
        Mode::SchedulerPerf | Mode::Driver => Kind::Pod,
    };
    let pace = options
        .fill_rate
        .map_or(Pace::InFlight(options.in_flight), Pace::PerSecond);
    workload::create_all(admin, &cluster.target, created, &fill_names, kind, pace).await?;
    let paced = options.fill_rate.map_or(Duration::ZERO, |r| {
        Duration::from_secs_f64(target as f64 / r)
    });
    let limit = Duration::from_secs(60)
        .max(Duration::from_millis(200 * target as u64))
        .saturating_add(paced);
    let filled = tokio::time::timeout(limit, running.wait_for(|r| *r >= target))
        .await
        .is_ok_and(|r| r.is_ok());
    let fill_took = started.elapsed();
    let failures = kubelets.observed.failures();
    if !filled {
        let doubled = doubly_claimed(admin, &cluster.target).await.unwrap_or(0);
        anyhow::bail!(
            "the fill did not finish in {limit:?}: {} of {target} pods Running; failures: {:?}{}",
            *running.borrow(),
            &failures[..failures.len().min(10)],
            if doubled > 0 {
                format!(
                    "; {doubled} pods got a second claim from their template: kube-controller-manager's \
                     ResourceClaim controller (1.36) keeps the claims it created last in a cache of \
                     100 and, when its informer lags behind a burst of pods, makes a claim again; \
                     the pod's status then names the one the scheduler did not allocate, and no \
                     kubelet can prepare it (fewer creations in flight avoid it: --in-flight)"
                )
            } else {
                String::new()
            }
        );
    }
    let what = match kind {
        Kind::Pod => "pods",
        Kind::Job(_) => "Jobs of one pod",
    };
    report(
        "fill",
        format!(
            "{target} {what} ({:.0}% of {capacity}) in {:.1} s: {:.1} Running a second{}",
            options.fill * 100.0,
            fill_took.as_secs_f64(),
            target as f64 / fill_took.as_secs_f64(),
            match pace {
                Pace::InFlight(n) => format!(" ({n} creations in flight)"),
                Pace::PerSecond(r) => format!(" (created at {r}/s)"),
            }
        ),
    );
    if options.mode == Mode::SchedulerPerf {
        report_bound(kubelets, created, &fill_names, started);
    }
    let (mut fill_lat, missing) =
        workload::latencies(created, &kubelets.observed.running, &fill_names);
    anyhow::ensure!(missing == 0, "{missing} fill pods never Running");
    report(
        &format!(
            "fill: pod startup ({} created → Running)",
            if kind == Kind::Pod { "pod" } else { "Job" }
        ),
        percentiles(&mut fill_lat),
    );
    if options.mode == Mode::Clusterloader2 {
        report(
            "fill: against clusterloader2's pod startup thresholds",
            thresholds(&mut fill_lat, mode::CL2_STARTUP_THRESHOLD),
        );
    }
    report(
        "fill: driver API requests",
        rate(sampler.now() - requests_before, fill_took),
    );
    report_cpu("the fill", &cpu_before, &cpu_now(plane.dir()), fill_took);
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
    check_prepared(nodes, &kubelets.observed, target).await?;
    Ok(Filled {
        target,
        names: fill_names,
        prepares: fill_prepares,
    })
}

/// The scheduler-perf mode's figure: pods bound a second, from the first creation to the last
/// binding the kubelet stand-ins saw, beside upstream's threshold for the same shape.
fn report_bound(
    kubelets: &Kubelets,
    created: &workload::Created,
    names: &[String],
    started: Instant,
) {
    let (mut bound, missing) = workload::latencies(created, &kubelets.observed.bound, names);
    let last = kubelets
        .observed
        .bound
        .lock()
        .ok()
        .and_then(|b| names.iter().filter_map(|n| b.get(n)).max().copied());
    let Some(last) = last else { return };
    let took = last.saturating_duration_since(started);
    let (for_136, for_137) = mode::SCHEDULER_PERF_THRESHOLD;
    report(
        "fill: pods bound a second (first creation → last binding seen), scheduler_perf's measure",
        format!(
            "{:.1} ({} pods in {:.1} s; {missing} not seen bound); upstream's threshold for SchedulingWithResourceClaimTemplate/5000pods_500nodes: {for_136} with the 1.36 scheduler, {for_137} with 1.37's",
            names.len().saturating_sub(missing) as f64 / took.as_secs_f64().max(1e-3),
            names.len().saturating_sub(missing),
            took.as_secs_f64()
        ),
    );
    report("fill: pod created → bound", percentiles(&mut bound));
}

/// Pods of the target with more than one claim made from their template (the ResourceClaim
/// controller's double creation under load).
async fn doubly_claimed(admin: &kube::Client, target: &workload::Target) -> anyhow::Result<usize> {
    use k8s_openapi::api::resource::v1::ResourceClaim;
    let claims: kube::Api<ResourceClaim> = kube::Api::namespaced(admin.clone(), &target.namespace);
    let mut per_pod: std::collections::HashMap<String, usize> = Default::default();
    for claim in claims.list_metadata(&Default::default()).await?.items {
        for owner in claim.metadata.owner_references.unwrap_or_default() {
            *per_pod.entry(owner.uid).or_default() += 1;
        }
    }
    Ok(per_pod.values().filter(|n| **n > 1).count())
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
