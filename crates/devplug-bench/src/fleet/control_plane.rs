//! What the control plane did while the workload ran (the fill and the churn): the
//! scheduler's attempts per pod, the API server's requests, rejections and queueing, and each
//! control-plane process's CPU time and memory.

use super::figures::report;
use super::metrics;
use super::setup::Plane;

/// The scheduler's and controller manager's metrics before the workload.
pub(super) struct Before {
    scheduler: String,
    controller_manager: String,
}

impl Before {
    pub(super) async fn read(plane: &Plane) -> Before {
        Before {
            scheduler: read(plane.scheduler_port).await,
            controller_manager: read(plane.controller_manager_port).await,
        }
    }
}

async fn read(port: Option<u16>) -> String {
    match port {
        Some(port) => metrics::component_metrics(port).await,
        None => String::new(),
    }
}

/// How long a component's requests waited in its own client-side rate limiter since `before`.
fn report_throttle(component: &str, before: &str, after: &str) {
    let delta =
        |metric: &str| metrics::metric_sum(after, metric) - metrics::metric_sum(before, metric);
    let waited = delta("rest_client_rate_limiter_duration_seconds_sum");
    let requests = delta("rest_client_rate_limiter_duration_seconds_count");
    report(
        &format!("{component}: its requests' wait in its own client-side rate limiter (rest_client_rate_limiter_duration_seconds)"),
        format!(
            "{requests:.0} requests, {waited:.1} s waited in all, {:.1} ms each on average",
            waited / requests.max(1.0) * 1e3
        ),
    );
}

/// Prints the control plane's figures; `before` is what its components said before the
/// workload.
pub(super) async fn report_workload(plane: &Plane, admin: &kube::Client, before: &Before) {
    if let Some(port) = plane.scheduler_port {
        let after = metrics::component_metrics(port).await;
        let delta = |metric: &str| {
            metrics::metric_sum(&after, metric) - metrics::metric_sum(&before.scheduler, metric)
        };
        let attempts = delta("scheduler_pod_scheduling_attempts_sum");
        let pods = delta("scheduler_pod_scheduling_attempts_count");
        report(
            "scheduler attempts per pod (scheduler_pod_scheduling_attempts sum/count)",
            format!(
                "{:.3} ({attempts:.0} attempts, {pods:.0} pods)",
                attempts / pods.max(1.0)
            ),
        );
        report_throttle("kube-scheduler", &before.scheduler, &after);
    }
    if let Some(port) = plane.controller_manager_port {
        let after = metrics::component_metrics(port).await;
        report_throttle(
            "kube-controller-manager",
            &before.controller_manager,
            &after,
        );
    }
    let apiserver = metrics::apiserver_metrics(admin).await;
    report(
        "API server: requests served in all (apiserver_request_total)",
        metrics::metric_sum(&apiserver, "apiserver_request_total"),
    );
    report(
        "API server: requests rejected for overload (apiserver_flowcontrol_rejected_requests_total)",
        metrics::metric_sum(&apiserver, "apiserver_flowcontrol_rejected_requests_total"),
    );
    for (level, (waited, count)) in metrics::wait_by_priority_level(&apiserver) {
        report(
            &format!("API server: requests of priority level {level} queued by priority and fairness (apiserver_flowcontrol_request_wait_duration_seconds)"),
            format!(
                "{count:.0}, {:.2} ms each on average",
                waited / count.max(1.0) * 1e3
            ),
        );
    }
    let processes = plane
        .dir()
        .map(metrics::control_plane_processes)
        .unwrap_or_default();
    for (name, (cpu, rss)) in processes {
        report(
            &format!("{name}: CPU time so far, resident memory"),
            format!("{cpu:.1} s, {} MiB", rss >> 20),
        );
    }
}
