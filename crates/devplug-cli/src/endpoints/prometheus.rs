//! `/metrics` in the Prometheus text format: the host's resources and the config reloads, the
//! DRA drivers' counters and claim calls, the cluster features' outcomes.

use super::{DriverCounters, FeatureStatus, ReloadCounters};
use devplug::host::{MetricsSnapshot, ALLOCATE_BUCKETS};
use std::fmt::Write;
use std::sync::atomic::Ordering;

/// The Prometheus text exposition of the DRA drivers' counters (nothing without drivers).
pub fn render_drivers(drivers: &[(String, DriverCounters)]) -> String {
    let mut out = String::new();
    if drivers.is_empty() {
        return out;
    }
    type Read = fn(&DriverCounters) -> u64;
    let families: [(&str, &str, &str, Read); 8] = [
        (
            "devplug_dra_registered",
            "gauge",
            "1 while the kubelet has the DRA driver registered.",
            |c| c.registered,
        ),
        (
            "devplug_dra_slice_publishes_total",
            "counter",
            "ResourceSlice pool states written to the API server.",
            |c| c.publishes,
        ),
        (
            "devplug_dra_slice_errors_total",
            "counter",
            "API errors while publishing or watching ResourceSlices.",
            |c| c.errors,
        ),
        (
            "devplug_dra_slice_consecutive_failures",
            "gauge",
            "Publish attempts that failed since the last one that worked (0: the slices are current as far as the driver knows).",
            |c| c.consecutive_failures,
        ),
        (
            "devplug_dra_slice_last_success_timestamp_seconds",
            "gauge",
            "When the API server last confirmed the driver's ResourceSlices (Unix time; 0: never).",
            |c| c.last_success_unix,
        ),
        (
            "devplug_dra_slice_resyncs_total",
            "counter",
            "Times the driver read its ResourceSlices and Node afresh (a watch failed, or a slice it knew was gone).",
            |c| c.resyncs,
        ),
        (
            "devplug_dra_device_status_writes_total",
            "counter",
            "Claims whose device status (status.devices: a Ready condition and the device's data) the driver wrote.",
            |c| c.status_writes,
        ),
        (
            "devplug_dra_device_status_errors_total",
            "counter",
            "Device status writes the API server refused or that failed (the log says why).",
            |c| c.status_errors,
        ),
    ];
    for (metric, kind, help, read) in families {
        let _ = writeln!(out, "# HELP {metric} {help}\n# TYPE {metric} {kind}");
        for (name, counters) in drivers {
            let _ = writeln!(
                out,
                "{metric}{{driver=\"{}\"}} {}",
                escape(name),
                read(counters)
            );
        }
    }
    #[cfg(feature = "cluster")]
    render_claim_calls(&mut out, drivers);
    out
}

/// The cluster features' outcomes in the Prometheus text format.
pub fn render_features(features: &[(String, FeatureStatus)]) -> String {
    let mut out = String::new();
    if features.is_empty() {
        return out;
    }
    type Pick = fn(&FeatureStatus) -> Option<u64>;
    let families: [(&str, &str, &str, Pick); 5] = [
        (
            "devplug_cluster_writes_total",
            "counter",
            "Writes a cluster feature made to the API server (label sets, capacity changes, refused pods deleted or reported).",
            |s| Some(s.writes),
        ),
        (
            "devplug_cluster_errors_total",
            "counter",
            "Requests of a cluster feature that failed (refused, timed out, API server unreachable).",
            |s| Some(s.errors),
        ),
        (
            "devplug_cluster_fights_total",
            "counter",
            "Put-backs of devplug's node labels that closely followed another writer's change.",
            |s| Some(s.fights),
        ),
        (
            "devplug_cluster_last_success_timestamp_seconds",
            "gauge",
            "When a request of a cluster feature last worked (Unix seconds; 0: never).",
            |s| Some(s.last_success_unix),
        ),
        (
            "devplug_cluster_policy_in_force",
            "gauge",
            "1 when the admission policy keeping a cluster feature to its own node was found in force, 0 when not (the feature then does not run where policies are required).",
            |s| s.policy_in_force.map(u64::from),
        ),
    ];
    for (name, kind, help, pick) in families {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        for (feature, status) in features {
            if let Some(value) = pick(status) {
                let _ = writeln!(out, "{name}{{feature=\"{}\"}} {value}", escape(feature));
            }
        }
    }
    out
}

