//! The DRA driver's kubelet side against the kubelet simulator over real Unix sockets: found by
//! the plugin watcher, registered as `v1.DRAPlugin`, claims prepared with CDI ids and a spec on
//! disk, unprepared, and a restarted driver answering from its checkpoint. Claims come from a
//! fixed table here (the API server path is tested in `dra_e2e.rs`).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use devplug::backend::BoxFuture;
use devplug::{AllocateError, Backend, ContainerEdits, Device, DeviceList};
use devplug_dra::claims::{AllocatedDevice, ClaimRef, ClaimSource};
use devplug_dra::kubelet::{KubeletDirs, KubeletSide, Registered};
use devplug_dra::prepare::{PrepareFiles, Preparer};
use devplug_dra::ClaimBackend;
use kubelet_sim::{DraClaim, DraService, Kubelet, SimConfig};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

const DRIVER: &str = "npu.example.com";

struct Npus(watch::Sender<DeviceList>);

impl Backend for Npus {
    fn devices(&self) -> watch::Receiver<DeviceList> {
        self.0.subscribe()
    }
    fn allocate(&self, ids: &[String]) -> Result<ContainerEdits, AllocateError> {
        Ok(ContainerEdits::default().env("NPU_VISIBLE_DEVICES", ids.join(",")))
    }
}

/// Devices handed to claims whole, as the device plugin hands them.
impl ClaimBackend for Npus {}

struct Fixed(HashMap<String, Vec<AllocatedDevice>>);

impl ClaimSource for Fixed {
    fn allocation<'a>(
        &'a self,
        claim: &'a ClaimRef,
    ) -> BoxFuture<'a, Result<Vec<AllocatedDevice>, String>> {
        let found = self.0.get(&claim.uid).cloned();
        Box::pin(async move { found.ok_or_else(|| format!("no claim {}", claim.uid)) })
    }
}

fn device(request: &str, name: &str) -> AllocatedDevice {
    AllocatedDevice {
        request: request.into(),
        pool: "node-a".into(),
        device: name.into(),
        hold: devplug_dra::Hold::Exclusive,
        consumed: Default::default(),
        tolerates_unhealthy: false,
        pod_claim_name: None,
    }
}

#[allow(clippy::unwrap_used)]
fn preparer(files: &PrepareFiles) -> Arc<Preparer> {
    let list = DeviceList::new((0..4).map(|i| Device::new(format!("npu-{i}"))));
    let (tx, _) = watch::channel(list);
    let claims = Fixed(HashMap::from([
        (
            "uid-1".to_owned(),
            vec![device("npus", "npu-1"), device("npus", "npu-2")],
        ),
        ("uid-2".to_owned(), vec![device("npus", "npu-3")]),
    ]));
    Arc::new(
        Preparer::new(
            DRIVER,
            "node-a",
            Arc::new(Npus(tx)),
            Arc::new(claims),
            files.clone(),
        )
        .unwrap(),
    )
}

/// A simulated kubelet with its plugin watcher, the driver's folders and its files.
async fn node() -> (tempfile::TempDir, Kubelet, KubeletDirs, PrepareFiles) {
    let root = tempfile::tempdir().unwrap();
    let device_plugins = root.path().join("device-plugins");
    std::fs::create_dir_all(&device_plugins).unwrap();
    let dirs = KubeletDirs::beside(&device_plugins);
    let config = SimConfig {
        watcher_reconcile: Duration::from_millis(50),
        ..SimConfig::default()
    }
    .with_watcher_beside(&device_plugins);
    let kubelet = Kubelet::start_with(&device_plugins, config).await.unwrap();
    let files = PrepareFiles {
        cdi_dir: root.path().join("cdi"),
        checkpoint: dirs.driver_dir(DRIVER).join("checkpoint.json"),
    };
    (root, kubelet, dirs, files)
}

