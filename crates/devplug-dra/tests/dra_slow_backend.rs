//! A claim backend whose prepare blocks for 2 s (as an NVML call creating a MIG partition or an
//! MPS daemon starting can) must not stall the device plugins served beside it. `devplug run`
//! serves every device plugin and every DRA driver from one current-thread runtime, as this
//! test does (`#[tokio::test]` is current-thread): the kubelet simulator, a device plugin host
//! and the DRA driver's kubelet side all share the one thread. While the kubelet's
//! `NodePrepareResources` waits on the slow backend, a device plugin's `Allocate` is called over
//! and over; each must come back at its usual speed.
//!
//! And a driver stopped while that prepare waits (a SIGTERM, or the config's reload stopping it
//! to start it again) returns only once the prepare is done and its checkpoint written: a driver
//! started next in the same process reads that checkpoint, and must find the claim in it.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use devplug::backend::BoxFuture;
use devplug::{AllocateError, Backend, ContainerEdits, Device, DeviceList, Host, ResourceSettings};
use devplug_dra::checkpoint::Checkpoint;
use devplug_dra::claims::{AllocatedDevice, ClaimRef, ClaimSource};
use devplug_dra::kubelet::{KubeletDirs, KubeletSide, Registered};
use devplug_dra::prepare::{PrepareFiles, Preparer};
use devplug_dra::{ClaimBackend, Hold};
use kubelet_sim::DraClaim;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{watch, Notify};

const DRIVER: &str = "gpu.example.com";
const RESOURCE: &str = "example.com/npu";
const PREPARE_TAKES: Duration = Duration::from_secs(2);

/// Devices whose `allocate` answers at once.
struct Quick(watch::Sender<DeviceList>);

impl Backend for Quick {
    fn devices(&self) -> watch::Receiver<DeviceList> {
        self.0.subscribe()
    }
    fn allocate(&self, ids: &[String]) -> Result<ContainerEdits, AllocateError> {
        Ok(ContainerEdits::default().env("NPU_VISIBLE_DEVICES", ids.join(",")))
    }
}

/// A claim backend whose prepare blocks its thread for [`PREPARE_TAKES`], saying when it
/// starts.
struct Slow {
    devices: watch::Sender<DeviceList>,
    entered: Arc<Notify>,
}

impl Backend for Slow {
    fn devices(&self) -> watch::Receiver<DeviceList> {
        self.devices.subscribe()
    }
    fn allocate(&self, ids: &[String]) -> Result<ContainerEdits, AllocateError> {
        Ok(ContainerEdits::default().env("GPU_VISIBLE_DEVICES", ids.join(",")))
    }
}

impl ClaimBackend for Slow {
    fn prepare_devices(&self, ids: &[String]) -> Result<ContainerEdits, AllocateError> {
        self.entered.notify_one();
        std::thread::sleep(PREPARE_TAKES);
        self.allocate(ids)
    }
}

/// One claim, `uid-1`, of device `gpu-0`.
struct OneClaim;

impl ClaimSource for OneClaim {
    fn allocation<'a>(
        &'a self,
        claim: &'a ClaimRef,
    ) -> BoxFuture<'a, Result<Vec<AllocatedDevice>, String>> {
        let found = (claim.uid == "uid-1").then(|| {
            vec![AllocatedDevice {
                request: "gpu".into(),
                pool: "node-a".into(),
                device: "gpu-0".into(),
                hold: Hold::Exclusive,
                consumed: Default::default(),
                tolerates_unhealthy: false,
                pod_claim_name: None,
            }]
        });
        Box::pin(async move { found.ok_or_else(|| "no such claim".to_owned()) })
    }
}

/// The DRA driver over [`Slow`], registered through the plugin watcher: its kubelet side, its
/// checkpoint's path, and the backend's "prepare started" signal.
async fn slow_driver(root: &Path, device_plugins: &Path) -> (KubeletSide, PathBuf, Arc<Notify>) {
    let dirs = KubeletDirs::beside(device_plugins);
    let gpus = DeviceList::new([Device::new("gpu-0")]);
    let entered = Arc::new(Notify::new());
    let checkpoint = dirs.driver_dir(DRIVER).join("checkpoint.json");
    let backend = Slow {
        devices: watch::channel(gpus).0,
        entered: entered.clone(),
    };
    let preparer = Preparer::new(
        DRIVER,
        "node-a",
        Arc::new(backend),
        Arc::new(OneClaim),
        PrepareFiles {
            cdi_dir: root.join("cdi"),
            checkpoint: checkpoint.clone(),
        },
    )
    .unwrap();
    let side = KubeletSide::start(Arc::new(preparer), &dirs).unwrap();
    let mut registered = side.registered();
    tokio::time::timeout(
        Duration::from_secs(10),
        registered.wait_for(|r| *r == Registered::Yes),
    )
    .await
    .unwrap()
    .unwrap();
    (side, checkpoint, entered)
}