/// The DRA drivers' prepare and unprepare calls, as Allocate's are for device plugins: claims
/// answered, claims answered with an error, and each call's duration.
#[cfg(feature = "cluster")]
fn render_claim_calls(out: &mut String, drivers: &[(String, DriverCounters)]) {
    use devplug_dra::claim_metrics::{OperationSnapshot, CLAIM_CALL_BUCKETS};
    type Pick = fn(&DriverCounters) -> &OperationSnapshot;
    let operations: [(&str, &str, Pick); 2] = [
        ("prepare", "NodePrepareResources", |c| &c.claims.prepare),
        ("unprepare", "NodeUnprepareResources", |c| {
            &c.claims.unprepare
        }),
    ];
    for (op, call, pick) in operations {
        let claims = format!("devplug_dra_{op}_claims_total");
        let errors = format!("devplug_dra_{op}_errors_total");
        let duration = format!("devplug_dra_{op}_duration_seconds");
        let _ = writeln!(
            out,
            "# HELP {claims} Claims answered in {call} calls.\n# TYPE {claims} counter"
        );
        for (name, c) in drivers {
            let _ = writeln!(
                out,
                "{claims}{{driver=\"{}\"}} {}",
                escape(name),
                pick(c).claims
            );
        }
        let _ = writeln!(
            out,
            "# HELP {errors} Claims answered with an error in {call} calls.\n# TYPE {errors} counter"
        );
        for (name, c) in drivers {
            let _ = writeln!(
                out,
                "{errors}{{driver=\"{}\"}} {}",
                escape(name),
                pick(c).errors
            );
        }
        let _ = writeln!(
            out,
            "# HELP {duration} Time to answer a {call} call.\n# TYPE {duration} histogram"
        );
        for (name, c) in drivers {
            let d = escape(name);
            let s = pick(c);
            for (le, count) in CLAIM_CALL_BUCKETS.iter().zip(&s.buckets) {
                let _ = writeln!(
                    out,
                    "{duration}_bucket{{driver=\"{d}\",le=\"{le}\"}} {count}"
                );
            }
            let _ = writeln!(
                out,
                "{duration}_bucket{{driver=\"{d}\",le=\"+Inf\"}} {}",
                s.calls
            );
            let _ = writeln!(out, "{duration}_sum{{driver=\"{d}\"}} {}", s.seconds);
            let _ = writeln!(out, "{duration}_count{{driver=\"{d}\"}} {}", s.calls);
        }
    }
    let stages = "devplug_dra_prepare_stage_seconds_total";
    let _ = writeln!(
        out,
        "# HELP {stages} Time NodePrepareResources calls spent in each stage: read (the claims from the API server), lock (waiting for the driver's lock), change (backend, CDI specs), write (the checkpoint write, its own or its group's).\n# TYPE {stages} counter"
    );
    for (name, c) in drivers {
        let d = escape(name);
        for (stage, seconds) in devplug_dra::claim_metrics::PREPARE_STAGES
            .iter()
            .zip(c.claims.prepare_stages)
        {
            let _ = writeln!(
                out,
                "{stages}{{driver=\"{d}\",stage=\"{stage}\"}} {seconds}"
            );
        }
    }
}