/// Waits up to 10 s for the kubelet to have registered the driver.
async fn wait_registered(registered: &mut watch::Receiver<Registered>, what: &str) {
    let waited = tokio::time::timeout(
        Duration::from_secs(10),
        registered.wait_for(|r| *r == Registered::Yes),
    )
    .await;
    assert!(matches!(waited, Ok(Ok(_))), "{what} within 10 s");
}

#[tokio::test]
async fn the_kubelet_registers_the_driver_and_prepares_claims_across_a_restart() {
    let (_root, kubelet, dirs, files) = node().await;
    let side = KubeletSide::start(preparer(&files), &dirs).unwrap();
    let mut registered = side.registered();
    wait_registered(&mut registered, "registered").await;
    let service = kubelet.read(|node| node.dra_driver(DRIVER).first().map(|r| r.service));
    assert_eq!(service, Some(DraService::V1));

    let claim = DraClaim::new("ns", "claim-1", "uid-1");
    let unknown = DraClaim::new("ns", "claim-9", "uid-9");
    let results = kubelet
        .dra_prepare(DRIVER, &[claim.clone(), unknown.clone()])
        .await
        .unwrap();
    let devices = results["uid-1"].as_ref().unwrap();
    assert_eq!(devices.len(), 2);
    assert_eq!(devices[0].device_name, "npu-1");
    assert_eq!(devices[0].pool_name, "node-a");
    assert_eq!(
        devices[0].cdi_device_ids,
        vec![format!("{DRIVER}/claim=uid-1-npus")]
    );
    let err = results["uid-9"].as_ref().unwrap_err();
    assert!(format!("{err:?}").contains("no claim uid-9"), "{err:?}");
    let spec_path = devplug_dra::prepare::spec_path(&files.cdi_dir, DRIVER, "uid-1");
    let spec: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&spec_path).unwrap()).unwrap();
    assert_eq!(spec["kind"], format!("{DRIVER}/claim"));
    assert_eq!(spec["devices"][0]["name"], "uid-1-npus");
    assert_eq!(
        spec["devices"][0]["containerEdits"]["env"][0],
        "NPU_VISIBLE_DEVICES=npu-1,npu-2"
    );

    // devplug restarts: the new instance registers again and knows the claim.
    assert!(side.stop().await.is_empty());
    let side = KubeletSide::start(preparer(&files), &dirs).unwrap();
    let mut registered = side.registered();
    wait_registered(&mut registered, "registered again").await;
    let again = kubelet
        .dra_prepare(DRIVER, std::slice::from_ref(&claim))
        .await
        .unwrap();
    assert_eq!(again["uid-1"].as_ref().unwrap(), devices);
    let gone = kubelet.dra_unprepare(DRIVER, &[claim]).await.unwrap();
    assert!(gone["uid-1"].is_ok());
    assert!(!spec_path.exists(), "the claim's CDI spec is removed");
    assert!(side.stop().await.is_empty());
    kubelet.stop().await;
}

#[tokio::test]
async fn a_deleted_registration_socket_comes_back_and_registers_again() {
    let (_root, kubelet, dirs, files) = node().await;
    let side = KubeletSide::start(preparer(&files), &dirs).unwrap();
    let mut registered = side.registered();
    wait_registered(&mut registered, "registered").await;

    // An operator or a script deletes the registration socket: it is created again at once and
    // the kubelet's plugin watcher registers the driver through the new one.
    let registration = side.registration_path().to_owned();
    std::fs::remove_file(&registration).unwrap();
    tokio::time::timeout(Duration::from_secs(10), registered.changed())
        .await
        .expect("the driver notices within 10 s")
        .unwrap();
    wait_registered(&mut registered, "registered again").await;
    assert!(registration.exists());
    let claim = DraClaim::new("ns", "claim-1", "uid-1");
    let results = kubelet.dra_prepare(DRIVER, &[claim]).await.unwrap();
    assert!(results["uid-1"].is_ok(), "{results:?}");
    assert!(side.stop().await.is_empty());
    assert!(
        !registration.exists(),
        "stop removes the registration socket"
    );
    kubelet.stop().await;
}

