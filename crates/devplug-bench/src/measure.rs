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
pub(crate) fn devplug_binary() -> anyhow::Result<PathBuf> {
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

/// The machine's CPU time counters from the first line of /proc/stat, in clock ticks.
pub struct MachineCpu {
    busy: u64,
    steal: u64,
    total: u64,
}

/// Reads [`MachineCpu`] now; `None` where /proc/stat is unreadable.
pub fn machine_cpu() -> Option<MachineCpu> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .map(|field| field.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal [guest guest_nice, already in user/nice]
    let total: u64 = ticks.iter().take(8).sum();
    let idle = ticks.get(3)? + ticks.get(4)?;
    let steal = *ticks.get(7)?;
    Some(MachineCpu {
        busy: total.saturating_sub(idle + steal),
        steal,
        total,
    })
}

impl MachineCpu {
    fn percent(part: u64, whole: u64) -> f64 {
        if whole == 0 {
            0.0
        } else {
            100.0 * part as f64 / whole as f64
        }
    }

    /// Share of CPU time spent running something since `before`.
    pub fn busy_percent_since(&self, before: &MachineCpu) -> f64 {
        Self::percent(
            self.busy.saturating_sub(before.busy),
            self.total.saturating_sub(before.total),
        )
    }

    /// Share of CPU time the hypervisor gave to others since `before`.
    pub fn steal_percent_since(&self, before: &MachineCpu) -> f64 {
        Self::percent(
            self.steal.saturating_sub(before.steal),
            self.total.saturating_sub(before.total),
        )
    }
}

pub(crate) fn status_field(pid: u32, field: &str) -> Option<u64> {
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

/// The resources `devplug run` serves in [`process_figures`], 1,000 devices each.
const RESOURCES: [&str; 3] = ["bench.example/a", "bench.example/b", "bench.example/c"];
/// How many times [`process_figures`] starts the process.
const START_SAMPLES: usize = 10;

/// Sends SIGTERM to a `devplug run` child and waits for it to exit.
pub(crate) fn stop(mut child: std::process::Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
}

/// Runs `devplug run` with 3 resources × 1,000 devices against the simulator.
pub async fn process_figures() -> anyhow::Result<()> {
    let bin = devplug_binary()?;
    let dir = tempfile::tempdir()?;
    let plugins = dir.path().join("device-plugins");
    let kubelet = Kubelet::start(&plugins).await?;
    let config = dir.path().join("config.yaml");
    let mut text = String::from("resources:\n");
    for name in RESOURCES {
        text.push_str(&format!(
            "  - name: {name}\n    virtual: {{ count: 1000, numa_nodes: 2 }}\n"
        ));
    }
    std::fs::write(&config, text)?;
    // Start the process several times (one sample is at the mercy of the machine's noise); the
    // last one stays up for the memory and idle figures.
    let mut starts = Vec::with_capacity(START_SAMPLES);
    let mut child = None;
    for round in 0..START_SAMPLES {
        let started = Instant::now();
        let spawned = Command::new(&bin)
            .arg("run")
            .arg("--config")
            .arg(&config)
            .arg("--kubelet-dir")
            .arg(&plugins)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        kubelet
            .wait_for(Duration::from_secs(10), |n| {
                RESOURCES
                    .iter()
                    .all(|r| n.capacity(r) == (1000, 1000))
                    .then_some(())
            })
            .await?;
        starts.push(started.elapsed());
        if round + 1 < START_SAMPLES {
            stop(spawned);
            // Wait until the kubelet saw it go, so the next start is measured from scratch.
            kubelet
                .wait_for(Duration::from_secs(10), |n| {
                    RESOURCES.iter().all(|r| n.capacity(r).1 == 0).then_some(())
                })
                .await?;
        } else {
            child = Some(spawned);
        }
    }
    let child = child.ok_or_else(|| anyhow::anyhow!("no process started"))?;
    let pid = child.id();
    for i in 0..300 {
        let resource = RESOURCES[i % 3];
        kubelet
            .allocate(&format!("pod-{i}"), "main", resource, 2)
            .await?;
        kubelet.remove_pod(&format!("pod-{i}"));
    }
    let ticks_before = cpu_ticks(pid).unwrap_or(0);
    tokio::time::sleep(Duration::from_secs(5)).await;
    let idle_ticks = cpu_ticks(pid).unwrap_or(0).saturating_sub(ticks_before);
    let hwm = status_field(pid, "VmHWM:").unwrap_or(0);
    let rss = status_field(pid, "VmRSS:").unwrap_or(0);
    stop(child);
    let size = std::fs::metadata(&bin)?.len();

    println!();
    println!("| `devplug run`, 3 resources × 1,000 devices | value |");
    println!("|---|---|");
    let starts = percentiles(&mut starts);
    println!(
        "| process start → all 3 registered (release binary, incl. exec), {} starts | p50 {:.1} ms, max {:.1} ms |",
        starts.n,
        starts.p50.as_secs_f64() * 1e3,
        starts.max.as_secs_f64() * 1e3
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
