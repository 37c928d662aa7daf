//! What the control plane says about itself: its processes' CPU time and memory (from /proc,
//! found by the control plane's folder on their command lines), the scheduler's and the API
//! server's `/metrics`, and this process's resident memory and CPU time.

use std::collections::BTreeMap;
use std::path::Path;

/// CPU seconds (user + system) and resident memory of each control-plane process, by name.
pub fn control_plane_processes(dir: &Path) -> BTreeMap<String, (f64, u64)> {
    let mut out = BTreeMap::new();
    let dir = dir.display().to_string();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return out;
    };
    for entry in entries.flatten() {
        let pid = entry.file_name().to_string_lossy().to_string();
        if !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline);
        if !cmdline.contains(&dir) {
            continue;
        }
        let binary = cmdline.split('\0').next().unwrap_or_default();
        let name = Path::new(binary)
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        if ![
            "etcd",
            "kube-apiserver",
            "kube-scheduler",
            "kube-controller-manager",
        ]
        .contains(&name.as_str())
        {
            continue;
        }
        if let Some((cpu, rss)) = process_usage(&pid) {
            out.insert(name, (cpu, rss));
        }
    }
    out
}

/// CPU seconds and resident bytes of process `pid` ("self" for this one).
pub fn process_usage(pid: &str) -> Option<(f64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces), from field 3 on.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())?;
    // USER_HZ is 100 on Linux.
    Some(((utime + stime) / 100.0, rss_kib.saturating_mul(1024)))
}

/// The sum of every sample of `metric` (all label sets) in a Prometheus text exposition.
pub fn metric_sum(text: &str, metric: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(metric)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(0.0, |a, b| a + b)
}

/// The value of label `label` in a sample line's label set, if any.
fn label_value<'a>(line: &'a str, label: &str) -> Option<&'a str> {
    let set = line.split_once('{')?.1.split_once('}')?.0;
    set.split(',').find_map(|pair| {
        let (key, value) = pair.split_once('=')?;
        (key.trim() == label).then(|| value.trim().trim_matches('"'))
    })
}

/// The API server's priority-and-fairness queue waits since its start, by priority level: the
/// seconds waited in all and the requests, of every level that queued a request.
pub fn wait_by_priority_level(text: &str) -> BTreeMap<String, (f64, f64)> {
    let mut out: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    let base = "apiserver_flowcontrol_request_wait_duration_seconds";
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let (is_sum, rest) = if let Some(rest) = line.strip_prefix(&format!("{base}_sum")) {
            (true, rest)
        } else if let Some(rest) = line.strip_prefix(&format!("{base}_count")) {
            (false, rest)
        } else {
            continue;
        };
        let (Some(level), Some(value)) = (
            label_value(rest, "priority_level"),
            line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()),
        ) else {
            continue;
        };
        let entry = out.entry(level.to_owned()).or_default();
        if is_sum {
            entry.0 += value;
        } else {
            entry.1 += value;
        }
    }
    out.retain(|_, (_, count)| *count > 0.0);
    out
}

/// The `/metrics` of kube-scheduler or kube-controller-manager on `port` (HTTPS with its
/// self-signed certificate, read anonymously: the path is allowed without authorization on its
/// command line).
pub async fn component_metrics(port: u16) -> String {
    let out = tokio::process::Command::new("curl")
        .args([
            "-sk",
            "--max-time",
            "10",
            &format!("https://127.0.0.1:{port}/metrics"),
        ])
        .output()
        .await;
    out.map(|o| String::from_utf8_lossy(&o.stdout).to_string())
        .unwrap_or_default()
}

/// The API server's `/metrics`, read by `client`.
pub async fn apiserver_metrics(client: &kube::Client) -> String {
    let Ok(request) = http::Request::get("/metrics").body(Vec::new()) else {
        return String::new();
    };
    client.request_text(request).await.unwrap_or_default()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn queue_waits_are_summed_by_priority_level_and_idle_levels_left_out() {
        let text = r#"# HELP apiserver_flowcontrol_request_wait_duration_seconds [BETA] Length of time a request spent waiting in its queue
apiserver_flowcontrol_request_wait_duration_seconds_bucket{execute="true",flow_schema="service-accounts",priority_level="workload-low",le="0.005"} 3
apiserver_flowcontrol_request_wait_duration_seconds_sum{execute="true",flow_schema="service-accounts",priority_level="workload-low"} 0.5
apiserver_flowcontrol_request_wait_duration_seconds_count{execute="true",flow_schema="service-accounts",priority_level="workload-low"} 4
apiserver_flowcontrol_request_wait_duration_seconds_sum{execute="false",flow_schema="service-accounts",priority_level="workload-low"} 1.5
apiserver_flowcontrol_request_wait_duration_seconds_count{execute="false",flow_schema="service-accounts",priority_level="workload-low"} 1
apiserver_flowcontrol_request_wait_duration_seconds_sum{execute="true",flow_schema="system-nodes",priority_level="system"} 0
apiserver_flowcontrol_request_wait_duration_seconds_count{execute="true",flow_schema="system-nodes",priority_level="system"} 0
"#;
        let waits = wait_by_priority_level(text);
        assert_eq!(waits.len(), 1);
        assert_eq!(waits.get("workload-low"), Some(&(2.0, 5.0)));
    }
}