/// The endpoints the kubelet has registered for the driver.
fn endpoints(kubelet: &Kubelet) -> Vec<std::path::PathBuf> {
    kubelet.read(|node| {
        node.dra_driver(DRIVER)
            .iter()
            .map(|r| r.endpoint.clone())
            .collect()
    })
}

#[tokio::test]
async fn a_surge_rollout_hands_over_from_the_old_instance_to_the_new() {
    let (_root, kubelet, dirs, files) = node().await;
    let old = KubeletSide::start(preparer(&files), &dirs).unwrap();
    wait_registered(&mut old.registered(), "the old instance registered").await;
    let claim = DraClaim::new("ns", "claim-1", "uid-1");
    let first = kubelet
        .dra_prepare(DRIVER, std::slice::from_ref(&claim))
        .await
        .unwrap();
    let devices = first["uid-1"].as_ref().unwrap().clone();

    // The new pod starts while the old one serves (maxSurge 1): sockets of its own, both
    // registered, the kubelet calls the newer one.
    let new = KubeletSide::start(preparer(&files), &dirs).unwrap();
    wait_registered(&mut new.registered(), "the new instance registered").await;
    // The old one has the fixed names; the new one, finding them served, names of its own.
    assert_eq!(old.endpoint(), dirs.driver_dir(DRIVER).join("dra.sock"));
    assert_eq!(
        old.registration_path(),
        dirs.registry.join(format!("{DRIVER}-reg.sock"))
    );
    assert_ne!(old.endpoint(), new.endpoint());
    assert_ne!(old.registration_path(), new.registration_path());
    assert_eq!(
        endpoints(&kubelet),
        vec![old.endpoint().to_owned(), new.endpoint().to_owned()]
    );
    let again = kubelet
        .dra_prepare(DRIVER, std::slice::from_ref(&claim))
        .await
        .unwrap();
    assert_eq!(again["uid-1"].as_ref().unwrap(), &devices);

    // The old pod stops: only its own files go; the new instance stays registered and serves.
    let (old_endpoint, old_registration) = (
        old.endpoint().to_owned(),
        old.registration_path().to_owned(),
    );
    assert!(old.stop().await.is_empty());
    assert!(!old_endpoint.exists() && !old_registration.exists());
    assert!(new.endpoint().exists() && new.registration_path().exists());
    let new_endpoint = new.endpoint().to_owned();
    kubelet
        .wait_for(Duration::from_secs(10), |n| {
            let left: Vec<_> = n
                .dra_driver(DRIVER)
                .iter()
                .map(|r| r.endpoint.clone())
                .collect();
            (left == vec![new_endpoint.clone()]).then_some(())
        })
        .await
        .expect("the kubelet deregisters the old instance alone");
    let second = DraClaim::new("ns", "claim-2", "uid-2");
    let prepared = kubelet
        .dra_prepare(DRIVER, std::slice::from_ref(&second))
        .await
        .unwrap();
    assert!(prepared["uid-2"].is_ok(), "{prepared:?}");
    let gone = kubelet
        .dra_unprepare(DRIVER, &[claim, second])
        .await
        .unwrap();
    assert!(gone.values().all(Result::is_ok), "{gone:?}");
    for uid in ["uid-1", "uid-2"] {
        let spec = devplug_dra::prepare::spec_path(&files.cdi_dir, DRIVER, uid);
        assert!(!spec.exists(), "{uid}'s CDI spec is removed");
    }
    assert!(new.stop().await.is_empty());
    kubelet.stop().await;
}

