//! What the control plane did while the workload ran (the fill and the churn): the
//! scheduler's attempts per pod, the API server's requests, rejections and queueing, and each
//! control-plane process's CPU time and memory.

use super::figures::report;
use super::metrics;
use super::setup::Plane;

/// Prints the control plane's figures; `sched_before` is the scheduler's metrics text from
/// before the workload.
pub(super) async fn report_workload(plane: &Plane, admin: &kube::Client, sched_before: &str) {
    let sched_after = metrics::scheduler_metrics(plane.scheduler_port).await;
    let attempts = metrics::metric_sum(&sched_after, "scheduler_pod_scheduling_attempts_sum")
        - metrics::metric_sum(sched_before, "scheduler_pod_scheduling_attempts_sum");
    let pods = metrics::metric_sum(&sched_after, "scheduler_pod_scheduling_attempts_count")
        - metrics::metric_sum(sched_before, "scheduler_pod_scheduling_attempts_count");
    report(
        "scheduler attempts per pod (scheduler_pod_scheduling_attempts sum/count)",
        format!(
            "{:.3} ({attempts:.0} attempts, {pods:.0} pods)",
            attempts / pods.max(1.0)
        ),
    );
    let apiserver = metrics::apiserver_metrics(admin).await;
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
}
