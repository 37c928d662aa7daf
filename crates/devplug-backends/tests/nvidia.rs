//! The nvidia backend through the kubelet simulator over real Unix sockets, with the real
//! NVML path: nvml-wrapper dlopens the fake `libnvidia-ml.so.1` (crates/fake-nvml, copied into
//! a temporary driver root per test so tests run in parallel, each with its own topology), on
//! fake sysfs and /dev trees. Faults go in through the fake's control file and come back out
//! of `nvmlEventSetWait`, as they would from a driver.
#![allow(clippy::unwrap_used)] // a panic in a test is a failed test

use devplug::dra::ClaimBackend;
use devplug::{Backend, Host, PreferenceRequest};
use devplug_backends::hostdev::ReplicaPolicy;
use devplug_backends::nvidia::{
    sysfs_bus_id, ListStrategy, MigStrategy, NvidiaBackend, NvidiaSettings,
};
use devplug_backends::NodeLabelSource;
use devplug_testkit::fake_sysfs::{scratch_dir, FakeSysfs, PciSpec};
use kubelet_sim::Kubelet;
use serde::Deserialize;
use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

mod support;

use support::WAIT;

#[derive(Deserialize)]
struct Topology {
    gpus: Vec<TopoGpu>,
}

#[derive(Deserialize)]
struct TopoGpu {
    uuid: String,
    bus_id: String,
    numa: i64,
    #[serde(default)]
    nvlinks: Vec<u32>,
    #[serde(default)]
    mig_devices: Vec<TopoMig>,
}

#[derive(Deserialize)]
struct TopoMig {
    uuid: String,
    gi: u32,
    ci: u32,
}

/// The minor the driver gives a GI's access node in `mig-minors` (its layout: `config` 1,
/// `monitor` 2, then per GPU minor 15 GIs of 1 GI node + 8 CI nodes each).
fn gi_minor(gpu: u32, gi: u32) -> u32 {
    3 + gpu * 135 + gi * 9
}

fn ci_minor(gpu: u32, gi: u32, ci: u32) -> u32 {
    gi_minor(gpu, gi) + 1 + ci
}

/// `/proc/driver/nvidia-caps/mig-minors` as the driver writes it for `gpus` GPUs.
fn mig_minors(gpus: u32) -> String {
    let mut out = String::from("config 1\nmonitor 2\n");
    for g in 0..gpus {
        for gi in 0..15 {
            out.push_str(&format!("gpu{g}/gi{gi}/access {}\n", gi_minor(g, gi)));
            for ci in 0..8 {
                out.push_str(&format!(
                    "gpu{g}/gi{gi}/ci{ci}/access {}\n",
                    ci_minor(g, gi, ci)
                ));
            }
        }
    }
    out
}

/// The fake NVML that cargo built for this test run (a dev-dependency of this crate).
fn fake_library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let lib = exe.parent().unwrap().join("libfake_nvml.so");
    assert!(
        lib.exists(),
        "{} is missing: cargo builds it as a dev-dependency",
        lib.display()
    );
    lib
}

/// A node: a fake sysfs and /dev, a driver root with (optionally) the fake NVML in it.
struct Node {
    _tmp: tempfile::TempDir,
    tree: FakeSysfs,
    topology: Topology,
    lib_dir: PathBuf,
    name: String,
}

impl Node {
    fn new(name: &str, with_library: bool) -> Node {
        let tmp = tempfile::tempdir_in(scratch_dir()).unwrap();
        let tree = FakeSysfs::new(tmp.path()).unwrap();
        let source = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fake-nvml/topologies")
            .join(format!("{name}.yaml"));
        let text = std::fs::read_to_string(&source).unwrap();
        let topology: Topology = serde_saphyr::from_str(&text).unwrap();
        for (i, gpu) in topology.gpus.iter().enumerate() {
            tree.pci(&PciSpec {
                address: sysfs_bus_id(&gpu.bus_id),
                vendor: 0x10de,
                device: 0x1db1,
                class: 0x030200,
                numa: gpu.numa,
                iommu_group: i as u32,
            })
            .unwrap();
            tree.file(&format!("dev/nvidia{i}"), "").unwrap();
        }
        tree.file("dev/nvidia-uvm", "").unwrap();
        tree.file(
            "proc/driver/nvidia-caps/mig-minors",
            &mig_minors(topology.gpus.len() as u32),
        )
        .unwrap();
        let lib_dir = tmp.path().join("driver/usr/lib/x86_64-linux-gnu");
        std::fs::create_dir_all(&lib_dir).unwrap();
        std::fs::write(lib_dir.join("fake-nvml.yaml"), text).unwrap();
        let node = Node {
            _tmp: tmp,
            tree,
            topology,
            lib_dir,
            name: name.to_owned(),
        };
        if with_library {
            node.install_driver();
        }
        node
    }

    /// Puts the library in the driver root and makes /dev/nvidiactl, as a driver container
    /// does when it is ready.
    fn install_driver(&self) {
        let tmp = self.lib_dir.join(".libnvidia-ml.so.1.tmp");
        std::fs::copy(fake_library(), &tmp).unwrap();
        std::fs::rename(&tmp, self.lib_dir.join("libnvidia-ml.so.1")).unwrap();
        self.tree.file("dev/nvidiactl", "").unwrap();
    }

    /// Appends a fault line to the fake's control file.
    fn inject(&self, line: &str) {
        let path = self.lib_dir.join(format!("{}.control", self.name));
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        writeln!(file, "{line}").unwrap();
    }

    /// Makes the fake log every `nvmlInit` (read back with [`Node::inits`]); before serving.
    fn log_inits(&self) {
        let path = self.lib_dir.join("fake-nvml.yaml");
        let mut text = std::fs::read_to_string(&path).unwrap();
        text.push_str("\ninit_log: inits.log\n");
        std::fs::write(path, text).unwrap();
    }

    /// How often NVML has been initialised so far.
    fn inits(&self) -> usize {
        std::fs::read_to_string(self.lib_dir.join("inits.log"))
            .map(|t| t.lines().count())
            .unwrap_or(0)
    }

    fn uuid(&self, i: usize) -> String {
        self.topology.gpus[i].uuid.clone()
    }

    /// Settings of a `mixed` resource for one profile (`None`: the GPUs not in MIG mode).
    fn mixed(&self, profile: Option<&str>) -> NvidiaSettings {
        let mut s = self.settings();
        s.mig_strategy = MigStrategy::Mixed;
        s.mig_profile = profile.map(str::to_owned);
        s
    }

    fn settings(&self) -> NvidiaSettings {
        let mut s = NvidiaSettings {
            driver_roots: vec![self._tmp.path().join("driver")],
            sys_root: self.tree.sys_root(),
            dev_root: self.tree.dev_root(),
            cdi_dir: self.tree.path("cdi"),
            proc_root: self.tree.path("proc"),
            ..Default::default()
        };
        s.health.check_interval_ms = 20;
        s
    }
}

async fn serve(
    node: &Node,
    resources: Vec<(&str, NvidiaSettings)>,
) -> (Kubelet, Host, Vec<Arc<NvidiaBackend>>) {
    let mut backends = Vec::new();
    let mut served: Vec<(&str, Arc<dyn Backend>)> = Vec::new();
    for (name, settings) in resources {
        let backend = Arc::new(NvidiaBackend::start(name, &settings).unwrap());
        served.push((name, backend.clone()));
        backends.push(backend);
    }
    let plugins = node.tree.path("kubelet/device-plugins");
    let (kubelet, host) = support::serve(&plugins, served).await;
    (kubelet, host, backends)
}

/// Waits until the kubelet has `healthy` healthy devices out of `total`.
async fn counts(kubelet: &Kubelet, resource: &str, total: usize, healthy: usize) {
    support::counts(kubelet, resource, total, healthy).await;
}

