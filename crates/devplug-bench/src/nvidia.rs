//! Benchmarks of the `nvidia` backend on the fake NVML (crates/fake-nvml, loaded through
//! nvml-wrapper exactly as the real library is): preferred allocation on random 8- and
//! 16-GPU topologies against the brute-force reference (which proves each answer optimal),
//! start → registered with 8 GPUs, an XID → the kubelet sees Unhealthy, and the peak RSS of
//! `devplug run` serving 8 GPUs × 10 replicas. `cargo run --release -p devplug-bench -- nvidia`
//! runs only these.

use crate::{print_row, WAIT};
use devplug::{Backend, Host, PreferenceRequest, ResourceSettings};
use devplug_backends::nvidia::{NvidiaBackend, NvidiaSettings, NVLINK_SCORE};
use devplug_backends::placement::{brute_force, PairMatrix};
use devplug_testkit::fake_sysfs::{scratch_dir, FakeSysfs, PciSpec};
use kubelet_sim::Kubelet;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

const RESOURCE: &str = "nvidia.com/gpu";

/// A small deterministic generator (xorshift), so runs are repeatable.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// One generated GPU.
struct Gpu {
    numa: i64,
    host_bridge: u32,
    switch: u32,
    links: Vec<u32>,
}

/// A node with the fake NVML installed in a driver root, and its sysfs and /dev.
struct FakeNode {
    _tmp: tempfile::TempDir,
    tree: FakeSysfs,
    driver: PathBuf,
    control: PathBuf,
    gpus: Vec<Gpu>,
}

fn fake_library() -> anyhow::Result<PathBuf> {
    let me = std::env::current_exe()?;
    let lib = me.with_file_name("deps").join("libfake_nvml.so");
    anyhow::ensure!(
        lib.exists(),
        "{} not found: it is built with devplug-bench (a dependency)",
        lib.display()
    );
    Ok(lib)
}

fn uuid(i: usize) -> String {
    format!("GPU-bench000-0000-4000-8000-{i:012}")
}

fn bus(i: usize) -> String {
    format!("00000000:{:02X}:00.0", 0x10 + i)
}

impl FakeNode {
    fn new(gpus: Vec<Gpu>) -> anyhow::Result<FakeNode> {
        let tmp = tempfile::tempdir_in(scratch_dir())?;
        let tree = FakeSysfs::new(tmp.path())?;
        let driver = tmp.path().join("driver");
        let lib_dir = driver.join("usr/lib/x86_64-linux-gnu");
        std::fs::create_dir_all(&lib_dir)?;
        let mut yaml = String::from("control: control\ngpus:\n");
        for (i, g) in gpus.iter().enumerate() {
            let links: Vec<String> = g.links.iter().map(u32::to_string).collect();
            yaml.push_str(&format!(
                "  - {{uuid: {}, name: NVIDIA H100 80GB HBM3, memory_mib: 81559, bus_id: \"{}\", numa: {}, host_bridge: {}, switch: {}, nvlinks: [{}]}}\n",
                uuid(i),
                bus(i),
                g.numa,
                g.host_bridge,
                g.switch,
                links.join(", ")
            ));
            tree.pci(&PciSpec {
                address: format!("0000:{:02x}:00.0", 0x10 + i),
                vendor: 0x10de,
                device: 0x2330,
                class: 0x030200,
                numa: g.numa,
                iommu_group: i as u32,
            })?;
            tree.file(&format!("dev/nvidia{i}"), "")?;
        }
        tree.file("dev/nvidiactl", "")?;
        std::fs::write(lib_dir.join("fake-nvml.yaml"), yaml)?;
        std::fs::copy(fake_library()?, lib_dir.join("libnvidia-ml.so.1"))?;
        Ok(FakeNode {
            control: lib_dir.join("control"),
            _tmp: tmp,
            tree,
            driver,
            gpus,
        })
    }

    fn settings(&self) -> NvidiaSettings {
        NvidiaSettings {
            driver_roots: vec![self.driver.clone()],
            sys_root: self.tree.sys_root(),
            dev_root: self.tree.dev_root(),
            cdi_dir: self.tree.path("cdi"),
            ..Default::default()
        }
    }

    fn inject(&self, line: &str) -> anyhow::Result<()> {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.control)?;
        writeln!(file, "{line}")?;
        Ok(())
    }

    /// The matrix the backend should build: go-gpuallocator's pair score.
    fn matrix(&self) -> PairMatrix {
        let g = &self.gpus;
        let numa = g.iter().map(|x| Some(x.numa)).collect();
        PairMatrix::from_fn(numa, |a, b| {
            let links = g[a].links.iter().filter(|&&r| r as usize == b).count() as u32;
            let pcie = if g[a].switch == g[b].switch {
                50
            } else if g[a].host_bridge == g[b].host_bridge {
                30
            } else if g[a].numa == g[b].numa {
                20
            } else {
                10
            };
            pcie + links * NVLINK_SCORE
        })
    }
}

