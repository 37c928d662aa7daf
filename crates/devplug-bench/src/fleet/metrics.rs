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

/// The scheduler's `/metrics` (HTTPS with its self-signed certificate, read anonymously: the
/// path is allowed without authorization on its command line).
pub async fn scheduler_metrics(port: u16) -> String {
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