#[tokio::test]
async fn two_instances_serving_at_once_keep_one_checkpoint_right() {
    let (_root, kubelet, dirs, files) = node().await;
    let old_preparer = preparer(&files);
    let old = KubeletSide::start(old_preparer.clone(), &dirs).unwrap();
    let new_preparer = preparer(&files);
    let new = KubeletSide::start(new_preparer.clone(), &dirs).unwrap();
    let claim = |uid: &str| ClaimRef {
        namespace: "ns".into(),
        name: format!("claim-{uid}"),
        uid: uid.into(),
    };
    let listed = || {
        devplug_dra::checkpoint::Checkpoint::load(&files.checkpoint, DRIVER)
            .unwrap()
            .claims
            .into_keys()
            .collect::<Vec<_>>()
    };

    // The new instance prepares a claim; a call the kubelet made to the old one before the new
    // one registered prepares another: the old instance reads the new one's write first, so
    // the file lists both (it would list the old instance's claims alone otherwise).
    assert!(new_preparer.prepare(&[claim("uid-1")]).await["uid-1"].is_ok());
    assert!(old_preparer.prepare(&[claim("uid-2")]).await["uid-2"].is_ok());
    assert_eq!(listed(), ["uid-1", "uid-2"]);

    // The new instance unprepares the claim the old one prepared: it knows it (it reads the
    // old one's write), so the claim's spec goes and the file lists the first claim alone.
    let spec = devplug_dra::prepare::spec_path(&files.cdi_dir, DRIVER, "uid-2");
    assert!(spec.exists());
    assert!(new_preparer.unprepare(&[claim("uid-2")]).await["uid-2"].is_ok());
    assert!(
        !spec.exists(),
        "the claim the old instance prepared is released"
    );
    assert_eq!(listed(), ["uid-1"]);
    assert_eq!(
        old_preparer
            .prepared()
            .await
            .into_keys()
            .collect::<Vec<_>>(),
        ["uid-1", "uid-2"],
        "the old instance reads the file again only for a change"
    );
    // A call to the old instance starts from the file: the unprepared claim is gone there too.
    assert!(old_preparer.unprepare(&[claim("uid-9")]).await["uid-9"].is_ok());
    assert_eq!(
        old_preparer
            .prepared()
            .await
            .into_keys()
            .collect::<Vec<_>>(),
        ["uid-1"]
    );

    assert!(old.stop().await.is_empty());
    assert!(new.stop().await.is_empty());
    kubelet.stop().await;
}

#[tokio::test]
async fn a_lost_cdi_folder_is_written_again_from_the_checkpoint() {
    let (_root, kubelet, dirs, files) = node().await;
    let side = KubeletSide::start(preparer(&files), &dirs).unwrap();
    let mut registered = side.registered();
    wait_registered(&mut registered, "registered").await;
    let claim = DraClaim::new("ns", "claim-1", "uid-1");
    let first = kubelet
        .dra_prepare(DRIVER, std::slice::from_ref(&claim))
        .await
        .unwrap();
    let spec_path = devplug_dra::prepare::spec_path(&files.cdi_dir, DRIVER, "uid-1");
    let spec = std::fs::read_to_string(&spec_path).unwrap();

    // /var/run/cdi is a tmpfs: a reboot (or a failed unprepare) loses the spec, and the kubelet
    // prepares the claim again. The answer is the checkpoint's, and the spec is there again.
    std::fs::remove_dir_all(&files.cdi_dir).unwrap();
    let started = std::time::Instant::now();
    let again = kubelet
        .dra_prepare(DRIVER, std::slice::from_ref(&claim))
        .await
        .unwrap();
    println!(
        "figure: CDI folder lost, the claim prepared again → its spec written back from the checkpoint in {:.2} ms (the whole call)",
        started.elapsed().as_secs_f64() * 1000.0
    );
    assert_eq!(
        again["uid-1"].as_ref().unwrap(),
        first["uid-1"].as_ref().unwrap()
    );
    assert_eq!(std::fs::read_to_string(&spec_path).unwrap(), spec);

    // A restart with the folder gone: written again at start, before any call.
    assert!(side.stop().await.is_empty());
    std::fs::remove_dir_all(&files.cdi_dir).unwrap();
    let started = std::time::Instant::now();
    let side = KubeletSide::start(preparer(&files), &dirs).unwrap();
    println!(
        "figure: restart with the CDI folder lost (a reboot) → specs written back before the driver serves: {:.2} ms",
        started.elapsed().as_secs_f64() * 1000.0
    );
    assert_eq!(std::fs::read_to_string(&spec_path).unwrap(), spec);
    assert!(side.stop().await.is_empty());
    kubelet.stop().await;
}