/// A random node: 2 NUMA nodes, 2 host bridges each, 2 switches each; 0–2 NVLinks per pair,
/// at most 18 per GPU.
fn random_gpus(rng: &mut Rng, n: usize) -> Vec<Gpu> {
    let mut gpus: Vec<Gpu> = (0..n)
        .map(|_| {
            let numa = rng.below(2);
            let host_bridge = numa * 2 + rng.below(2);
            Gpu {
                numa: numa as i64,
                host_bridge: host_bridge as u32,
                switch: (host_bridge * 2 + rng.below(2)) as u32,
                links: Vec::new(),
            }
        })
        .collect();
    for a in 0..n {
        for b in (a + 1)..n {
            let k = [0, 0, 1, 2][rng.below(4)];
            for _ in 0..k {
                if gpus[a].links.len() < 18 && gpus[b].links.len() < 18 {
                    gpus[a].links.push(b as u32);
                    gpus[b].links.push(a as u32);
                }
            }
        }
    }
    gpus
}

async fn started(node: &FakeNode, settings: &NvidiaSettings) -> anyhow::Result<NvidiaBackend> {
    let backend = NvidiaBackend::start(RESOURCE, settings)?;
    let mut devices = backend.devices();
    let want = node.gpus.len();
    tokio::time::timeout(WAIT, devices.wait_for(|l| l.len() == want)).await??;
    Ok(backend)
}

/// Preferred allocation per size on random topologies, each answer checked against brute
/// force.
pub async fn preferred() -> anyhow::Result<()> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for n in [8usize, 16] {
        let topologies = if n == 8 { 20 } else { 10 };
        let mut per_size: Vec<Vec<Duration>> = vec![Vec::new(); n + 1];
        let mut brute: Vec<Vec<Duration>> = vec![Vec::new(); n + 1];
        let (mut checked, mut optimal) = (0usize, 0usize);
        for _ in 0..topologies {
            let node = FakeNode::new(random_gpus(&mut rng, n))?;
            let backend = started(&node, &node.settings()).await?;
            let matrix = node.matrix();
            for size in 1..=n {
                for _ in 0..10 {
                    // A random available set of at least `size` GPUs, sometimes a must-include.
                    let mut avail: Vec<usize> = (0..n).collect();
                    for i in (1..n).rev() {
                        avail.swap(i, rng.below(i + 1));
                    }
                    avail.truncate(size + rng.below(n - size + 1));
                    avail.sort_unstable();
                    let must: Vec<usize> = if rng.below(3) == 0 {
                        vec![avail[rng.below(avail.len())]]
                    } else {
                        Vec::new()
                    };
                    let ids: Vec<String> = avail.iter().map(|&i| uuid(i)).collect();
                    let must_ids: Vec<String> = must.iter().map(|&i| uuid(i)).collect();
                    let request = PreferenceRequest {
                        available: &ids,
                        must_include: &must_ids,
                        size,
                    };
                    let t = Instant::now();
                    let answer = backend.preferred(&request);
                    per_size[size].push(t.elapsed());
                    let t = Instant::now();
                    let reference = brute_force(&matrix, &avail, &must, size);
                    brute[size].push(t.elapsed());
                    let got: Vec<usize> = answer
                        .iter()
                        .filter_map(|id| (0..n).find(|&i| uuid(i) == *id))
                        .collect();
                    checked += 1;
                    let valid = got.len() == size
                        && must.iter().all(|m| got.contains(m))
                        && got.iter().all(|g| avail.contains(g));
                    if valid && matrix.score(&got) == reference.score {
                        optimal += 1;
                    }
                }
            }
        }
        for size in 1..=n {
            print_row(
                &format!("nvidia preferred allocation, {n} GPUs, size {size} (backend.preferred)"),
                &mut per_size[size],
            );
            print_row(
                &format!("  brute-force reference, {n} GPUs, size {size}"),
                &mut brute[size],
            );
        }
        println!(
            "| nvidia preferred allocation, {n} GPUs: answers equal to brute force's best score | {checked} | {optimal} of {checked} optimal | | |"
        );
    }
    Ok(())
}

