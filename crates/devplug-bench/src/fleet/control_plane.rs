//! What the control plane did while the workload ran (the fill and the churn): the
//! scheduler's attempts per pod, the API server's requests, rejections and queueing, and each
//! control-plane process's CPU time and memory.

use super::figures::report;
use super::metrics;
use super::setup::Plane;

/// Prints the control plane's figures; `sched_before` is the scheduler's metrics text from
/// before the workload.
pub(super) async fn report_workload(plane: &Plane, admin: &kube::Client, sched_before: &str) {
    if let Some(port) = plane.scheduler_port {
        let sched_after = metrics::scheduler_metrics(port).await;
        let delta = |metric: &str| {
            metrics::metric_sum(&sched_after, metric) - metrics::metric_sum(sched_before, metric)
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
        // The scheduler's own client-side limiter: how long its requests waited for a token.
        let waited = delta("rest_client_rate_limiter_duration_seconds_sum");
        let requests = delta("rest_client_rate_limiter_duration_seconds_count");
        report(
            "kube-scheduler: its requests' wait in its own client-side rate limiter (rest_client_rate_limiter_duration_seconds)",
            format!(
                "{requests:.0} requests, {waited:.1} s waited in all, {:.1} ms each on average",
                waited / requests.max(1.0) * 1e3
            ),
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
    for (name, (cpu, rss)) in metrics::control_plane_processes(plane.dir.path()) {
        report(
            &format!("{name}: CPU time so far, resident memory"),
            format!("{cpu:.1} s, {} MiB", rss >> 20),
        );
    }
}