/// The Prometheus text exposition of every resource's metrics.
pub fn render(resources: &[(String, MetricsSnapshot)], reloads: &ReloadCounters) -> String {
    let mut out = String::new();
    let family = |out: &mut String, name: &str, kind: &str, help: &str| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    };
    type Read = fn(&MetricsSnapshot) -> f64;
    let simple: [(&str, &str, &str, Read); 10] = [
        (
            "devplug_registered",
            "gauge",
            "1 while registered with the current kubelet.",
            |m| f64::from(u8::from(m.registered)),
        ),
        (
            "devplug_list_too_large",
            "gauge",
            "1 while the device list is over the kubelet's 4 MiB message limit and is not sent.",
            |m| f64::from(u8::from(m.list_error.is_some())),
        ),
        (
            "devplug_list_streams",
            "gauge",
            "Open ListAndWatch streams.",
            |m| m.streams as f64,
        ),
        (
            "devplug_registrations_total",
            "counter",
            "Successful registrations with the kubelet.",
            |m| m.registrations as f64,
        ),
        (
            "devplug_registration_failures_total",
            "counter",
            "Failed registration attempts.",
            |m| m.registration_failures as f64,
        ),
        (
            "devplug_kubelet_restarts_total",
            "counter",
            "Kubelet restarts noticed.",
            |m| m.kubelet_restarts as f64,
        ),
        (
            "devplug_watchdog_reregistrations_total",
            "counter",
            "Registrations started because the kubelet's allocatable (pod resources API) stayed below the healthy devices streamed to it.",
            |m| m.watchdog_reregistrations as f64,
        ),
        (
            "devplug_list_updates_total",
            "counter",
            "ListAndWatch messages sent.",
            |m| m.list_updates as f64,
        ),
        (
            "devplug_allocate_total",
            "counter",
            "Allocate calls answered.",
            |m| m.allocations as f64,
        ),
        (
            "devplug_allocate_errors_total",
            "counter",
            "Allocate calls answered with an error.",
            |m| m.allocation_errors as f64,
        ),
    ];
    family(
        &mut out,
        "devplug_devices",
        "gauge",
        "Devices the kubelet is told about, by health.",
    );
    for (name, m) in resources {
        let r = escape(name);
        let _ = writeln!(
            out,
            "devplug_devices{{resource=\"{r}\",health=\"healthy\"}} {}",
            m.healthy
        );
        let _ = writeln!(
            out,
            "devplug_devices{{resource=\"{r}\",health=\"unhealthy\"}} {}",
            m.unhealthy
        );
    }
    family(
        &mut out,
        "devplug_devices_allocated",
        "gauge",
        "Devices allocated to pods, from the kubelet's pod resources API (absent until it answers).",
    );
    for (name, m) in resources {
        if let Some(allocated) = m.allocated {
            let _ = writeln!(
                out,
                "devplug_devices_allocated{{resource=\"{}\"}} {allocated}",
                escape(name)
            );
        }
    }
    family(
        &mut out,
        "devplug_foreign_devices",
        "gauge",
        "Devices the kubelet can allocate under the resource's name that devplug does not serve: another device plugin registered the same name (from the pod resources API; absent until it answers).",
    );
    for (name, m) in resources {
        if let Some(foreign) = m.foreign_devices {
            let _ = writeln!(
                out,
                "devplug_foreign_devices{{resource=\"{}\"}} {foreign}",
                escape(name)
            );
        }
    }
    family(
        &mut out,
        "devplug_device_unhealthy",
        "gauge",
        "1 for each unhealthy device, with its reason (the kubelet only sees \"Unhealthy\").",
    );
    for (name, m) in resources {
        for (device, reason) in &m.unhealthy_reasons {
            let _ = writeln!(
                out,
                "devplug_device_unhealthy{{resource=\"{}\",device=\"{}\",reason=\"{}\"}} 1",
                escape(name),
                escape(device),
                escape(reason)
            );
        }
    }
    family(
        &mut out,
        "devplug_backend_warning",
        "gauge",
        "1 for each problem a backend reports that does not stop it (e.g. a hostdev group that matches no device).",
    );
    for (name, m) in resources {
        for (kind, detail) in &m.warnings {
            let _ = writeln!(
                out,
                "devplug_backend_warning{{resource=\"{}\",kind=\"{}\",detail=\"{}\"}} 1",
                escape(name),
                escape(kind),
                escape(detail)
            );
        }
    }
    for (metric, kind, help, read) in simple {
        family(&mut out, metric, kind, help);
        for (name, m) in resources {
            let _ = writeln!(out, "{metric}{{resource=\"{}\"}} {}", escape(name), read(m));
        }
    }
    family(
        &mut out,
        "devplug_allocate_duration_seconds",
        "histogram",
        "Time to answer Allocate.",
    );
    for (name, m) in resources {
        let r = escape(name);
        for (le, count) in ALLOCATE_BUCKETS.iter().zip(&m.allocate_buckets) {
            let _ = writeln!(
                out,
                "devplug_allocate_duration_seconds_bucket{{resource=\"{r}\",le=\"{le}\"}} {count}"
            );
        }
        let _ = writeln!(
            out,
            "devplug_allocate_duration_seconds_bucket{{resource=\"{r}\",le=\"+Inf\"}} {}",
            m.allocations
        );
        let _ = writeln!(
            out,
            "devplug_allocate_duration_seconds_sum{{resource=\"{r}\"}} {}",
            m.allocate_seconds
        );
        let _ = writeln!(
            out,
            "devplug_allocate_duration_seconds_count{{resource=\"{r}\"}} {}",
            m.allocations
        );
    }
    family(
        &mut out,
        "devplug_config_reloads_total",
        "counter",
        "Config file reloads applied.",
    );
    let _ = writeln!(
        out,
        "devplug_config_reloads_total {}",
        reloads.reloads.load(Ordering::Relaxed)
    );
    family(
        &mut out,
        "devplug_config_reload_failures_total",
        "counter",
        "Config file reloads refused or partly failed.",
    );
    let _ = writeln!(
        out,
        "devplug_config_reload_failures_total {}",
        reloads.failures.load(Ordering::Relaxed)
    );
    out
}

