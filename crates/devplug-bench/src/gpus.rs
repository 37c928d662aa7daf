//! Benchmarks of the sysfs GPU backends on fake trees (in /dev/shm when present): discovery at
//! start, a driver that loads after start until the kubelet has every device, a device node
//! vanishing or coming back until the kubelet sees the health change, and preferred allocation
//! on the MI300X-like node (64 partitions), with the placement search against brute force.

use crate::{print_row, WAIT};
use devplug::{Backend, PreferenceRequest};
use devplug_backends::placement::{brute_force, PairMatrix};
use devplug_backends::{AmdgpuBackend, AmdgpuSettings, IntelGpuBackend, IntelGpuSettings};
use devplug_testkit::fake_sysfs::{intel_pair, scratch_dir, AmdNode, FakeSysfs};
use std::sync::Arc;
use std::time::Instant;

const RESOURCE: &str = "amd.com/gpu";

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

fn amd_settings(tree: &FakeSysfs) -> AmdgpuSettings {
    AmdgpuSettings {
        sys_root: tree.sys_root(),
        dev_root: tree.dev_root(),
        cdi_dir: tree.path("cdi"),
        ..Default::default()
    }
}

fn mi300x() -> anyhow::Result<(tempfile::TempDir, FakeSysfs, AmdNode)> {
    let tmp = tempfile::tempdir_in(scratch_dir())?;
    let tree = FakeSysfs::new(tmp.path())?;
    let node = AmdNode::mi300x();
    node.create(&tree)?;
    Ok((tmp, tree, node))
}

/// Backend start (first scan, CDI spec written, list published), 100 times each.
pub async fn discovery() -> anyhow::Result<()> {
    let (_tmp, tree, node) = mi300x()?;
    node.load_driver(&tree)?;
    let settings = amd_settings(&tree);
    let mut samples = Vec::new();
    for _ in 0..100 {
        let t = Instant::now();
        let backend = AmdgpuBackend::start(&settings)?;
        let n = backend.devices().borrow().len();
        samples.push(t.elapsed());
        anyhow::ensure!(n == 64, "found {n} devices");
    }
    print_row(
        "amdgpu: discovery at start, MI300X-like (8 GPUs, 64 CPX partitions, KFD links, CDI spec)",
        &mut samples,
    );

    let tmp = tempfile::tempdir_in(scratch_dir())?;
    let tree = FakeSysfs::new(tmp.path())?;
    for gpu in intel_pair() {
        gpu.create(&tree, true)?;
    }
    let settings = IntelGpuSettings {
        sys_root: tree.sys_root(),
        dev_root: tree.dev_root(),
        cdi_dir: tree.path("cdi"),
        ..Default::default()
    };
    let mut samples = Vec::new();
    for _ in 0..100 {
        let t = Instant::now();
        let backend = IntelGpuBackend::start(&settings)?;
        let n = backend.devices().borrow().len();
        samples.push(t.elapsed());
        anyhow::ensure!(n == 1, "found {n} devices");
    }
    print_row(
        "intel-gpu: discovery at start, 2-GPU node (i915 resource)",
        &mut samples,
    );
    Ok(())
}

/// amdgpu loads after devplug started: from the last node made until the kubelet has 64.
pub async fn late_driver() -> anyhow::Result<()> {
    let mut samples = Vec::new();
    let mut loads = Vec::new();
    for _ in 0..20 {
        let (tmp, tree, node) = mi300x()?;
        let backend = Arc::new(AmdgpuBackend::start(&amd_settings(&tree))?);
        let (kubelet, host) =
            crate::backends::serve(RESOURCE, backend, &tmp.path().join("plugins")).await?;
        let t = Instant::now();
        node.load_driver(&tree)?;
        loads.push(t.elapsed());
        let done = Instant::now();
        kubelet
            .wait_for(WAIT, |n| (n.capacity(RESOURCE) == (64, 64)).then_some(()))
            .await?;
        samples.push(done.elapsed());
        host.shutdown().await;
    }
    print_row(
        "amdgpu: driver loads after start, last /dev node made → kubelet has all 64 (20 runs)",
        &mut samples,
    );
    print_row(
        "  (making the fake driver's ~15,000 sysfs/dev entries took)",
        &mut loads,
    );
    Ok(())
}