/// Waits until the backend says why it is not ready, and returns that.
async fn not_ready(backend: &NvidiaBackend, containing: &str) -> String {
    let start = std::time::Instant::now();
    loop {
        let now = backend.not_ready().unwrap_or_default();
        if now.contains(containing) || start.elapsed() > WAIT {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn reason(backend: &NvidiaBackend, id: &str) -> String {
    let list = backend.devices().borrow().clone();
    list.get(id).unwrap().health.to_string()
}

#[tokio::test]
async fn dgx1_discovery_allocate_cdi_and_a_fully_nvlinked_quad() {
    let node = Node::new("dgx1-v100", true);
    let mut settings = node.settings();
    settings.device_list_strategy = vec![
        ListStrategy::Envvar,
        ListStrategy::CdiCri,
        ListStrategy::DeviceSpecs,
    ];
    let (kubelet, _host, backends) = serve(&node, vec![("nvidia.com/gpu", settings)]).await;
    counts(&kubelet, "nvidia.com/gpu", 8, 8).await;
    assert_eq!(backends[0].not_ready(), None);
    kubelet.read(|n| {
        let devices = n.resource("nvidia.com/gpu").unwrap().devices();
        assert_eq!(devices[&node.uuid(0)].numa_nodes, [0]);
        assert_eq!(devices[&node.uuid(7)].numa_nodes, [1]);
    });

    // 4 GPUs: one of the two quads whose 6 pairs all have NVLinks.
    let first = kubelet
        .allocate("pod-a", "main", "nvidia.com/gpu", 4)
        .await
        .unwrap();
    let index_of = |uuid: &str| {
        node.topology
            .gpus
            .iter()
            .position(|g| g.uuid == uuid)
            .unwrap()
    };
    let picked: BTreeSet<usize> = first.device_ids.iter().map(|u| index_of(u)).collect();
    for &a in &picked {
        for &b in &picked {
            if a != b {
                assert!(
                    node.topology.gpus[a].nvlinks.contains(&(b as u32)),
                    "{picked:?}: GPUs {a} and {b} have no NVLink"
                );
            }
        }
    }
    assert!(picked == BTreeSet::from([0, 1, 2, 3]) || picked == BTreeSet::from([4, 5, 6, 7]));
    // DRA attributes and memory capacity, from what NVML and sysfs told discovery.
    let list = backends[0].devices().borrow().clone();
    let bus_id = sysfs_bus_id(&node.topology.gpus[3].bus_id);
    assert_eq!(
        support::dra(&list, &node.uuid(3)),
        support::map(&[
            ("capacity memory", &(16160u64 << 20).to_string()),
            ("index", "3"),
            ("minor", "3"),
            ("productName", "Tesla V100-SXM2-16GB"),
            ("resource.kubernetes.io/pciBusID", &bus_id),
            ("resource.kubernetes.io/pcieRoot", "pci0000:00"),
            ("type", "gpu"),
            ("uuid", &node.uuid(3)),
        ])
    );
    // The env var, CDI names, device nodes.
    let env = first.env("NVIDIA_VISIBLE_DEVICES").unwrap();
    assert_eq!(env.split(',').count(), 4);
    let cdi: Vec<&str> = first
        .response
        .cdi_devices
        .iter()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(cdi.len(), 4);
    assert!(cdi.iter().all(|c| c.starts_with("nvidia.com/gpu=GPU-")));
    let nodes: Vec<&str> = first
        .response
        .devices
        .iter()
        .map(|d| d.container_path.as_str())
        .collect();
    assert_eq!(nodes[..2], ["/dev/nvidiactl", "/dev/nvidia-uvm"]);
    assert_eq!(nodes.len(), 6);
    // The CDI spec: one device per GPU with its node, the control nodes in common.
    let spec = std::fs::read_to_string(node.tree.path("cdi/devplug-nvidia.com_gpu.json")).unwrap();
    let spec: serde_json::Value = serde_json::from_str(&spec).unwrap();
    assert_eq!(spec["kind"], "nvidia.com/gpu");
    let devices = spec["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 8);
    assert_eq!(devices[3]["name"], node.uuid(3));
    assert_eq!(
        devices[3]["containerEdits"]["deviceNodes"][0]["path"],
        "/dev/nvidia3"
    );
    let common = spec["containerEdits"]["deviceNodes"].as_array().unwrap();
    assert_eq!(
        common.len(),
        2,
        "nvidiactl and nvidia-uvm exist, the others do not"
    );

    // 4 more: the other quad.
    let second = kubelet
        .allocate("pod-b", "main", "nvidia.com/gpu", 4)
        .await
        .unwrap();
    let other: BTreeSet<usize> = second.device_ids.iter().map(|u| index_of(u)).collect();
    assert!(other.is_disjoint(&picked));
    assert!(other == BTreeSet::from([0, 1, 2, 3]) || other == BTreeSet::from([4, 5, 6, 7]));

    // Must-include GPU 5 with one more: its best partner is GPU 6 (2 NVLinks, same host
    // bridge) rather than GPU 1 (2 NVLinks, other socket).
    let all: Vec<String> = (0..8).map(|i| node.uuid(i)).collect();
    let got = backends[0].preferred(&PreferenceRequest {
        available: &all,
        must_include: &[node.uuid(5)],
        size: 2,
    });
    assert_eq!(got, [node.uuid(5), node.uuid(6)]);
}

#[tokio::test]
async fn each_list_strategy_alone() {
    let node = Node::new("pcie-4gpu", true);
    let only = |s: ListStrategy| {
        let mut settings = node.settings();
        settings.device_list_strategy = vec![s];
        settings
    };
    let (kubelet, _host, _backends) = serve(
        &node,
        vec![
            ("nvidia.com/gpu", only(ListStrategy::Envvar)),
            ("example.com/gpu-cdi", only(ListStrategy::CdiCri)),
            ("example.com/gpu-nodes", only(ListStrategy::DeviceSpecs)),
        ],
    )
    .await;
    for r in [
        "nvidia.com/gpu",
        "example.com/gpu-cdi",
        "example.com/gpu-nodes",
    ] {
        counts(&kubelet, r, 4, 4).await;
    }
    let env = kubelet
        .allocate("p1", "c", "nvidia.com/gpu", 2)
        .await
        .unwrap();
    assert_eq!(env.response.envs.len(), 1);
    assert!(env.response.cdi_devices.is_empty() && env.response.devices.is_empty());
    // PCIe only: the pair under one switch.
    let pair: BTreeSet<String> = env.device_ids.iter().cloned().collect();
    assert!(
        pair == BTreeSet::from([node.uuid(0), node.uuid(1)])
            || pair == BTreeSet::from([node.uuid(2), node.uuid(3)])
    );

    let cdi = kubelet
        .allocate("p2", "c", "example.com/gpu-cdi", 1)
        .await
        .unwrap();
    assert!(cdi.response.envs.is_empty() && cdi.response.devices.is_empty());
    assert_eq!(cdi.response.cdi_devices.len(), 1);
    assert!(node
        .tree
        .path("cdi/devplug-example.com_gpu-cdi.json")
        .exists());
    assert!(!node.tree.path("cdi/devplug-nvidia.com_gpu.json").exists());

    let nodes = kubelet
        .allocate("p3", "c", "example.com/gpu-nodes", 1)
        .await
        .unwrap();
    assert!(nodes.response.envs.is_empty() && nodes.response.cdi_devices.is_empty());
    assert_eq!(
        nodes.response.devices.len(),
        3,
        "nvidiactl, nvidia-uvm, the GPU"
    );
}

#[tokio::test]
async fn replicas_with_per_gpu_counts_spread_pack_and_fail_greater_than_one() {
    let node = Node::new("pcie-4gpu", true);
    let shared = |policy: ReplicaPolicy, fail: bool| {
        let mut s = node.settings();
        s.replicas = 2;
        s.replica_overrides = vec![devplug_backends::nvidia::settings::ReplicaOverride {
            gpus: vec!["3".into()],
            replicas: 4,
        }];
        s.replica_policy = policy;
        s.fail_requests_greater_than_one = fail;
        s
    };
    let (kubelet, _host, _b) = serve(
        &node,
        vec![
            ("nvidia.com/gpu", shared(ReplicaPolicy::Spread, false)),
            ("example.com/packed", shared(ReplicaPolicy::Pack, false)),
            ("example.com/strict", shared(ReplicaPolicy::Spread, true)),
        ],
    )
    .await;
    counts(&kubelet, "nvidia.com/gpu", 10, 10).await;
    kubelet.read(|n| {
        let ids: Vec<&String> = n
            .resource("nvidia.com/gpu")
            .unwrap()
            .devices()
            .keys()
            .collect();
        assert!(ids.contains(&&format!("{}::3", node.uuid(3))));
        assert!(ids.contains(&&format!("{}::1", node.uuid(0))));
    });

    // spread: 3 replicas on 3 different GPUs; NVIDIA_VISIBLE_DEVICES has each UUID once.
    let a = kubelet
        .allocate("a", "c", "nvidia.com/gpu", 3)
        .await
        .unwrap();
    let gpus: BTreeSet<&str> = a
        .device_ids
        .iter()
        .map(|id| id.split("::").next().unwrap())
        .collect();
    assert_eq!(gpus.len(), 3, "{:?}", a.device_ids);
    // The next container goes to the least used GPU first: the 4th one (or GPU 3, with 4).
    let b = kubelet
        .allocate("b", "c", "nvidia.com/gpu", 1)
        .await
        .unwrap();
    let b_gpu = b.device_ids[0].split("::").next().unwrap();
    assert!(
        !gpus.contains(b_gpu),
        "{:?} after {:?}",
        b.device_ids,
        a.device_ids
    );

    // pack: 3 replicas on one GPU (the one with 4), deduplicated in the env var.
    let p = kubelet
        .allocate("p", "c", "example.com/packed", 3)
        .await
        .unwrap();
    let gpus: BTreeSet<&str> = p
        .device_ids
        .iter()
        .map(|id| id.split("::").next().unwrap())
        .collect();
    assert_eq!(gpus.len(), 1, "{:?}", p.device_ids);
    assert_eq!(p.env("NVIDIA_VISIBLE_DEVICES"), Some(node.uuid(3).as_str()));
    assert_eq!(p.response.cdi_devices.len(), 1);

    // fail_requests_greater_than_one: 2 replicas refused, 1 fine.
    let err = kubelet
        .allocate("s", "c", "example.com/strict", 2)
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("fail_requests_greater_than_one"),
        "{err}"
    );
    kubelet
        .allocate("s2", "c", "example.com/strict", 1)
        .await
        .unwrap();
}

#[tokio::test]
async fn xid_makes_every_replica_unhealthy_and_the_recovery_action_brings_it_back() {
    let node = Node::new("pcie-4gpu", true);
    let mut settings = node.settings();
    settings.replicas = 3;
    let (kubelet, _host, backends) = serve(&node, vec![("nvidia.com/gpu", settings)]).await;
    counts(&kubelet, "nvidia.com/gpu", 12, 12).await;

    // An application XID: ignored by the default policy (the recovery action stays NONE).
    node.inject("xid 0 13");
    // A fatal one with GPU_RESET: all 3 replicas of GPU 1 go.
    node.inject("xid 1 79 1");
    counts(&kubelet, "nvidia.com/gpu", 12, 9).await;
    let id = format!("{}::2", node.uuid(1));
    assert_eq!(
        reason(&backends[0], &id),
        "Unhealthy (xid 79: GPU has fallen off the bus (recovery action GPU_RESET))"
    );
    assert!(reason(&backends[0], &format!("{}::0", node.uuid(0))) == "Healthy");
    // Still needs a reset: it stays down, whatever the wait.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(kubelet.read(|n| n.capacity("nvidia.com/gpu")), (12, 9));
    // The driver reports the reset done (recovery action NONE): back.
    node.inject("action 1 0");
    counts(&kubelet, "nvidia.com/gpu", 12, 12).await;

    // Double-bit ECC (the driver asks for a reset), then the recovery action goes to NONE
    // (its event).
    node.inject("ecc 2 1");
    counts(&kubelet, "nvidia.com/gpu", 12, 9).await;
    assert_eq!(
        reason(&backends[0], &format!("{}::0", node.uuid(2))),
        "Unhealthy (double-bit ECC error)"
    );
    node.inject("action 2 0");
    counts(&kubelet, "nvidia.com/gpu", 12, 12).await;
}

#[tokio::test]
async fn a_lost_gpu_is_unhealthy_until_it_answers_again() {
    let node = Node::new("dgx-h100", true);
    let (kubelet, _host, backends) = serve(&node, vec![("nvidia.com/gpu", node.settings())]).await;
    counts(&kubelet, "nvidia.com/gpu", 8, 8).await;
    node.inject("lost 6");
    counts(&kubelet, "nvidia.com/gpu", 8, 7).await;
    assert_eq!(
        reason(&backends[0], &node.uuid(6)),
        "Unhealthy (GPU is lost (fallen off the bus))"
    );
    node.inject("found 6");
    counts(&kubelet, "nvidia.com/gpu", 8, 8).await;

    // NVSwitch: every pair has 18 links; NUMA and PCIe decide, so 4 GPUs come from one socket.
    let four = kubelet
        .allocate("p", "c", "nvidia.com/gpu", 4)
        .await
        .unwrap();
    let sockets: BTreeSet<i64> = four
        .device_ids
        .iter()
        .map(|u| {
            node.topology
                .gpus
                .iter()
                .find(|g| &g.uuid == u)
                .unwrap()
                .numa
        })
        .collect();
    assert_eq!(sockets.len(), 1, "{:?}", four.device_ids);
}

/// GPU Feature Discovery's labels through the real NVML path: the compute capability and the
/// CUDA version as the fake NVML answers them, the count following a lost GPU.
#[tokio::test]
async fn node_labels_come_from_nvml_and_follow_a_lost_gpu() {
    let node = Node::new("dgx-h100", true);
    let (kubelet, _host, backends) = serve(&node, vec![("nvidia.com/gpu", node.settings())]).await;
    counts(&kubelet, "nvidia.com/gpu", 8, 8).await;
    let mut labels = backends[0].node_labels();
    let got = labels.borrow_and_update().clone();
    for (key, want) in [
        ("gpu.product", "NVIDIA-H100-80GB-HBM3"),
        ("gpu.count", "8"),
        ("gpu.family", "hopper"),
        ("gpu.compute.major", "9"),
        ("gpu.compute.minor", "0"),
        ("cuda.driver-version.full", "570.86.15"),
        ("cuda.runtime-version.full", "12.8"),
        ("mig.capable", "false"),
    ] {
        assert_eq!(
            got.get(&format!("nvidia.com/{key}")).map(String::as_str),
            Some(want),
            "{key}: {got:?}"
        );
    }
    node.inject("lost 6");
    tokio::time::timeout(
        WAIT,
        labels.wait_for(|l| l.get("nvidia.com/gpu.count").map(String::as_str) == Some("7")),
    )
    .await
    .expect("the count follows the lost GPU")
    .unwrap();
}

#[tokio::test]
async fn one_gpu_lost_while_serving_keeps_the_others_healthy_and_nvml_is_not_reopened() {
    let node = Node::new("dgx-h100", true);
    node.log_inits();
    let (kubelet, _host, backends) = serve(&node, vec![("nvidia.com/gpu", node.settings())]).await;
    counts(&kubelet, "nvidia.com/gpu", 8, 8).await;
    let opened = node.inits();
    assert!(opened >= 1, "the fake logged no nvmlInit");
    node.inject("lost 3");
    counts(&kubelet, "nvidia.com/gpu", 8, 7).await;
    assert_eq!(
        reason(&backends[0], &node.uuid(3)),
        "Unhealthy (GPU is lost (fallen off the bus))"
    );
    // While it stays lost (probed every tick, 20 ms here), NVML stays open: no re-open at
    // all, let alone one per tick, and the other GPUs stay Healthy throughout.
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        for i in (0..8).filter(|&i| i != 3) {
            assert_eq!(reason(&backends[0], &node.uuid(i)), "Healthy", "GPU {i}");
        }
    }
    assert_eq!(kubelet.read(|n| n.capacity("nvidia.com/gpu")), (8, 7));
    let reopened = node.inits() - opened;
    assert_eq!(
        reopened, 0,
        "NVML opened {reopened} times in 3 s while GPU 3 was lost"
    );
    node.inject("found 3");
    counts(&kubelet, "nvidia.com/gpu", 8, 8).await;
    assert_eq!(node.inits(), opened);
}

#[tokio::test]
async fn library_missing_then_appearing() {
    let node = Node::new("pcie-4gpu", false);
    let (kubelet, _host, backends) = serve(&node, vec![("nvidia.com/gpu", node.settings())]).await;
    // Registered with nothing, not ready, and the reason says why.
    counts(&kubelet, "nvidia.com/gpu", 0, 0).await;
    let reason = not_ready(&backends[0], "NVML not available").await;
    assert!(reason.contains("NVML not available"), "{reason}");
    assert!(reason.contains("libnvidia-ml.so.1"), "{reason}");
    // Let the retry backoff grow past 1 s, so that only the inotify wake can be this quick.
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let started = std::time::Instant::now();
    node.install_driver();
    counts(&kubelet, "nvidia.com/gpu", 4, 4).await;
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "found after {:?}: the wake on /dev/nvidiactl did not work",
        started.elapsed()
    );
    assert_eq!(backends[0].not_ready(), None);
}

#[tokio::test]
async fn broken_nvml_events_read_as_health_unknown_until_the_event_set_is_rebuilt() {
    let node = Node::new("pcie-4gpu", true);
    let (kubelet, _host, backends) = serve(&node, vec![("nvidia.com/gpu", node.settings())]).await;
    counts(&kubelet, "nvidia.com/gpu", 4, 4).await;
    node.inject("events broken");
    // Never silently Healthy: every GPU is Unhealthy, with the reason.
    counts(&kubelet, "nvidia.com/gpu", 4, 0).await;
    let why = reason(&backends[0], &node.uuid(0));
    assert!(why.contains("health unknown"), "{why}");
    // And the resource is not ready, with the same reason (what /readyz shows).
    let why = not_ready(&backends[0], "health unknown").await;
    assert!(why.starts_with("NVIDIA GPUs: "), "{why}");
    // Registration keeps failing while it is broken (retried with backoff, not in a loop).
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(kubelet.read(|n| n.capacity("nvidia.com/gpu")), (4, 0));
    node.inject("events ok");
    counts(&kubelet, "nvidia.com/gpu", 4, 4).await;
    assert_eq!(backends[0].not_ready(), None);
    // And events flow through the rebuilt set.
    node.inject("xid 3 48 1");
    counts(&kubelet, "nvidia.com/gpu", 4, 3).await;
}

#[tokio::test]
async fn health_off_ignores_events_and_models_split_resources() {
    let node = Node::new("pcie-4gpu", true);
    let mut watched = node.settings();
    watched.models = vec!["*L40S*".into()];
    let mut unwatched = node.settings();
    unwatched.health.enabled = false;
    let mut none = node.settings();
    none.models = vec!["*H100*".into()];
    let (kubelet, _host, _b) = serve(
        &node,
        vec![
            ("nvidia.com/gpu", watched),
            ("example.com/unwatched", unwatched),
            ("nvidia.com/h100", none),
        ],
    )
    .await;
    counts(&kubelet, "nvidia.com/gpu", 4, 4).await;
    counts(&kubelet, "example.com/unwatched", 4, 4).await;
    counts(&kubelet, "nvidia.com/h100", 0, 0).await;
    node.inject("xid 0 79 1");
    counts(&kubelet, "nvidia.com/gpu", 4, 3).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        kubelet.read(|n| n.capacity("example.com/unwatched")),
        (4, 4)
    );
}

