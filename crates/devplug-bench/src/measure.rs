//! Percentiles, and figures of the real `devplug run` process: peak RSS with 3 resources × 1,000
//! devices, idle CPU, and binary size.

use kubelet_sim::Kubelet;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Percentiles of a set of durations.
pub struct Sample {
    pub p50: Duration,
    pub p99: Duration,
    pub max: Duration,
    pub n: usize,
}

/// Sorts `samples` and reads the percentiles.
pub fn percentiles(samples: &mut [Duration]) -> Sample {
    samples.sort();
    let at = |q: f64| {
        let i = ((samples.len() as f64 - 1.0) * q).round() as usize;
        samples.get(i).copied().unwrap_or_default()
    };
    Sample {
        p50: at(0.50),
        p99: at(0.99),
        max: samples.last().copied().unwrap_or_default(),
        n: samples.len(),
    }
}

/// The `devplug` binary: `$DEVPLUG_BIN` (e.g. the static musl build the image ships), else the
/// one built next to this one (`cargo build --release -p devplug-cli`).
fn devplug_binary() -> anyhow::Result<PathBuf> {
    if let Some(bin) = std::env::var_os("DEVPLUG_BIN") {
        return Ok(PathBuf::from(bin));
    }
    let me = std::env::current_exe()?;
    let bin = me.with_file_name("devplug");
    anyhow::ensure!(
        bin.exists(),
        "{} not found: run `cargo build --release -p devplug-cli` first",
        bin.display()
    );
    Ok(bin)
}

fn status_field(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// utime + stime of a process, in clock ticks.
fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

/// Runs `devplug run` with 3 resources × 1,000 devices against the simulator.
pub async fn process_figures() -> anyhow::Result<()> {
    let bin = devplug_binary()?;
    let dir = tempfile::tempdir()?;
    let plugins = dir.path().join("device-plugins");
    let kubelet = Kubelet::start(&plugins).await?;
    let config = dir.path().join("config.yaml");
    let mut text = String::from("resources:\n");
    for name in ["a", "b", "c"] {
        text.push_str(&format!(
            "  - name: bench.example/{name}\n    virtual: {{ count: 1000, numa_nodes: 2 }}\n"
        ));
    }
    std::fs::write(&config, text)?;
    let started = Instant::now();
    let mut child = Command::new(&bin)
        .arg("run")
        .arg("--config")
        .arg(&config)
        .arg("--kubelet-dir")
        .arg(&plugins)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let pid = child.id();
    kubelet
        .wait_for(Duration::from_secs(10), |n| {
            ["a", "b", "c"]
                .iter()
                .all(|r| n.capacity(&format!("bench.example/{r}")) == (1000, 1000))
                .then_some(())
        })
        .await?;
    let registered = started.elapsed();
    for i in 0..300 {
        let resource = format!("bench.example/{}", ["a", "b", "c"][i % 3]);
        kubelet
            .allocate(&format!("pod-{i}"), "main", &resource, 2)
            .await?;
        kubelet.remove_pod(&format!("pod-{i}"));
    }
    let ticks_before = cpu_ticks(pid).unwrap_or(0);
    tokio::time::sleep(Duration::from_secs(5)).await;
    let idle_ticks = cpu_ticks(pid).unwrap_or(0).saturating_sub(ticks_before);
    let hwm = status_field(pid, "VmHWM:").unwrap_or(0);
    let rss = status_field(pid, "VmRSS:").unwrap_or(0);
    let _ = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let _ = child.wait();
    let size = std::fs::metadata(&bin)?.len();

    println!();
    println!("| `devplug run`, 3 resources × 1,000 devices | value |");
    println!("|---|---|");
    println!(
        "| process start → all 3 registered (release binary, incl. exec) | {:.1} ms |",
        registered.as_secs_f64() * 1e3
    );
    println!(
        "| peak RSS (VmHWM) after registration + 300 allocations | {:.1} MiB |",
        hwm as f64 / 1024.0
    );
    println!("| RSS at rest | {:.1} MiB |", rss as f64 / 1024.0);
    println!("| CPU used while idle for 5 s | {idle_ticks} clock ticks (1 tick = 10 ms) |");
    println!(
        "| release binary size | {:.2} MiB |",
        size as f64 / (1024.0 * 1024.0)
    );
    Ok(())
}