fn escape(label: &str) -> String {
    label
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text() {
        let m = MetricsSnapshot {
            healthy: 7,
            unhealthy: 1,
            unhealthy_reasons: vec![("d3".into(), "fan \"stuck\"".into())],
            registered: true,
            streams: 1,
            registrations: 2,
            allocations: 3,
            allocate_buckets: vec![0, 1, 2, 3, 3, 3, 3, 3, 3, 3],
            allocate_seconds: 0.0004,
            list_error: Some("too big".into()),
            allocated: Some(5),
            watchdog_reregistrations: 1,
            warnings: vec![(
                "group_matches_nothing".into(),
                "groups[0]: /dev/ttyX*".into(),
            )],
            ..MetricsSnapshot::default()
        };
        let reloads = ReloadCounters::default();
        reloads.reloads.store(4, Ordering::Relaxed);
        let text = render(&[("a.com/x".to_owned(), m)], &reloads);
        for line in [
            "# TYPE devplug_devices gauge",
            "devplug_devices{resource=\"a.com/x\",health=\"healthy\"} 7",
            "devplug_devices{resource=\"a.com/x\",health=\"unhealthy\"} 1",
            "devplug_device_unhealthy{resource=\"a.com/x\",device=\"d3\",reason=\"fan \\\"stuck\\\"\"} 1",
            "devplug_registered{resource=\"a.com/x\"} 1",
            "devplug_registrations_total{resource=\"a.com/x\"} 2",
            "devplug_allocate_duration_seconds_bucket{resource=\"a.com/x\",le=\"0.0001\"} 1",
            "devplug_allocate_duration_seconds_bucket{resource=\"a.com/x\",le=\"+Inf\"} 3",
            "devplug_allocate_duration_seconds_count{resource=\"a.com/x\"} 3",
            "devplug_config_reloads_total 4",
            "devplug_devices_allocated{resource=\"a.com/x\"} 5",
            "devplug_watchdog_reregistrations_total{resource=\"a.com/x\"} 1",
            "devplug_list_too_large{resource=\"a.com/x\"} 1",
            "devplug_backend_warning{resource=\"a.com/x\",kind=\"group_matches_nothing\",detail=\"groups[0]: /dev/ttyX*\"} 1",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        assert_eq!(escape("a\"b\\c"), "a\\\"b\\\\c");
    }
}
