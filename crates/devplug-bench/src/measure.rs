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

/// The `devplug` binary: `$DEVPLUG_BIN` (e.g. the static musl build the image ships, or a copy
/// of the device-plugin-only build named devplug-lite), else the one built next to this one
/// (`cargo build --release -p devplug-cli`).
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

/// Resident memory per mapping (a file's name, `[heap]`, `[stack]`, or `anonymous`), largest
/// first, in KiB, from /proc/PID/smaps.
fn rss_by_mapping(pid: u32) -> Vec<(String, u64)> {
    let Ok(smaps) = std::fs::read_to_string(format!("/proc/{pid}/smaps")) else {
        return Vec::new();
    };
    let mut sums: std::collections::BTreeMap<String, u64> = std::collections::BTreeMap::new();
    let mut current = String::new();
    for line in smaps.lines() {
        let mut fields = line.split_whitespace();
        let first = fields.next().unwrap_or_default();
        if first.contains('-') && first.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
            // A mapping's header: address perms offset dev inode [path].
            let path = fields.nth(4).unwrap_or("anonymous");
            current = path.rsplit('/').next().unwrap_or(path).to_owned();
        } else if first == "Rss:" {
            let kib: u64 = fields.next().and_then(|v| v.parse().ok()).unwrap_or(0);
            *sums.entry(current.clone()).or_default() += kib;
        }
    }
    let mut sums: Vec<(String, u64)> = sums.into_iter().collect();
    sums.sort_by_key(|(_, kib)| std::cmp::Reverse(*kib));
    sums
}

/// With `DEVPLUG_BENCH_SMAPS=DIR`: copies /proc/PID/smaps to `DIR/smaps-<what>` for a closer look
/// at where the memory goes (code, relocated data, heap) than the summary rows give.
fn keep_smaps(pid: u32, what: &str) {
    let Some(dir) = std::env::var_os("DEVPLUG_BENCH_SMAPS") else {
        return;
    };
    let to = std::path::Path::new(&dir).join(format!("smaps-{what}"));
    if let Err(err) = std::fs::copy(format!("/proc/{pid}/smaps"), &to) {
        eprintln!("cannot keep smaps in {}: {err}", to.display());
    }
}

/// With `DEVPLUG_BENCH_DROP_CACHES=1` (needs root), empties the page cache, so the next start
/// reads the binary from disk as a node does from its image layer. A binary just written (by
/// the linker, `strip` or `cp`) sits in the page cache in whatever folios the writes made, and
/// the kernel maps a cached folio's pages together: the same binary then measured 3.4–4.4 MiB
/// peak (docs/benchmarks.md, "Link order").
fn drop_page_cache() {
    if std::env::var("DEVPLUG_BENCH_DROP_CACHES").as_deref() != Ok("1") {
        return;
    }
    let synced = Command::new("sync").status().is_ok_and(|s| s.success());
    if !synced || std::fs::write("/proc/sys/vm/drop_caches", "3").is_err() {
        eprintln!("DEVPLUG_BENCH_DROP_CACHES=1: could not drop the page cache (root needed)");
    }
}

/// Starts `devplug run` quietly with `config` against the kubelet folder `plugins`.
pub(crate) fn spawn_run(
    bin: &std::path::Path,
    config: &std::path::Path,
    plugins: &std::path::Path,
) -> std::io::Result<std::process::Child> {
    Command::new(bin)
        .arg("run")
        .arg("--config")
        .arg(config)
        .arg("--kubelet-dir")
        .arg(plugins)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
}

/// Peak RSS of `devplug run` serving one resource of 64 virtual devices after 64 Allocate calls:
/// the scenario in which a Go plugin (squat/generic-device-plugin) peaks at 10.4 MiB
/// (docs/benchmarks.md). Returns (peak, anonymous, file-backed) in KiB.
pub async fn small_process_memory() -> anyhow::Result<(u64, u64, u64)> {
    let bin = devplug_binary()?;
    let dir = tempfile::tempdir()?;
    let plugins = dir.path().join("device-plugins");
    let kubelet = Kubelet::start(&plugins).await?;
    let config = dir.path().join("config.yaml");
    std::fs::write(
        &config,
        "resources:\n  - name: bench.example/small\n    virtual: { count: 64 }\n",
    )?;
    drop_page_cache();
    let child = spawn_run(&bin, &config, &plugins)?;
    kubelet
        .wait_for(Duration::from_secs(10), |n| {
            (n.capacity("bench.example/small") == (64, 64)).then_some(())
        })
        .await?;
    for i in 0..64 {
        kubelet
            .allocate(&format!("pod-{i}"), "main", "bench.example/small", 1)
            .await?;
    }
    let pid = child.id();
    keep_smaps(pid, "64");
    let figures = (
        status_field(pid, "VmHWM:").unwrap_or(0),
        status_field(pid, "RssAnon:").unwrap_or(0),
        status_field(pid, "RssFile:").unwrap_or(0),
    );
    stop(child);
    Ok(figures)
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
    drop_page_cache();
    for round in 0..START_SAMPLES {
        let started = Instant::now();
        let spawned = spawn_run(&bin, &config, &plugins)?;
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
    let anon = status_field(pid, "RssAnon:").unwrap_or(0);
    let file = status_field(pid, "RssFile:").unwrap_or(0);
    let threads = status_field(pid, "Threads:").unwrap_or(0);
    let by_mapping = rss_by_mapping(pid);
    keep_smaps(pid, "3x1000");
    stop(child);
    let size = std::fs::metadata(&bin)?.len();
    let (small_peak, small_anon, small_file) = small_process_memory().await?;

    println!();
    let name = bin
        .file_name()
        .map_or_else(|| "devplug".into(), |n| n.to_string_lossy());
    println!(
        "| `{name} run` ({}), 3 resources × 1,000 devices | value |",
        bin.display()
    );
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
    println!(
        "| RSS at rest: anonymous + file-backed (binary and libraries) | {:.1} MiB = {:.1} + {:.1} MiB |",
        rss as f64 / 1024.0,
        anon as f64 / 1024.0,
        file as f64 / 1024.0
    );
    println!("| threads | {threads} |");
    println!(
        "| peak RSS, 1 resource × 64 devices after 64 allocations (the issue's Go plugin: 10.4 MiB) | {:.1} MiB ({:.2}× Go; at rest {:.1} anonymous + {:.1} file-backed) |",
        small_peak as f64 / 1024.0,
        small_peak as f64 / 1024.0 / 10.4,
        small_anon as f64 / 1024.0,
        small_file as f64 / 1024.0
    );
    for (name, kib) in by_mapping.iter().filter(|(_, kib)| *kib >= 64) {
        println!("| RSS of {name} | {:.2} MiB |", *kib as f64 / 1024.0);
    }
    println!("| CPU used while idle for 5 s | {idle_ticks} clock ticks (1 tick = 10 ms) |");
    println!(
        "| release binary size | {:.2} MiB |",
        size as f64 / (1024.0 * 1024.0)
    );
    Ok(())
}