/// A render node removed or made again until the kubelet has the health change.
pub async fn change_latency() -> anyhow::Result<()> {
    let (tmp, tree, node) = mi300x()?;
    node.load_driver(&tree)?;
    let backend = Arc::new(AmdgpuBackend::start(&amd_settings(&tree))?);
    let (kubelet, host) =
        crate::backends::serve(RESOURCE, backend, &tmp.path().join("plugins")).await?;
    let render = tree.path("dev/dri/renderD129");
    let mut samples = Vec::new();
    for i in 0..400 {
        let healthy = i % 2 == 1;
        let t = Instant::now();
        if healthy {
            std::fs::write(&render, "")?;
        } else {
            std::fs::remove_file(&render)?;
        }
        kubelet
            .wait_for(WAIT, |n| {
                let d = n.resource(RESOURCE)?.devices().get("amdgpu_xcp_1")?;
                (d.healthy == healthy).then_some(())
            })
            .await?;
        samples.push(t.elapsed());
    }
    print_row(
        "amdgpu: render node removed/made → health seen by the kubelet (64 devices, 10 ms debounce)",
        &mut samples,
    );
    host.shutdown().await;
    Ok(())
}

/// GetPreferredAllocation's work on the MI300X-like node, and the search against brute force.
pub async fn preferred() -> anyhow::Result<()> {
    let (_tmp, tree, node) = mi300x()?;
    node.load_driver(&tree)?;
    let backend = AmdgpuBackend::start(&amd_settings(&tree))?;
    let ids: Vec<String> = backend
        .devices()
        .borrow()
        .devices()
        .iter()
        .map(|d| d.id.clone())
        .collect();
    let mut rng = Rng(0x5eed);
    let mut samples = Vec::new();
    for _ in 0..5000 {
        let available: Vec<String> = ids.iter().filter(|_| rng.below(4) != 0).cloned().collect();
        let size = 1 + rng.below(available.len());
        let must: Vec<String> = if rng.below(5) == 0 {
            vec![available[rng.below(available.len())].clone()]
        } else {
            Vec::new()
        };
        let request = PreferenceRequest {
            available: &available,
            must_include: &must,
            size,
        };
        let t = Instant::now();
        let got = backend.preferred(&request);
        samples.push(t.elapsed());
        anyhow::ensure!(got.len() == size, "asked {size}, got {}", got.len());
    }
    print_row(
        "amdgpu: preferred allocation, MI300X-like 64 partitions, random 3/4 available, size 1–all (5,000)",
        &mut samples,
    );
    let all: Vec<String> = ids.clone();
    let mut full = Vec::new();
    for size in 1..=64 {
        let request = PreferenceRequest {
            available: &all,
            must_include: &[],
            size,
        };
        let t = Instant::now();
        backend.preferred(&request);
        full.push(t.elapsed());
    }
    print_row(
        "amdgpu: preferred allocation, all 64 available, each size 1–64",
        &mut full,
    );

    // 16 GPUs with all-different random weights (no interchangeable devices), size 8.
    let mut fast = Vec::new();
    let mut slow = Vec::new();
    for round in 0..20 {
        let mut r = Rng(1000 + round);
        let w: Vec<u32> = (0..256).map(|_| r.below(100) as u32).collect();
        let numa = (0..16).map(|d| Some((d / 8) as i64)).collect();
        let m = PairMatrix::from_fn(numa, |a, b| w[a * 16 + b]);
        let all: Vec<usize> = (0..16).collect();
        let t = Instant::now();
        let got = m.best(&all, &[], 8);
        fast.push(t.elapsed());
        let t = Instant::now();
        let want = brute_force(&m, &all, &[], 8);
        slow.push(t.elapsed());
        anyhow::ensure!(
            got.exact && got.score == want.score,
            "round {round}: not optimal"
        );
    }
    print_row(
        "placement: 16 GPUs, random distinct weights, size 8 (20 matrices), branch and bound",
        &mut fast,
    );
    print_row(
        "placement: same, brute force over all 12,870 subsets (reference)",
        &mut slow,
    );

    // Worst case: 64 devices, all different: how often is optimality proven within the budget?
    let mut times = Vec::new();
    let mut proven = 0;
    let mut total = 0;
    for round in 0..4 {
        let mut r = Rng(7 + round);
        let w: Vec<u32> = (0..64 * 64).map(|_| r.below(1000) as u32).collect();
        let numa = (0..64).map(|d| Some((d / 32) as i64)).collect();
        let m = PairMatrix::from_fn(numa, |a, b| w[a * 64 + b]);
        let all: Vec<usize> = (0..64).collect();
        for size in [2, 4, 8, 16, 32, 48, 60] {
            let t = Instant::now();
            let got = m.best(&all, &[], size);
            times.push(t.elapsed());
            total += 1;
            proven += usize::from(got.exact);
        }
    }
    print_row(
        "placement: 64 devices, all-different random weights (no structure; budget-capped)",
        &mut times,
    );
    println!("| placement: … of which proven optimal within the work budget | {total} | {proven} of {total} | | |");
    Ok(())
}
