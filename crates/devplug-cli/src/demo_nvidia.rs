//! `devplug demo nvidia`: the `nvidia` backend on a fake DGX-1 (8 V100, hybrid cube-mesh
//! NVLink, 2 NUMA nodes) through the real NVML loading path: the fake `libnvidia-ml.so`
//! (crates/fake-nvml) is copied into a temporary driver root and loaded by nvml-wrapper as the
//! real one would be. Walks through discovery, a topology-aware allocation of 4 GPUs, CDI, and
//! an XID that makes a GPU unhealthy until the driver's recovery action says it is fine.

use anyhow::Context;
use devplug::{Backend, Host, ResourceSettings};
use devplug_backends::nvidia::{sysfs_bus_id, NvidiaSettings};
use devplug_backends::NvidiaBackend;
use devplug_testkit::fake_sysfs::{FakeSysfs, PciSpec};
use kubelet_sim::Kubelet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

const RESOURCE: &str = "nvidia.com/gpu";
const WAIT: Duration = Duration::from_secs(10);
const TOPOLOGY: &str = include_str!("../../fake-nvml/topologies/dgx1-v100.yaml");

/// The fake NVML: `library` if given, else `libfake_nvml.so` next to this binary (cargo puts it
/// in `target/<profile>/` when `fake-nvml` is built).
fn find_library(library: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(lib) = library {
        return Ok(lib.to_owned());
    }
    let exe = std::env::current_exe().context("cannot find this binary")?;
    let dir = exe.parent().context("this binary has no folder")?;
    [
        dir.join("libfake_nvml.so"),
        dir.join("deps/libfake_nvml.so"),
    ]
    .into_iter()
    .find(|p| p.exists())
    .with_context(|| {
        format!(
            "no libfake_nvml.so next to {}: run `cargo build -p fake-nvml -p devplug-cli` \
                 first, or pass --library",
            exe.display()
        )
    })
}

/// Bus ids and NUMA nodes of the topology's GPUs, read from its text.
fn gpus() -> Vec<(String, i64)> {
    let mut out = Vec::new();
    let mut bus = None;
    for line in TOPOLOGY.lines().map(str::trim) {
        if let Some(b) = line.strip_prefix("bus_id: ") {
            bus = Some(b.trim_matches('"').to_owned());
        }
        if let (Some(n), Some(b)) = (line.strip_prefix("numa: "), bus.take()) {
            out.push((b, n.parse().unwrap_or(-1)));
        }
    }
    out
}

/// Runs the demo.
pub async fn demo(library: Option<&Path>) -> anyhow::Result<()> {
    let library = find_library(library)?;
    let dir = tempfile::Builder::new()
        .prefix("devplug-nvidia-demo-")
        .tempdir()
        .context("cannot create a temp folder")?;
    let tree = FakeSysfs::new(dir.path())?;
    println!("devplug demo nvidia: a fake DGX-1 (8 V100, NVLink hybrid cube-mesh), real NVML path");
    println!("folder: {}\n", dir.path().display());

    println!("[1] a driver root with the fake libnvidia-ml.so.1, /dev nodes, sysfs NUMA nodes");
    let lib_dir = dir.path().join("driver/usr/lib/x86_64-linux-gnu");
    std::fs::create_dir_all(&lib_dir)?;
    std::fs::copy(&library, lib_dir.join("libnvidia-ml.so.1"))
        .with_context(|| format!("cannot copy {}", library.display()))?;
    std::fs::write(lib_dir.join("fake-nvml.yaml"), TOPOLOGY)?;
    for (i, (bus, numa)) in gpus().iter().enumerate() {
        tree.pci(&PciSpec {
            address: sysfs_bus_id(bus),
            vendor: 0x10de,
            device: 0x1db1,
            class: 0x030200,
            numa: *numa,
            iommu_group: u32::try_from(i).unwrap_or(0),
        })?;
        tree.file(&format!("dev/nvidia{i}"), "")?;
    }
    tree.file("dev/nvidiactl", "")?;
    tree.file("dev/nvidia-uvm", "")?;

    println!("[2] the kubelet starts; devplug serves {RESOURCE} with the nvidia backend");
    let plugins = dir.path().join("device-plugins");
    let kubelet = Kubelet::start(&plugins).await?;
    let settings = NvidiaSettings {
        driver_roots: vec![dir.path().join("driver")],
        sys_root: tree.sys_root(),
        dev_root: tree.dev_root(),
        cdi_dir: dir.path().join("cdi"),
        ..Default::default()
    };
    let backend = Arc::new(NvidiaBackend::start(RESOURCE, &settings)?);
    let host = Host::new(&plugins)?;
    host.add_with(
        RESOURCE,
        backend.clone(),
        ResourceSettings {
            health_hold_down: Duration::from_secs(1),
            ..Default::default()
        },
    )?;
    kubelet
        .wait_for(WAIT, |n| (n.capacity(RESOURCE) == (8, 8)).then_some(()))
        .await?;
    println!("    node capacity {RESOURCE}: 8, allocatable 8");

    println!("[3] a pod asks for 4 GPUs: preferred allocation picks a fully NVLinked quad");
    let alloc = kubelet.allocate("train", "main", RESOURCE, 4).await?;
    for id in &alloc.device_ids {
        println!("    {id}");
    }
    println!(
        "    NVIDIA_VISIBLE_DEVICES={}",
        alloc.env("NVIDIA_VISIBLE_DEVICES").unwrap_or("")
    );
    for cdi in &alloc.response.cdi_devices {
        println!("    CDI device {}", cdi.name);
    }
    println!(
        "    CDI spec: {}",
        dir.path().join("cdi/devplug-nvidia.com_gpu.json").display()
    );

    let victim = alloc.device_ids.first().cloned().unwrap_or_default();
    println!("[4] XID 79 on {victim} (recovery action GPU_RESET)");
    let control = lib_dir.join("dgx1-v100.control");
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&control)?;
    writeln!(file, "xid {victim} 79 1")?;
    kubelet
        .wait_for(WAIT, |n| (n.capacity(RESOURCE) == (8, 7)).then_some(()))
        .await?;
    let health = backend
        .devices()
        .borrow()
        .get(&victim)
        .map(|d| d.health.to_string())
        .unwrap_or_default();
    println!("    allocatable 7; {victim}: {health}");

    println!("[5] the GPU is reset: recovery action NONE, Healthy again after the 1 s hold-down");
    writeln!(file, "action {victim} 0")?;
    kubelet
        .wait_for(WAIT, |n| (n.capacity(RESOURCE) == (8, 8)).then_some(()))
        .await?;
    println!("    allocatable 8");

    host.shutdown().await;
    kubelet.stop().await;
    println!("\ndone.");
    Ok(())
}