#[tokio::test]
async fn the_kubelet_hears_each_devices_health_on_the_health_stream() {
    use devplug_proto::dra_health_v1::HealthStatus;
    let (_root, kubelet, dirs, files) = node().await;
    let list = DeviceList::new((0..2).map(|i| Device::new(format!("npu-{i}"))));
    let (tx, _) = watch::channel(list);
    let preparer = Preparer::new(
        DRIVER,
        "node-a",
        Arc::new(Npus(tx.clone())),
        Arc::new(Fixed(HashMap::new())),
        files.clone(),
    )
    .unwrap();
    let side = KubeletSide::start(Arc::new(preparer), &dirs).unwrap();
    wait_registered(&mut side.registered(), "registered").await;

    let mut stream = kubelet.dra_watch_health(DRIVER).await.unwrap();
    // Both versions are listed; the simulator picks v1 as a 1.37 kubelet does.
    assert_eq!(stream.service(), kubelet_sim::HealthService::V1);
    let first = next_health(&mut stream).await;
    let seen: Vec<(String, String, HealthStatus)> = first
        .devices
        .iter()
        .map(|d| {
            let id = d.device.clone().unwrap();
            (id.pool_name, id.device_name, d.health())
        })
        .collect();
    assert_eq!(
        seen,
        [
            ("node-a".into(), "npu-0".into(), HealthStatus::Healthy),
            ("node-a".into(), "npu-1".into(), HealthStatus::Healthy),
        ],
        "every device at once"
    );
    // A device breaks: the next message says so, with the reason.
    tx.send_modify(|list| {
        list.set_health(
            "npu-1",
            devplug::Health::unhealthy("XID 79: fell off the bus"),
        );
    });
    let broken = next_health(&mut stream).await;
    let npu1 = &broken.devices[1];
    assert_eq!(npu1.health(), HealthStatus::Unhealthy);
    assert_eq!(npu1.message, "XID 79: fell off the bus");
    assert!(npu1.health_check_timeout_seconds > 0);
    // It recovers.
    tx.send_modify(|list| {
        list.set_health("npu-1", devplug::Health::Healthy);
    });
    let recovered = next_health(&mut stream).await;
    assert_eq!(recovered.devices[1].health(), HealthStatus::Healthy);

    // A 1.34-1.36 kubelet knows only v1alpha1: the same socket answers it with the same list.
    use devplug_proto::dra_health_v1alpha1 as alpha;
    let channel = devplug_proto::uds::connect(side.endpoint(), Duration::from_secs(5))
        .await
        .unwrap();
    let mut old = alpha::dra_resource_health_client::DraResourceHealthClient::new(channel)
        .node_watch_resources(alpha::NodeWatchResourcesRequest {})
        .await
        .unwrap()
        .into_inner();
    let said = tokio::time::timeout(Duration::from_secs(5), old.message())
        .await
        .expect("a v1alpha1 message within 5 s")
        .unwrap()
        .unwrap();
    let names: Vec<String> = said
        .devices
        .iter()
        .map(|d| d.device.clone().unwrap().device_name)
        .collect();
    assert_eq!(names, ["npu-0", "npu-1"]);
    assert!(side.stop().await.is_empty());
}

async fn next_health(
    stream: &mut kubelet_sim::HealthStream,
) -> devplug_proto::dra_health_v1::NodeWatchResourcesResponse {
    let next = tokio::time::timeout(Duration::from_secs(5), stream.message()).await;
    next.expect("a message within 5 s").unwrap().unwrap()
}
