//! The drivers' own account of their `NodePrepareResources` calls in every mode, from the
//! counters each driver's `/metrics` exports, beside the kubelet stand-ins' round trips.

use super::figures::report;
use super::kubelet::Kubelets;
use super::node::SimNode;
use devplug_dra::claim_metrics::{CLAIM_CALL_BUCKETS, PREPARE_STAGES};
use std::time::Duration;

/// Reports the drivers' own account of their `NodePrepareResources` calls (the counters their
/// `/metrics` exports as `devplug_dra_prepare_duration_seconds`), summed over the fleet's
/// running drivers (since each one's last start), beside the stand-ins' round trips: the
/// difference is the socket and gRPC.
pub(super) fn report_all(nodes: &[SimNode], kubelets: &Kubelets) {
    let mut calls = 0u64;
    let mut seconds = 0.0f64;
    let mut buckets = vec![0u64; CLAIM_CALL_BUCKETS.len()];
    let mut stages = [0.0f64; PREPARE_STAGES.len()];
    for driver in nodes.iter().filter_map(|n| n.driver.as_ref()) {
        let claims = driver.health().claims.snapshot();
        let prepare = claims.prepare;
        calls = calls.saturating_add(prepare.calls);
        seconds += prepare.seconds;
        for (sum, b) in buckets.iter_mut().zip(&prepare.buckets) {
            *sum = sum.saturating_add(*b);
        }
        for (sum, s) in stages.iter_mut().zip(claims.prepare_stages) {
            *sum += s;
        }
    }
    if calls == 0 {
        return;
    }
    // The bucket bound under which a share `q` of the calls ended (cumulative buckets).
    let under = |q: f64| {
        let want = (calls as f64 * q).ceil() as u64;
        CLAIM_CALL_BUCKETS
            .iter()
            .zip(&buckets)
            .find(|(_, c)| **c >= want)
            .map_or_else(
                || format!("> {} s", CLAIM_CALL_BUCKETS[CLAIM_CALL_BUCKETS.len() - 1]),
                |(le, _)| format!("≤ {} ms", le * 1e3),
            )
    };
    let stand_in = kubelets
        .observed
        .prepare_times
        .lock()
        .map(|t| t.iter().map(Duration::as_secs_f64).sum::<f64>() / t.len().max(1) as f64)
        .unwrap_or(0.0);
    report(
        "the drivers' own NodePrepareResources calls, inside the call (their histogram)",
        format!(
            "{calls} calls, mean {:.2} ms, p50 {}, p99 {} (the stand-ins' round trip: mean {:.2} ms)",
            seconds / calls as f64 * 1e3,
            under(0.5),
            under(0.99),
            stand_in * 1e3
        ),
    );
    let parts: Vec<String> = PREPARE_STAGES
        .iter()
        .zip(stages)
        .map(|(stage, s)| format!("{stage} {:.2} ms", s / calls as f64 * 1e3))
        .collect();
    report(
        "the drivers' own NodePrepareResources calls, mean time in each stage (devplug_dra_prepare_stage_seconds_total)",
        parts.join(", "),
    );
}