#[tokio::test]
async fn a_gpu_lost_while_the_event_set_is_rebuilt_does_not_blind_the_others() {
    let node = Node::new("dgx-h100", true);
    let (kubelet, _host, backends) = serve(&node, vec![("nvidia.com/gpu", node.settings())]).await;
    counts(&kubelet, "nvidia.com/gpu", 8, 8).await;
    node.inject("events broken");
    counts(&kubelet, "nvidia.com/gpu", 8, 0).await;
    node.inject("lost 6");
    node.inject("events ok");
    // Rebuilt without GPU 6, which is lost; the other 7 are watched again.
    counts(&kubelet, "nvidia.com/gpu", 8, 7).await;
    assert_eq!(
        reason(&backends[0], &node.uuid(6)),
        "Unhealthy (GPU is lost (fallen off the bus))"
    );
    node.inject("xid 2 79 1");
    counts(&kubelet, "nvidia.com/gpu", 8, 6).await;
    node.inject("action 2 0");
    counts(&kubelet, "nvidia.com/gpu", 8, 7).await;
    // GPU 6 answers again: healthy, and back in the event set (its XIDs count).
    node.inject("found 6");
    counts(&kubelet, "nvidia.com/gpu", 8, 8).await;
    node.inject("xid 6 79 1");
    counts(&kubelet, "nvidia.com/gpu", 8, 7).await;
    assert!(reason(&backends[0], &node.uuid(6)).contains("xid 79"));
}