/// NvidiaBackend::start + Host::add until the kubelet has all 8 GPUs (NVML load, discovery
/// with 18 links per GPU and every PCIe pair, registration).
pub async fn start_to_registered() -> anyhow::Result<()> {
    let mut rng = Rng(7);
    let node = FakeNode::new(random_gpus(&mut rng, 8))?;
    let mut samples = Vec::new();
    for i in 0..30 {
        let plugins = node.tree.path(&format!("kubelet-{i}"));
        let kubelet = Kubelet::start(&plugins).await?;
        let t = Instant::now();
        let host = Host::new(&plugins)?;
        let backend = NvidiaBackend::start(RESOURCE, &node.settings())?;
        host.add(RESOURCE, backend)?;
        kubelet
            .wait_for(WAIT, |n| (n.capacity(RESOURCE) == (8, 8)).then_some(()))
            .await?;
        samples.push(t.elapsed());
        host.shutdown().await;
        kubelet.stop().await;
    }
    print_row(
        "nvidia: start (NVML load + discovery of 8 GPUs + add) → kubelet has 8 GPUs, in process",
        &mut samples,
    );
    Ok(())
}

/// An XID written to the fake's control file → the kubelet sees the GPU Unhealthy; then the
/// recovery action NONE → Healthy again (hold-down 0 here: the pipeline, not the policy).
pub async fn xid_to_unhealthy() -> anyhow::Result<()> {
    let mut rng = Rng(11);
    let node = FakeNode::new(random_gpus(&mut rng, 8))?;
    let plugins = node.tree.path("kubelet");
    let kubelet = Kubelet::start(&plugins).await?;
    let host = Host::new(&plugins)?;
    let backend = Arc::new(NvidiaBackend::start(RESOURCE, &node.settings())?);
    host.add_with(
        RESOURCE,
        backend,
        ResourceSettings {
            health_hold_down: Duration::ZERO,
            ..Default::default()
        },
    )?;
    kubelet
        .wait_for(WAIT, |n| (n.capacity(RESOURCE) == (8, 8)).then_some(()))
        .await?;
    let mut down = Vec::new();
    let mut up = Vec::new();
    for i in 0..100 {
        let gpu = i % 8;
        let t = Instant::now();
        node.inject(&format!("xid {gpu} 79 1"))?;
        kubelet
            .wait_for(WAIT, |n| (n.capacity(RESOURCE) == (8, 7)).then_some(()))
            .await?;
        down.push(t.elapsed());
        let t = Instant::now();
        node.inject(&format!("action {gpu} 0"))?;
        kubelet
            .wait_for(WAIT, |n| (n.capacity(RESOURCE) == (8, 8)).then_some(()))
            .await?;
        up.push(t.elapsed());
    }
    print_row(
        "nvidia: XID 79 injected → kubelet sees the GPU Unhealthy (fake NVML polls its control file every 2 ms)",
        &mut down,
    );
    print_row(
        "nvidia: recovery action NONE → kubelet sees it Healthy (hold-down 0)",
        &mut up,
    );
    host.shutdown().await;
    Ok(())
}

/// `devplug run` (release) serving 8 fake GPUs × 10 replicas: peak RSS after registration and
/// 200 allocations, compared with the same binary serving one virtual resource.
pub async fn process_rss() -> anyhow::Result<()> {
    let bin = crate::measure::devplug_binary()?;
    let mut rng = Rng(13);
    let node = FakeNode::new(random_gpus(&mut rng, 8))?;
    let plugins = node.tree.path("kubelet-rss");
    let kubelet = Kubelet::start(&plugins).await?;
    let config = node.tree.path("config.yaml");
    let s = node.settings();
    std::fs::write(
        &config,
        format!(
            "resources:\n  - name: {RESOURCE}\n    nvidia: {{ replicas: 10, driver_roots: [{}], sys_root: {}, dev_root: {}, cdi_dir: {} }}\n",
            s.driver_roots[0].display(),
            s.sys_root.display(),
            s.dev_root.display(),
            s.cdi_dir.display()
        ),
    )?;
    let started = Instant::now();
    let child = crate::measure::spawn_run(&bin, &config, &plugins)?;
    kubelet
        .wait_for(WAIT, |n| (n.capacity(RESOURCE) == (80, 80)).then_some(()))
        .await?;
    let to_registered = started.elapsed();
    for i in 0..200 {
        kubelet
            .allocate(&format!("pod-{i}"), "main", RESOURCE, 1 + i % 4)
            .await?;
        kubelet.remove_pod(&format!("pod-{i}"));
    }
    let pid = child.id();
    let hwm = crate::measure::status_field(pid, "VmHWM:").unwrap_or(0);
    let rss = crate::measure::status_field(pid, "VmRSS:").unwrap_or(0);
    crate::measure::stop(child);
    println!();
    println!("| `devplug run`, nvidia, 8 fake GPUs × 10 replicas | value |");
    println!("|---|---|");
    println!(
        "| process start → 80 devices at the kubelet (release binary, incl. exec and NVML load) | {:.1} ms |",
        to_registered.as_secs_f64() * 1e3
    );
    println!(
        "| peak RSS (VmHWM) after registration + 200 allocations | {:.1} MiB |",
        hwm as f64 / 1024.0
    );
    println!("| RSS at rest | {:.1} MiB |", rss as f64 / 1024.0);
    Ok(())
}