#[tokio::test]
async fn a_slow_claim_backend_does_not_delay_another_resources_allocate() {
    let (root, device_plugins, kubelet) = devplug_testkit::dra_node::kubelet().await;

    // The device plugin: 4 NPUs.
    let host = Host::new(&device_plugins).unwrap();
    let npus = DeviceList::new((0..4).map(|i| Device::new(format!("npu-{i}"))));
    host.add_with(
        RESOURCE,
        Arc::new(Quick(watch::channel(npus).0)),
        ResourceSettings::default(),
    )
    .unwrap();
    kubelet
        .wait_for(Duration::from_secs(10), |n| {
            (n.resource(RESOURCE)?.devices().len() == 4).then_some(())
        })
        .await
        .unwrap();

    // The DRA driver over the slow backend, registered through the plugin watcher.
    let (side, _, _) = slow_driver(root.path(), &device_plugins).await;

    let claims = [DraClaim::new("ns", "claim-1", "uid-1")];
    let started = Instant::now();
    // Allocate and free NPUs in a loop until the prepare answers.
    let mut took: Vec<Duration> = Vec::new();
    let prepared = {
        let prepare = kubelet.dra_prepare(DRIVER, &claims);
        tokio::pin!(prepare);
        loop {
            let pod = format!("pod-{}", took.len());
            let asked = Instant::now();
            tokio::select! {
                biased;
                answer = &mut prepare => break answer.unwrap(),
                allocated = kubelet.allocate(&pod, "main", RESOURCE, 1) => {
                    allocated.unwrap();
                    took.push(asked.elapsed());
                    assert!(kubelet.remove_pod(&pod));
                }
            }
        }
    };
    let prepare_took = started.elapsed();
    assert!(prepared["uid-1"].is_ok(), "{prepared:?}");
    assert!(
        prepare_took >= PREPARE_TAKES,
        "the prepare waited on the backend: {prepare_took:?}"
    );
    took.sort();
    let at = |q: f64| {
        let last = took.len().saturating_sub(1);
        took[((last as f64) * q).round() as usize]
    };
    println!(
        "{} Allocates while one NodePrepareResources waited {prepare_took:?} on its backend: \
         p50 {:?}, p99 {:?}, max {:?}",
        took.len(),
        at(0.5),
        at(0.99),
        at(1.0)
    );
    // Had the prepare run on the runtime, no Allocate could have answered within the 2 s.
    assert!(
        took.len() >= 10,
        "Allocate answered only {} times during the prepare",
        took.len()
    );
    assert!(
        at(0.5) < Duration::from_millis(50),
        "Allocate's median during the prepare: {:?}",
        at(0.5)
    );
    assert!(
        at(1.0) < PREPARE_TAKES / 2,
        "no Allocate waited for the prepare: {:?}",
        at(1.0)
    );
    drop(side);
    host.shutdown().await;
    kubelet.stop().await;
}

#[tokio::test]
async fn a_stopped_driver_finishes_the_prepare_in_flight_first() {
    let (root, device_plugins, kubelet) = devplug_testkit::dra_node::kubelet().await;
    let (side, checkpoint, entered) = slow_driver(root.path(), &device_plugins).await;

    let claims = [DraClaim::new("ns", "claim-1", "uid-1")];
    let prepare = kubelet.dra_prepare(DRIVER, &claims);
    let stop = async {
        // Once the backend is in the prepare: stop the driver, then read the checkpoint as the
        // driver started next would.
        entered.notified().await;
        let asked = Instant::now();
        let problems = side.stop().await;
        let took = asked.elapsed();
        (
            took,
            problems,
            Checkpoint::load(&checkpoint, DRIVER).unwrap(),
        )
    };
    let (answer, (stop_took, problems, saved)) = tokio::join!(prepare, stop);
    assert!(problems.is_empty(), "{problems:?}");
    assert!(
        saved.claims.contains_key("uid-1"),
        "the stop returned before the prepare in flight wrote its checkpoint (after {stop_took:?})"
    );
    // The kubelet got the answer of the call it made before the stop.
    let answer = answer.unwrap();
    assert!(answer["uid-1"].is_ok(), "{answer:?}");
    println!("the stop returned after {stop_took:?}, the prepare in flight done and saved");
    kubelet.stop().await;
}