#[tokio::test]
async fn driver_not_loaded_then_loaded() {
    // The library is there but the driver is not (the fake's nvmlInit answers
    // DRIVER_NOT_LOADED while it has no topology).
    let node = Node::new("pcie-4gpu", false);
    let config = node.lib_dir.join("fake-nvml.yaml");
    let topology = std::fs::read_to_string(&config).unwrap();
    std::fs::remove_file(&config).unwrap();
    node.install_driver();
    std::fs::remove_file(node.tree.path("dev/nvidiactl")).unwrap();
    let (kubelet, _host, backends) = serve(&node, vec![("nvidia.com/gpu", node.settings())]).await;
    counts(&kubelet, "nvidia.com/gpu", 0, 0).await;
    let reason = not_ready(&backends[0], "driver").await;
    assert!(
        reason.contains("the NVIDIA driver is not loaded"),
        "{reason}"
    );
    // The driver loads: its config appears, then /dev/nvidiactl.
    std::fs::write(&config, topology).unwrap();
    node.tree.file("dev/nvidiactl", "").unwrap();
    counts(&kubelet, "nvidia.com/gpu", 4, 4).await;
    assert_eq!(backends[0].not_ready(), None);
}

#[tokio::test]
async fn the_cdi_spec_follows_control_nodes_made_after_discovery() {
    let node = Node::new("pcie-4gpu", true);
    let (kubelet, _host, _b) = serve(&node, vec![("nvidia.com/gpu", node.settings())]).await;
    counts(&kubelet, "nvidia.com/gpu", 4, 4).await;
    let path = node.tree.path("cdi/devplug-nvidia.com_gpu.json");
    let common = || -> Vec<String> {
        let spec: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        spec["containerEdits"]["deviceNodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["path"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(common(), ["/dev/nvidiactl", "/dev/nvidia-uvm"]);
    // nvidia-modprobe makes the UVM tools node on first use.
    node.tree.file("dev/nvidia-uvm-tools", "").unwrap();
    let start = std::time::Instant::now();
    while common().len() != 3 {
        assert!(
            start.elapsed() < WAIT,
            "the spec never got nvidia-uvm-tools: {:?}",
            common()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(common()[2], "/dev/nvidia-uvm-tools");
    // And when it goes.
    std::fs::remove_file(node.tree.path("dev/nvidia-uvm-tools")).unwrap();
    while common().len() != 2 {
        assert!(start.elapsed() < WAIT, "the spec kept nvidia-uvm-tools");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The MIG UUIDs of GPU `gpu` in the topology file's initial layout.
fn migs(node: &Node, gpu: usize) -> Vec<String> {
    node.topology.gpus[gpu]
        .mig_devices
        .iter()
        .map(|m| m.uuid.clone())
        .collect()
}

fn ids(kubelet: &Kubelet, resource: &str) -> BTreeSet<String> {
    kubelet.read(|n| {
        n.resource(resource)
            .map(|r| r.devices().keys().cloned().collect())
            .unwrap_or_default()
    })
}

#[tokio::test]
async fn mig_mixed_serves_one_resource_per_profile_with_caps_nodes_env_and_cdi() {
    let node = Node::new("a100-mig", true);
    let mut big = node.mixed(Some("3g.20gb"));
    big.device_list_strategy = vec![
        ListStrategy::Envvar,
        ListStrategy::CdiCri,
        ListStrategy::DeviceSpecs,
    ];
    let (kubelet, _host, backends) = serve(
        &node,
        vec![
            ("nvidia.com/mig-1g.5gb", node.mixed(Some("1g.5gb"))),
            ("nvidia.com/mig-3g.20gb", big),
            ("nvidia.com/gpu", node.mixed(None)),
        ],
    )
    .await;
    // GPU 0: 2x 1g.5gb, GPU 1: 4x; 3g.20gb: one on each; the whole GPUs: GPU 2 (MIG off).
    counts(&kubelet, "nvidia.com/mig-1g.5gb", 6, 6).await;
    counts(&kubelet, "nvidia.com/mig-3g.20gb", 2, 2).await;
    counts(&kubelet, "nvidia.com/gpu", 1, 1).await;
    // GFD's MIG attribute labels, read from NVML's attributes of each profile's MIG devices
    // (the fake answers as an A100: 14 multiprocessors a slice; 3 slices share 3 copy
    // engines and 2 decoders).
    let labels = backends[1].node_labels().borrow().clone();
    for (key, want) in [
        ("mig-3g.20gb.count", "2"),
        ("mig-3g.20gb.multiprocessors", "42"),
        ("mig-3g.20gb.slices.gi", "3"),
        ("mig-3g.20gb.slices.ci", "3"),
        ("mig-3g.20gb.engines.copy", "3"),
        ("mig-3g.20gb.engines.decoder", "2"),
        ("mig-3g.20gb.engines.encoder", "0"),
        ("mig-3g.20gb.engines.jpeg", "0"),
        ("mig-3g.20gb.engines.ofa", "0"),
    ] {
        assert_eq!(
            labels.get(&format!("nvidia.com/{key}")).map(String::as_str),
            Some(want),
            "{key}: {labels:?}"
        );
    }
    let (g0, g1) = (migs(&node, 0), migs(&node, 1));
    let small: BTreeSet<String> = [&g0[2], &g0[3], &g1[1], &g1[2], &g1[3], &g1[4]]
        .into_iter()
        .cloned()
        .collect();
    assert_eq!(ids(&kubelet, "nvidia.com/mig-1g.5gb"), small);
    assert_eq!(
        ids(&kubelet, "nvidia.com/mig-3g.20gb"),
        BTreeSet::from([g0[0].clone(), g1[0].clone()])
    );
    assert_eq!(
        ids(&kubelet, "nvidia.com/gpu"),
        BTreeSet::from([node.uuid(2)])
    );
    assert!(backends.iter().all(|b| b.not_ready().is_none()));
    // DRA attributes of a MIG device: its own UUID, profile and memory, its parent's identity.
    let list = backends[1].devices().borrow().clone();
    let attrs = support::dra(&list, &g1[0]);
    assert_eq!(attrs["type"], "mig");
    assert_eq!(attrs["uuid"], g1[0]);
    assert_eq!(attrs["parentUUID"], node.uuid(1));
    assert_eq!(attrs["profile"], "3g.20gb");
    assert_eq!(attrs["productName"], "NVIDIA A100-SXM4-40GB");
    assert_eq!(attrs["index"], "1");
    assert_eq!(attrs["capacity memory"], (19968u64 << 20).to_string());
    assert_eq!(
        attrs["resource.kubernetes.io/pciBusID"],
        sysfs_bus_id(&node.topology.gpus[1].bus_id)
    );
    // NUMA from the parent GPU.
    kubelet.read(|n| {
        let devices = n.resource("nvidia.com/mig-3g.20gb").unwrap().devices();
        assert_eq!(devices[&g1[0]].numa_nodes, [0]);
        assert_eq!(
            n.resource("nvidia.com/gpu").unwrap().devices()[&node.uuid(2)].numa_nodes,
            [1]
        );
    });

    // Allocate a 3g.20gb: its MIG UUID in the env, CDI name by MIG UUID, and the nodes: the
    // control nodes, the parent's node, the GI and CI access caps nodes.
    let got = kubelet
        .allocate("p", "c", "nvidia.com/mig-3g.20gb", 1)
        .await
        .unwrap();
    let uuid = got.device_ids[0].clone();
    let (parent, mig) = node
        .topology
        .gpus
        .iter()
        .enumerate()
        .find_map(|(i, g)| {
            g.mig_devices
                .iter()
                .find(|m| m.uuid == uuid)
                .map(|m| (i as u32, m))
        })
        .unwrap();
    let (gi, ci) = (mig.gi, mig.ci);
    assert_eq!(got.env("NVIDIA_VISIBLE_DEVICES"), Some(uuid.as_str()));
    let cdi: Vec<&str> = got
        .response
        .cdi_devices
        .iter()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(cdi, [format!("nvidia.com/gpu={uuid}")]);
    let nodes: Vec<(String, String)> = got
        .response
        .devices
        .iter()
        .map(|d| (d.container_path.clone(), d.host_path.clone()))
        .collect();
    let gi_node = format!("/dev/nvidia-caps/nvidia-cap{}", gi_minor(parent, gi));
    let ci_node = format!("/dev/nvidia-caps/nvidia-cap{}", ci_minor(parent, gi, ci));
    let paths: Vec<&str> = nodes.iter().map(|n| n.0.as_str()).collect();
    assert_eq!(
        paths,
        [
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
            &format!("/dev/nvidia{parent}"),
            &gi_node,
            &ci_node
        ]
    );
    assert_eq!(
        nodes[4].1,
        node.tree
            .dev_root()
            .join(&ci_node["/dev/".len()..])
            .display()
            .to_string()
    );

    // The CDI spec: one device per MIG device, named by its UUID, with its nodes.
    let spec =
        std::fs::read_to_string(node.tree.path("cdi/devplug-nvidia.com_mig-3g.20gb.json")).unwrap();
    let spec: serde_json::Value = serde_json::from_str(&spec).unwrap();
    let devices = spec["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 2);
    let mine = devices.iter().find(|d| d["name"] == uuid.as_str()).unwrap();
    let spec_nodes: Vec<&str> = mine["containerEdits"]["deviceNodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["path"].as_str().unwrap())
        .collect();
    assert_eq!(
        spec_nodes,
        [format!("/dev/nvidia{parent}"), gi_node, ci_node]
    );

    // Two 1g.5gb of one GPU: its node once, each device's caps nodes.
    let two = kubelet
        .allocate("q", "c", "nvidia.com/mig-1g.5gb", 2)
        .await
        .unwrap();
    let env = two.env("NVIDIA_VISIBLE_DEVICES").unwrap();
    assert_eq!(env.split(',').count(), 2);
    assert!(env
        .split(',')
        .all(|u| u.starts_with("MIG-") && small.contains(u)));
    // The whole GPU with MIG off.
    let whole = kubelet
        .allocate("r", "c", "nvidia.com/gpu", 1)
        .await
        .unwrap();
    assert_eq!(
        whole.env("NVIDIA_VISIBLE_DEVICES"),
        Some(node.uuid(2).as_str())
    );
}

#[tokio::test]
async fn mig_single_needs_every_gpu_in_mig_mode_with_one_profile_and_follows_changes() {
    let node = Node::new("a100-mig", true);
    let mut single = node.settings();
    single.mig_strategy = MigStrategy::Single;
    let (kubelet, _host, backends) = serve(&node, vec![("nvidia.com/gpu", single)]).await;
    // GPU 2 has MIG off while 0 and 1 have it on: nothing served, not ready, with the reason.
    let why = not_ready(&backends[0], "not in MIG mode").await;
    assert!(why.contains("GPU 2"), "{why}");
    counts(&kubelet, "nvidia.com/gpu", 0, 0).await;
    // MIG on GPU 2 too (NVML's MIG change event): still three profiles.
    node.inject("mig 2 all-1g");
    let why = not_ready(&backends[0], "needs one MIG profile").await;
    assert!(why.contains("1g.5gb, 2g.10gb, 3g.20gb"), "{why}");
    // One profile everywhere: 21 MIG devices, ready.
    node.inject("mig 0 all-1g");
    node.inject("mig 1 all-1g");
    counts(&kubelet, "nvidia.com/gpu", 21, 21).await;
    assert_eq!(backends[0].not_ready(), None);
    assert!(ids(&kubelet, "nvidia.com/gpu")
        .iter()
        .all(|id| id.starts_with("MIG-")));
    let got = kubelet
        .allocate("p", "c", "nvidia.com/gpu", 1)
        .await
        .unwrap();
    assert!(got
        .env("NVIDIA_VISIBLE_DEVICES")
        .unwrap()
        .starts_with("MIG-"));
}

#[tokio::test]
async fn an_xid_on_a_parent_gpu_makes_its_mig_devices_unhealthy_until_it_recovers() {
    let node = Node::new("a100-mig", true);
    let (kubelet, _host, backends) = serve(
        &node,
        vec![
            ("nvidia.com/mig-1g.5gb", node.mixed(Some("1g.5gb"))),
            ("nvidia.com/mig-3g.20gb", node.mixed(Some("3g.20gb"))),
        ],
    )
    .await;
    counts(&kubelet, "nvidia.com/mig-1g.5gb", 6, 6).await;
    counts(&kubelet, "nvidia.com/mig-3g.20gb", 2, 2).await;
    // A fatal XID on GPU 1: its four 1g.5gb and its 3g.20gb go; GPU 0's stay.
    node.inject("xid 1 79 1");
    counts(&kubelet, "nvidia.com/mig-1g.5gb", 6, 2).await;
    counts(&kubelet, "nvidia.com/mig-3g.20gb", 2, 1).await;
    let g1 = migs(&node, 1);
    assert_eq!(
        reason(&backends[0], &g1[3]),
        "Unhealthy (xid 79: GPU has fallen off the bus (recovery action GPU_RESET))"
    );
    assert_eq!(reason(&backends[0], &migs(&node, 0)[2]), "Healthy");
    // The reset is done (recovery action NONE): all back.
    node.inject("action 1 0");
    counts(&kubelet, "nvidia.com/mig-1g.5gb", 6, 6).await;
    counts(&kubelet, "nvidia.com/mig-3g.20gb", 2, 2).await;
}

#[tokio::test]
async fn an_xid_attributed_to_a_gpu_instance_marks_only_that_mig_device() {
    let node = Node::new("a100-mig", true);
    let (kubelet, _host, backends) = serve(
        &node,
        vec![
            ("nvidia.com/mig-1g.5gb", node.mixed(Some("1g.5gb"))),
            ("nvidia.com/mig-3g.20gb", node.mixed(Some("3g.20gb"))),
            ("nvidia.com/mig-2g.10gb", node.mixed(Some("2g.10gb"))),
        ],
    )
    .await;
    counts(&kubelet, "nvidia.com/mig-1g.5gb", 6, 6).await;
    counts(&kubelet, "nvidia.com/mig-3g.20gb", 2, 2).await;
    counts(&kubelet, "nvidia.com/mig-2g.10gb", 1, 1).await;
    // A fatal XID (the driver asks for a reset) that NVML attributes to GPU instance 9 of
    // GPU 0: that 1g.5gb device alone goes; its siblings on GPU 0 (GI 2, 3 and 10) stay.
    node.inject("xid 0 79 1 gi=9 ci=0");
    counts(&kubelet, "nvidia.com/mig-1g.5gb", 6, 5).await;
    let g0 = migs(&node, 0);
    assert_eq!(
        reason(&backends[0], &g0[2]),
        "Unhealthy (xid 79: GPU has fallen off the bus (recovery action GPU_RESET) on GPU \
         instance 9)"
    );
    assert_eq!(reason(&backends[0], &g0[3]), "Healthy");
    assert_eq!(reason(&backends[1], &g0[0]), "Healthy");
    assert_eq!(reason(&backends[2], &g0[1]), "Healthy");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        kubelet.read(|n| n.capacity("nvidia.com/mig-1g.5gb")),
        (6, 5)
    );
    assert_eq!(
        kubelet.read(|n| n.capacity("nvidia.com/mig-3g.20gb")),
        (2, 2)
    );
    assert_eq!(
        kubelet.read(|n| n.capacity("nvidia.com/mig-2g.10gb")),
        (1, 1)
    );
    // The GPU's recovery action reads NONE again: the instance recovers with it.
    node.inject("action 0 0");
    counts(&kubelet, "nvidia.com/mig-1g.5gb", 6, 6).await;
    // Not attributed (0xFFFFFFFF): every MIG device of the GPU.
    node.inject("xid 0 79 1");
    counts(&kubelet, "nvidia.com/mig-1g.5gb", 6, 4).await;
    counts(&kubelet, "nvidia.com/mig-3g.20gb", 2, 1).await;
    counts(&kubelet, "nvidia.com/mig-2g.10gb", 1, 0).await;
    node.inject("action 0 0");
    counts(&kubelet, "nvidia.com/mig-1g.5gb", 6, 6).await;
    counts(&kubelet, "nvidia.com/mig-2g.10gb", 1, 1).await;
}

#[tokio::test]
async fn a_mig_change_rediscovers_without_touching_the_other_resources_streams() {
    let node = Node::new("a100-mig", true);
    // Health off on one entry: MIG changes are still watched there.
    let mut unwatched = node.mixed(Some("1g.5gb"));
    unwatched.health.enabled = false;
    let (kubelet, _host, _backends) = serve(
        &node,
        vec![
            ("nvidia.com/mig-1g.5gb", unwatched),
            ("nvidia.com/mig-3g.20gb", node.mixed(Some("3g.20gb"))),
            ("nvidia.com/gpu", node.mixed(None)),
        ],
    )
    .await;
    counts(&kubelet, "nvidia.com/mig-1g.5gb", 6, 6).await;
    counts(&kubelet, "nvidia.com/mig-3g.20gb", 2, 2).await;
    counts(&kubelet, "nvidia.com/gpu", 1, 1).await;
    let before = kubelet.read(|n| {
        let r = n.resource("nvidia.com/mig-3g.20gb").unwrap();
        (r.updates(), r.connections())
    });
    // GPU 2 goes into MIG mode with 7x 1g.5gb: the 1g.5gb resource gains 7, the whole-GPU
    // resource loses GPU 2, and the 3g.20gb resource is not touched.
    node.inject("mig 2 all-1g");
    counts(&kubelet, "nvidia.com/mig-1g.5gb", 13, 13).await;
    counts(&kubelet, "nvidia.com/gpu", 0, 0).await;
    // Give the 3g.20gb resource's own rediscovery time to (wrongly) send something.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = kubelet.read(|n| {
        let r = n.resource("nvidia.com/mig-3g.20gb").unwrap();
        (r.updates(), r.connections(), r.capacity(), r.is_connected())
    });
    assert_eq!((after.0, after.1), before, "the 3g.20gb stream was touched");
    assert_eq!((after.2, after.3), (2, true));
    // The new devices are in the CDI spec and can be allocated.
    let spec =
        std::fs::read_to_string(node.tree.path("cdi/devplug-nvidia.com_mig-1g.5gb.json")).unwrap();
    let spec: serde_json::Value = serde_json::from_str(&spec).unwrap();
    assert_eq!(spec["devices"].as_array().unwrap().len(), 13);
    let new: Vec<String> = ids(&kubelet, "nvidia.com/mig-1g.5gb")
        .into_iter()
        .filter(|id| id.contains("-00000000210"))
        .collect();
    assert_eq!(new.len(), 7, "{new:?}");
    // And back: MIG off on GPU 2 gives it back to the whole-GPU resource.
    node.inject("mig 2 off");
    counts(&kubelet, "nvidia.com/mig-1g.5gb", 6, 6).await;
    counts(&kubelet, "nvidia.com/gpu", 1, 1).await;
}

/// A GPU lost while a MIG change is discovered (NVML cannot read it) does not fail the
/// rediscovery: its MIG devices stay listed, Unhealthy, and the other GPUs' new layout is
/// served.
#[tokio::test]
async fn a_gpu_lost_during_a_mig_rediscovery_stays_listed_unhealthy_and_the_others_are_served() {
    let node = Node::new("a100-mig", true);
    let (kubelet, _host, backends) = serve(
        &node,
        vec![("nvidia.com/mig-1g.5gb", node.mixed(Some("1g.5gb")))],
    )
    .await;
    // GPU 0 has 2 of them, GPU 1 has 4.
    counts(&kubelet, "nvidia.com/mig-1g.5gb", 6, 6).await;
    node.inject("lost 0");
    counts(&kubelet, "nvidia.com/mig-1g.5gb", 6, 4).await;
    // GPU 2 into MIG mode with 7x 1g.5gb, while GPU 0 still does not answer.
    node.inject("mig 2 all-1g");
    counts(&kubelet, "nvidia.com/mig-1g.5gb", 13, 11).await;
    let gpu0 = backends[0].devices().borrow().clone();
    let unhealthy: Vec<&str> = gpu0
        .devices()
        .iter()
        .filter(|d| !d.health.is_healthy())
        .map(|d| d.id.as_str())
        .collect();
    assert_eq!(unhealthy.len(), 2, "{unhealthy:?}");
    // GPU 0 answers again: all 13 healthy.
    node.inject("found 0");
    counts(&kubelet, "nvidia.com/mig-1g.5gb", 13, 13).await;
}

/// The driver's files, found by the version NVML reports under the root it was loaded from,
/// reach the container through `Allocate` and the CDI spec alike, at host paths.
#[tokio::test]
async fn the_drivers_files_reach_allocate_and_the_cdi_spec_at_host_paths() {
    let node = Node::new("pcie-4gpu", true);
    let version = "570.86.15"; // what the fake NVML reports
    for name in ["libcuda", "libnvidia-ptxjitcompiler", "libnvidia-nvvm"] {
        std::fs::write(node.lib_dir.join(format!("{name}.so.{version}")), name).unwrap();
    }
    let bin = node._tmp.path().join("driver/usr/bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::write(bin.join("nvidia-smi"), "smi").unwrap();
    let mut settings = node.settings();
    settings.device_list_strategy = vec![ListStrategy::CdiCri, ListStrategy::DeviceSpecs];
    settings.host_driver_root = Some(PathBuf::from("/run/nvidia/driver"));
    let backend = NvidiaBackend::start("nvidia.com/gpu", &settings).unwrap();
    // The first discovery ends with the GPUs listed: nothing empty for the kubelet to see.
    tokio::time::timeout(WAIT, backend.discovered())
        .await
        .unwrap();
    assert_eq!(backend.devices().borrow().len(), 4);
    let served: Vec<(&str, Arc<dyn Backend>)> = vec![("nvidia.com/gpu", Arc::new(backend))];
    let (kubelet, _host) = support::serve(&node.tree.path("kubelet/device-plugins"), served).await;
    counts(&kubelet, "nvidia.com/gpu", 4, 4).await;
    let got = kubelet
        .allocate("pod-a", "main", "nvidia.com/gpu", 1)
        .await
        .unwrap();
    let host_lib = "/run/nvidia/driver/usr/lib/x86_64-linux-gnu";
    let mounts: Vec<(String, String, bool)> = got
        .response
        .mounts
        .iter()
        .map(|m| (m.container_path.clone(), m.host_path.clone(), m.read_only))
        .collect();
    assert!(mounts.contains(&(
        "/usr/local/nvidia/lib64/libcuda.so.1".into(),
        format!("{host_lib}/libcuda.so.{version}"),
        true
    )));
    assert!(mounts.contains(&(
        "/usr/local/nvidia/bin/nvidia-smi".into(),
        "/run/nvidia/driver/usr/bin/nvidia-smi".into(),
        true
    )));
    assert_eq!(mounts.len(), 8, "{mounts:?}");
    // The CDI spec's common edits carry the same mounts.
    let spec = std::fs::read_to_string(node.tree.path("cdi/devplug-nvidia.com_gpu.json")).unwrap();
    let spec: serde_json::Value = serde_json::from_str(&spec).unwrap();
    let common: Vec<(String, String)> = spec["containerEdits"]["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            assert_eq!(m["options"][0], "ro");
            (
                m["containerPath"].as_str().unwrap().to_owned(),
                m["hostPath"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let from_allocate: Vec<(String, String)> = mounts.into_iter().map(|(c, h, _)| (c, h)).collect();
    assert_eq!(common, from_allocate);

    // Turned off (NVIDIA's toolkit is the runtime): nothing mounted.
    let mut off = node.settings();
    off.device_list_strategy = vec![ListStrategy::DeviceSpecs];
    off.driver_files = false;
    off.cdi_dir = node.tree.path("cdi-off");
    let backend = NvidiaBackend::start("nvidia.com/gpu", &off).unwrap();
    tokio::time::timeout(WAIT, backend.discovered())
        .await
        .unwrap();
    let first = backend.devices().borrow().devices()[0].id.clone();
    assert!(backend.allocate(&[first]).unwrap().mounts.is_empty());
}

/// Driver libraries of another version where the dynamic loader looks (an older driver's
/// leftovers in a folder `ld.so.conf` names) make the resource not ready with which file is
/// which version, and containers get no driver files; the GPUs are still listed.
#[tokio::test]
async fn a_mix_of_driver_versions_is_refused_with_the_files_and_the_fix() {
    use std::os::unix::fs::symlink;
    let node = Node::new("pcie-4gpu", true);
    let version = "570.86.15"; // what the fake NVML reports
    std::fs::write(node.lib_dir.join(format!("libcuda.so.{version}")), "cuda").unwrap();
    let root = node._tmp.path().join("driver");
    let old = root.join("usr/local/old-driver/lib64");
    std::fs::create_dir_all(&old).unwrap();
    std::fs::write(old.join("libcuda.so.550.54.15"), "old cuda").unwrap();
    symlink("libcuda.so.550.54.15", old.join("libcuda.so.1")).unwrap();
    std::fs::create_dir_all(root.join("etc")).unwrap();
    std::fs::write(root.join("etc/ld.so.conf"), "/usr/local/old-driver/lib64\n").unwrap();
    let mut settings = node.settings();
    settings.device_list_strategy = vec![ListStrategy::DeviceSpecs];
    let backend = NvidiaBackend::start("nvidia.com/gpu", &settings).unwrap();
    tokio::time::timeout(WAIT, backend.discovered())
        .await
        .unwrap();
    let reason = not_ready(&backend, "more than one version").await;
    assert!(
        reason.contains(
            "NVML reports driver 570.86.15, but /usr/local/old-driver/lib64/libcuda.so.1 \
             (-> /usr/local/old-driver/lib64/libcuda.so.550.54.15) is 550.54.15"
        ),
        "{reason}"
    );
    assert!(reason.contains("Fix: "), "{reason}");
    assert_eq!(backend.devices().borrow().len(), 4);
    let first = backend.devices().borrow().devices()[0].id.clone();
    assert!(backend.allocate(&[first]).unwrap().mounts.is_empty());
}

/// A stand-in for the driver's `nvidia-cuda-mps-control`, as the real one behaves (checked on
/// an H200, driver 580.159.04): `-f` records a start (GPU, folders, library path), refuses to
/// run beside a daemon already on the folder, makes the pipe folder's `control` and runs until
/// it is gone; otherwise, with no daemon on the folder, it exits 1 ("Cannot find MPS control
/// daemon process"), else reads one command from stdin, records it, and on `quit` removes
/// `control`.
const FAKE_MPS_CONTROL: &str = r#"#!/bin/sh
log="$(dirname "$0")/mps-calls.log"
if [ "$1" = "-f" ]; then
  echo "start $CUDA_VISIBLE_DEVICES $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY $LD_LIBRARY_PATH" >> "$log"
  if [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ]; then
    echo "An instance of this daemon is already running" >&2
    exit 1
  fi
  : > "$CUDA_MPS_PIPE_DIRECTORY/control"
  while [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ]; do sleep 0.05; done
else
  if [ ! -e "$CUDA_MPS_PIPE_DIRECTORY/control" ]; then
    echo "Cannot find MPS control daemon process" >&2
    exit 1
  fi
  read -r cmd
  echo "$cmd $CUDA_MPS_PIPE_DIRECTORY" >> "$log"
  [ "$cmd" = quit ] && rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
  exit 0
fi
"#;

/// A 4-GPU node whose driver has the fake MPS control program, and settings that share GPUs
/// by capacity through it.
struct MpsNode {
    node: Node,
    /// The driver's programs (and the fake's call log).
    bin: PathBuf,
    control: PathBuf,
    mps_dir: PathBuf,
    settings: NvidiaSettings,
}

fn mps_node() -> MpsNode {
    use devplug_backends::nvidia::MpsShare;
    use std::os::unix::fs::PermissionsExt;
    let node = Node::new("pcie-4gpu", true);
    std::fs::write(node.lib_dir.join("libcuda.so.570.86.15"), "cuda").unwrap();
    let bin = node._tmp.path().join("driver/usr/bin");
    std::fs::create_dir_all(&bin).unwrap();
    let control = bin.join("nvidia-cuda-mps-control");
    std::fs::write(&control, FAKE_MPS_CONTROL).unwrap();
    std::fs::set_permissions(&control, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mps_dir = node._tmp.path().join("mps");
    let mut settings = node.settings();
    settings.share = Some(MpsShare {
        memory_step: "1Gi".into(),
        dir: mps_dir.clone(),
        host_dir: Some(PathBuf::from("/host/mps")),
    });
    MpsNode {
        node,
        bin,
        control,
        mps_dir,
        settings,
    }
}

#[tokio::test]
async fn gpus_shared_by_capacity_run_one_mps_daemon_each_while_they_have_shares() {
    use std::collections::BTreeMap;
    let MpsNode {
        node,
        bin,
        control,
        mps_dir,
        settings,
    } = mps_node();
    let backend = NvidiaBackend::start("nvidia.com/gpu", &settings).unwrap();
    tokio::time::timeout(WAIT, backend.discovered())
        .await
        .unwrap();
    let list = backend.devices().borrow().clone();
    let gpu = &list.devices()[0];
    let attrs = gpu.dra_attributes();
    assert!(attrs.is_shared() && attrs.check().is_ok(), "{attrs:?}");
    assert_eq!(attrs.capacity["cores"], 100);
    assert!(attrs.capacity["memory"] > 1 << 30, "{attrs:?}");
    let uuid = node.uuid(0);
    assert_eq!(gpu.id, uuid);

    // The first share starts the GPU's daemon and gets its limits; the second reuses it.
    let consumed = BTreeMap::from([("cores".to_owned(), 40), ("memory".to_owned(), 4 << 30)]);
    let edits = backend.prepare_share(&uuid, &consumed).unwrap();
    assert_eq!(edits.envs["NVIDIA_VISIBLE_DEVICES"], uuid);
    assert_eq!(edits.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "40");
    assert_eq!(edits.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=4096M");
    assert_eq!(edits.envs["CUDA_MPS_PIPE_DIRECTORY"], "/run/nvidia-mps");
    assert!(edits
        .mounts
        .iter()
        .any(|m| m.host_path == format!("/host/mps/{uuid}/pipe") && !m.read_only));
    let pipe = mps_dir.join(&uuid).join("pipe");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !pipe.join("control").exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the daemon was not started"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let half = BTreeMap::from([("cores".to_owned(), 50), ("memory".to_owned(), 1 << 30)]);
    let second = backend.prepare_share(&uuid, &half).unwrap();
    assert_eq!(second.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "50");
    let calls = std::fs::read_to_string(bin.join("mps-calls.log")).unwrap();
    let starts: Vec<&str> = calls.lines().filter(|l| l.starts_with("start")).collect();
    assert_eq!(starts.len(), 1, "one daemon per GPU: {calls}");
    assert_eq!(
        starts[0],
        format!(
            "start {uuid} {} {} {}",
            pipe.display(),
            mps_dir.join(&uuid).join("log").display(),
            node.lib_dir.display()
        )
    );

    // The last share released: the daemon is told to quit.
    backend.unprepare_shares(&uuid);
    let calls = std::fs::read_to_string(bin.join("mps-calls.log")).unwrap();
    assert!(
        calls
            .lines()
            .any(|l| l == format!("quit {}", pipe.display())),
        "{calls}"
    );
    assert!(!pipe.join("control").exists());

    // After a restart with shares still prepared, the daemon is started again.
    backend.restore_shares(&uuid);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !pipe.join("control").exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the daemon was not started again"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let calls = std::fs::read_to_string(bin.join("mps-calls.log")).unwrap();
    assert_eq!(
        calls.lines().filter(|l| l.starts_with("start")).count(),
        2,
        "{calls}"
    );
    backend.unprepare_shares(&uuid);

    // Without the driver's program, a share is refused with the reason.
    std::fs::remove_file(&control).unwrap();
    let mut no_program = settings.clone();
    no_program.cdi_dir = node.tree.path("cdi-2");
    let backend = NvidiaBackend::start("nvidia.com/gpu", &no_program).unwrap();
    tokio::time::timeout(WAIT, backend.discovered())
        .await
        .unwrap();
    let err = backend.prepare_share(&uuid, &consumed).unwrap_err();
    assert!(
        err.to_string()
            .contains("nvidia-cuda-mps-control was not found"),
        "{err}"
    );
}

/// devplug restarted alone (a host service) while a GPU's shares are in use: its MPS daemon
/// outlived it, and the driver's program would refuse a second one on the same folder. The new
/// devplug adopts the running daemon (no second start), serves shares on it, and tells it to
/// quit when the last share goes.
#[tokio::test]
async fn a_restarted_devplug_adopts_the_mps_daemon_its_predecessor_left() {
    use std::collections::BTreeMap;
    let MpsNode {
        node,
        bin,
        mps_dir,
        settings,
        ..
    } = mps_node();
    let uuid = node.uuid(0);
    let pipe = mps_dir.join(&uuid).join("pipe");
    let share = BTreeMap::from([("cores".to_owned(), 50), ("memory".to_owned(), 1 << 30)]);
    let starts = || {
        std::fs::read_to_string(bin.join("mps-calls.log"))
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with("start"))
            .count()
    };

    let first = NvidiaBackend::start("nvidia.com/gpu", &settings).unwrap();
    tokio::time::timeout(WAIT, first.discovered())
        .await
        .unwrap();
    first.prepare_share(&uuid, &share).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !pipe.join("control").exists() {
        assert!(std::time::Instant::now() < deadline, "no daemon started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(starts(), 1);
    // The first devplug goes without telling its daemon (killed); the daemon runs on.
    drop(first);

    let mut again = settings.clone();
    again.cdi_dir = node.tree.path("cdi-2");
    let second = NvidiaBackend::start("nvidia.com/gpu", &again).unwrap();
    tokio::time::timeout(WAIT, second.discovered())
        .await
        .unwrap();
    second.restore_shares(&uuid);
    let edits = second.prepare_share(&uuid, &share).unwrap();
    assert_eq!(edits.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "50");
    let calls = std::fs::read_to_string(bin.join("mps-calls.log")).unwrap();
    assert_eq!(
        starts(),
        1,
        "the running daemon was adopted, not started again: {calls}"
    );
    assert!(
        calls
            .lines()
            .any(|l| l == format!("get_server_list {}", pipe.display())),
        "{calls}"
    );
    // Its last share gone, the adopted daemon is told to quit like an own one.
    second.unprepare_shares(&uuid);
    let calls = std::fs::read_to_string(bin.join("mps-calls.log")).unwrap();
    assert!(
        calls
            .lines()
            .any(|l| l == format!("quit {}", pipe.display())),
        "{calls}"
    );
    assert!(!pipe.join("control").exists());
}

/// The nodes (container paths) and `NVIDIA_VISIBLE_DEVICES` of an allocation.
fn given(edits: &devplug::ContainerEdits) -> (Vec<String>, String) {
    let nodes = edits
        .devices
        .iter()
        .map(|d| d.container_path.clone())
        .collect();
    let visible = edits
        .envs
        .get("NVIDIA_VISIBLE_DEVICES")
        .cloned()
        .unwrap_or_default();
    (nodes, visible)
}

/// A DRA claim's edits reach the container only through the claim's own CDI spec, which cannot
/// name the resource's CDI devices: a whole GPU comes with its nodes and the driver's files
/// under the default `device_list_strategy` too.
#[tokio::test]
async fn a_whole_gpu_given_to_a_claim_carries_its_nodes_and_driver_files() {
    let node = Node::new("pcie-4gpu", true);
    // What the fake NVML reports.
    std::fs::write(node.lib_dir.join("libcuda.so.570.86.15"), "libcuda").unwrap();
    let backend = NvidiaBackend::start("nvidia.com/gpu", &node.settings()).unwrap();
    tokio::time::timeout(WAIT, backend.discovered())
        .await
        .unwrap();
    let first = backend.devices().borrow().devices()[0].id.clone();
    let plugin = backend.allocate(std::slice::from_ref(&first)).unwrap();
    let claim = backend
        .prepare_devices(std::slice::from_ref(&first))
        .unwrap();
    let (nodes, visible) = given(&claim);
    assert_eq!(
        visible, first,
        "NVIDIA_VISIBLE_DEVICES as the strategy says"
    );
    assert!(nodes.contains(&"/dev/nvidiactl".to_owned()), "{nodes:?}");
    assert!(
        nodes
            .iter()
            .any(|n| n.starts_with("/dev/nvidia") && n[11..].parse::<u32>().is_ok()),
        "the GPU's own node: {nodes:?}"
    );
    assert!(claim.cdi_devices.is_empty(), "{:?}", claim.cdi_devices);
    assert!(!claim.mounts.is_empty(), "the driver's files");
    // The device plugin's answer names the CDI device instead (the runtime reads its spec).
    assert!(
        plugin.devices.is_empty() && !plugin.cdi_devices.is_empty(),
        "{plugin:?}"
    );
}

#[tokio::test]
async fn dynamic_mig_partitions_are_made_at_allocation_and_destroyed_at_release() {
    let node = Node::new("a100-partitions", true);
    let mut settings = node.settings();
    settings.mig_strategy = MigStrategy::Dynamic;
    let backend = NvidiaBackend::start("nvidia.com/gpu", &settings).unwrap();
    tokio::time::timeout(WAIT, backend.discovered())
        .await
        .unwrap();
    let list = backend.devices().borrow().clone();
    assert_eq!(backend.not_ready(), None);
    // Two A100-40GB in MIG mode: a counter set each, 18 partitions each.
    let sets: Vec<&str> = list
        .counter_sets()
        .iter()
        .map(|s| s.name.as_str())
        .collect();
    assert_eq!(sets, ["gpu-0", "gpu-1"]);
    assert_eq!(list.devices().len(), 36);
    let ids = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();

    // A 3g.20gb at memory slice 0: a new MIG device with its GPU's node and its caps nodes.
    let edits = backend
        .prepare_devices(&ids(&["gpu-0-mig-3g-20gb-0"]))
        .unwrap();
    let (nodes, first) = given(&edits);
    assert!(first.starts_with("MIG-") && !first.contains(','), "{first}");
    assert!(nodes.contains(&"/dev/nvidia0".to_owned()), "{nodes:?}");
    assert!(nodes.contains(&"/dev/nvidiactl".to_owned()), "{nodes:?}");
    let caps: Vec<&String> = nodes.iter().filter(|n| n.contains("nvidia-caps")).collect();
    assert_eq!(caps.len(), 2, "GI and CI access nodes: {nodes:?}");
    // Asked again (a retried prepare): the same instance.
    let again = backend
        .prepare_devices(&ids(&["gpu-0-mig-3g-20gb-0"]))
        .unwrap();
    assert_eq!(given(&again).1, first);
    // A 2g.10gb at slice 2 overlaps it: the driver refuses, and the error says why.
    let err = backend
        .prepare_devices(&ids(&["gpu-0-mig-2g-10gb-2"]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("insufficient resources"), "{err}");
    assert!(err.contains("gpu-0-mig-2g-10gb-2"), "{err}");
    // The other half of the GPU is free.
    let other = backend
        .prepare_devices(&ids(&["gpu-0-mig-3g-20gb-4"]))
        .unwrap();
    assert_ne!(given(&other).1, first);
    // Released: the overlapping 2g.10gb can now be made; a second release finds nothing.
    backend
        .unprepare_devices(&ids(&["gpu-0-mig-3g-20gb-0"]))
        .unwrap();
    backend
        .unprepare_devices(&ids(&["gpu-0-mig-3g-20gb-0"]))
        .unwrap();
    let two = backend
        .prepare_devices(&ids(&["gpu-0-mig-2g-10gb-2"]))
        .unwrap();
    assert!(given(&two).1.starts_with("MIG-"));
    backend
        .unprepare_devices(&ids(&["gpu-0-mig-2g-10gb-2", "gpu-0-mig-3g-20gb-4"]))
        .unwrap();

    // Two in one request, the second impossible with the first: the first is undone.
    let err = backend
        .prepare_devices(&ids(&["gpu-1-mig-4g-20gb-0", "gpu-1-mig-7g-40gb-0"]))
        .unwrap_err();
    assert!(err.to_string().contains("gpu-1-mig-7g-40gb-0"), "{err}");
    let whole = backend
        .prepare_devices(&ids(&["gpu-1-mig-7g-40gb-0"]))
        .unwrap();
    assert!(given(&whole).1.starts_with("MIG-"));
    backend
        .unprepare_devices(&ids(&["gpu-1-mig-7g-40gb-0"]))
        .unwrap();
    // Two that fit, in one request: both MIG devices, one GPU node.
    let pair = backend
        .prepare_devices(&ids(&["gpu-1-mig-1g-5gb-0", "gpu-1-mig-1g-5gb-1"]))
        .unwrap();
    let (nodes, visible) = given(&pair);
    assert_eq!(visible.split(',').count(), 2, "{visible}");
    assert_eq!(nodes.iter().filter(|n| *n == "/dev/nvidia1").count(), 1);
    backend
        .unprepare_devices(&ids(&["gpu-1-mig-1g-5gb-0", "gpu-1-mig-1g-5gb-1"]))
        .unwrap();

    // How long a partition takes to make and to destroy through NVML (here the fake).
    let one = ids(&["gpu-0-mig-1g-5gb-3"]);
    let (mut made, mut gone) = (Vec::new(), Vec::new());
    for _ in 0..50 {
        let t = std::time::Instant::now();
        backend.prepare_devices(&one).unwrap();
        made.push(t.elapsed());
        let t = std::time::Instant::now();
        backend.unprepare_devices(&one).unwrap();
        gone.push(t.elapsed());
    }
    made.sort();
    gone.sort();
    println!(
        "figure: MIG partition through NVML (fake NVML), 50 times: create p50 {:.2} ms, p99 {:.2} ms; destroy p50 {:.2} ms, p99 {:.2} ms",
        made[25].as_secs_f64() * 1e3,
        made[49].as_secs_f64() * 1e3,
        gone[25].as_secs_f64() * 1e3,
        gone[49].as_secs_f64() * 1e3,
    );
}
