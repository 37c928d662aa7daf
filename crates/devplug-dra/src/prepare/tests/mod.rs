//! The preparer as a whole: claims, backend, CDI specs and checkpoint together.

use super::*;
use crate::hold::Hold;
use crate::names::device_name;
use devplug::backend::BoxFuture;
use devplug::dra::ReleaseError;
use devplug::Backend;
use devplug::{AllocateError, ContainerEdits, Device, DeviceList, Health};
use std::collections::HashMap;
use std::path::Path;
use tokio::sync::watch;

mod checkpoint_writes;

struct Npus(watch::Sender<DeviceList>);

impl Backend for Npus {
    fn devices(&self) -> watch::Receiver<DeviceList> {
        self.0.subscribe()
    }
    fn allocate(&self, ids: &[String]) -> Result<ContainerEdits, AllocateError> {
        Ok(ContainerEdits::default().env("NPU_VISIBLE_DEVICES", ids.join(",")))
    }
}

impl ClaimBackend for Npus {
    fn prepare_share(
        &self,
        id: &str,
        consumed: &BTreeMap<String, u64>,
    ) -> Result<ContainerEdits, AllocateError> {
        let cores = consumed.get("cores").copied().unwrap_or(0);
        Ok(ContainerEdits::default()
            .env("NPU_VISIBLE_DEVICES", id)
            .env("NPU_CORES", cores.to_string()))
    }
    fn unprepare_shares(&self, id: &str) {
        self.0.send_modify(|list| {
            list.set_health(id, Health::unhealthy("released (test marker)"));
        });
    }
}

struct Fixed(HashMap<String, Vec<AllocatedDevice>>);

impl ClaimSource for Fixed {
    fn allocation<'a>(
        &'a self,
        claim: &'a ClaimRef,
    ) -> BoxFuture<'a, Result<Vec<AllocatedDevice>, String>> {
        let found = self.0.get(&claim.uid).cloned();
        Box::pin(async move { found.ok_or_else(|| "no such claim".to_owned()) })
    }
}

#[tokio::test]
async fn an_unhealthy_device_is_prepared_only_for_a_claim_that_tolerates_its_taint() {
    let dir = tempfile::tempdir().unwrap();
    let sick = Device::new("npu-0").with_health(Health::unhealthy("ECC"));
    let (tx, _) = watch::channel(DeviceList::new([sick]));
    let claims = Fixed(HashMap::from([
        ("plain".to_owned(), vec![allocated("a", "npu-0")]),
        (
            "tolerant".to_owned(),
            vec![AllocatedDevice {
                tolerates_unhealthy: true,
                pod_claim_name: None,
                ..allocated("a", "npu-0")
            }],
        ),
    ]));
    let preparer = Preparer::new(
        "npu.example.com",
        "node-a",
        Arc::new(Npus(tx)),
        Arc::new(claims),
        files_in(dir.path()),
    )
    .unwrap();
    let plain = preparer.prepare(&[claim("plain")]).await;
    let err = plain["plain"].as_ref().unwrap_err().to_string();
    assert!(err.contains("npu-0 is unhealthy: ECC"), "{err}");
    let tolerant = preparer.prepare(&[claim("tolerant")]).await;
    assert!(tolerant["tolerant"].is_ok(), "{tolerant:?}");
}

#[tokio::test]
async fn a_device_that_is_not_shareable_is_prepared_for_one_claim_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let (tx, _) = watch::channel(DeviceList::new([Device::new("npu-0")]));
    let shared = |share: &str| AllocatedDevice {
        hold: Hold::Share {
            share_id: share.into(),
        },
        consumed: BTreeMap::from([("cores".to_owned(), 40)]),
        ..allocated("a", "npu-0")
    };
    let admin = AllocatedDevice {
        hold: Hold::AdminAccess { share_id: None },
        ..allocated("a", "npu-0")
    };
    let claims = Fixed(HashMap::from([
        ("first".to_owned(), vec![allocated("a", "npu-0")]),
        ("second".to_owned(), vec![allocated("a", "npu-0")]),
        ("monitor".to_owned(), vec![admin]),
        ("share-1".to_owned(), vec![shared("s1")]),
        ("share-2".to_owned(), vec![shared("s2")]),
    ]));
    let files = files_in(dir.path());
    let preparer = Preparer::new(
        "npu.example.com",
        "node-a",
        Arc::new(Npus(tx.clone())),
        Arc::new(claims),
        files.clone(),
    )
    .unwrap();
    assert!(preparer.prepare(&[claim("first")]).await["first"].is_ok());
    let second = preparer.prepare(&[claim("second")]).await;
    let err = second["second"].as_ref().unwrap_err().to_string();
    assert!(
        err.contains("already prepared for ResourceClaim ns/claim-first"),
        "{err}"
    );
    // Admin access may look at a device in use; shares of one device go together.
    assert!(preparer.prepare(&[claim("monitor")]).await["monitor"].is_ok());
    assert!(preparer.unprepare(&[claim("first")]).await["first"].is_ok());
    let shares = preparer
        .prepare(&[claim("share-1"), claim("share-2")])
        .await;
    assert!(shares.values().all(Result::is_ok), "{shares:?}");
    let spec = std::fs::read_to_string(preparer.spec_path("share-1")).unwrap();
    assert!(spec.contains("NPU_CORES=40"), "the share's limit: {spec}");
    // A restart finds which devices have shares, for the backend to serve them again.
    let again = Preparer::new(
        "npu.example.com",
        "node-a",
        Arc::new(Npus(tx.clone())),
        Arc::new(Fixed(HashMap::new())),
        files.clone(),
    )
    .unwrap();
    assert_eq!(
        again.shared_devices().await,
        std::collections::BTreeSet::from(["npu-0".to_owned()])
    );
    // The backend hears of it when the last share of a device goes, not before.
    preparer.unprepare(&[claim("share-1")]).await;
    assert!(tx.borrow().get("npu-0").unwrap().health.is_healthy());
    preparer.unprepare(&[claim("share-2")]).await;
    assert!(!tx.borrow().get("npu-0").unwrap().health.is_healthy());
    tx.send_modify(|list| {
        list.set_health("npu-0", Health::Healthy);
    });
    // Once the shares are gone, the whole device can go to the second claim.
    assert!(preparer.prepare(&[claim("second")]).await["second"].is_ok());

    // The holder is gone from the API server (its pod force-deleted, the kubelet yet to
    // unprepare it): the scheduler gave its device away, and the new claim is prepared.
    drop(preparer);
    let later = Preparer::new(
        "npu.example.com",
        "node-a",
        Arc::new(Npus(tx)),
        Arc::new(Fixed(HashMap::from([(
            "third".to_owned(),
            vec![allocated("a", "npu-0")],
        )]))),
        files,
    )
    .unwrap();
    let third = later.prepare(&[claim("third")]).await;
    assert!(third["third"].is_ok(), "{third:?}");
}

/// An API server that never answers for claims whose UID starts with `hung`.
struct HungFor(Fixed);

impl ClaimSource for HungFor {
    fn allocation<'a>(
        &'a self,
        claim: &'a ClaimRef,
    ) -> BoxFuture<'a, Result<Vec<AllocatedDevice>, String>> {
        if claim.uid.starts_with("hung") {
            Box::pin(std::future::pending())
        } else {
            self.0.allocation(claim)
        }
    }
}

#[tokio::test]
async fn a_hung_api_server_slows_only_its_own_call_and_never_an_unprepare() {
    let dir = tempfile::tempdir().unwrap();
    let (tx, _) = watch::channel(DeviceList::new([
        Device::new("npu-0"),
        Device::new("npu-1"),
    ]));
    let claims = HungFor(Fixed(HashMap::from([
        ("u1".to_owned(), vec![allocated("a", "npu-0")]),
        ("u2".to_owned(), vec![allocated("a", "npu-1")]),
    ])));
    let files = files_in(dir.path());
    let deadline = Duration::from_millis(400);
    let preparer = Arc::new(
        Preparer::new(
            "npu.example.com",
            "node-a",
            Arc::new(Npus(tx)),
            Arc::new(claims),
            files,
        )
        .unwrap()
        .with_read_deadline(deadline),
    );
    assert!(preparer.prepare(&[claim("u1")]).await["u1"].is_ok());

    // Two hung claims and a good one in one call: one deadline for all, not one each, and
    // the good claim is prepared.
    let started = std::time::Instant::now();
    let results = preparer
        .prepare(&[claim("hung-1"), claim("hung-2"), claim("u2")])
        .await;
    let took = started.elapsed();
    assert!(took < deadline * 2, "{took:?}");
    for hung in ["hung-1", "hung-2"] {
        let err = results[hung].as_ref().unwrap_err().to_string();
        assert!(err.contains("took over 400ms"), "{err}");
    }
    assert!(results["u2"].is_ok(), "{results:?}");

    // While a call waits on the API server, an unprepare (which needs none) and a repeated
    // prepare (answered from the checkpoint) go through at once.
    let waiting = {
        let preparer = preparer.clone();
        tokio::spawn(async move { preparer.prepare(&[claim("hung-3")]).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let started = std::time::Instant::now();
    assert!(preparer.prepare(&[claim("u1")]).await["u1"].is_ok());
    assert!(preparer.unprepare(&[claim("u1")]).await["u1"].is_ok());
    let took = started.elapsed();
    assert!(took < Duration::from_millis(200), "{took:?}");
    assert!(!waiting.is_finished(), "the hung call still waits");
    assert!(waiting.await.unwrap()["hung-3"].is_err());
}

/// A backend that makes something per allocation (as MIG partitions are made) and says
/// what it was asked to release; it refuses `npu-1`, and releases only when let.
struct Made {
    list: watch::Sender<DeviceList>,
    released: std::sync::Mutex<Vec<String>>,
    refuse_release: std::sync::atomic::AtomicBool,
}

impl Backend for Made {
    fn devices(&self) -> watch::Receiver<DeviceList> {
        self.list.subscribe()
    }
    fn allocate(&self, ids: &[String]) -> Result<ContainerEdits, AllocateError> {
        if ids.iter().any(|id| id == "npu-1") {
            return Err(AllocateError::Failed("npu-1 cannot be made".into()));
        }
        Ok(ContainerEdits::default().env("NPU_VISIBLE_DEVICES", ids.join(",")))
    }
}

impl ClaimBackend for Made {
    fn unprepare_devices(&self, ids: &[String]) -> Result<(), ReleaseError> {
        if self
            .refuse_release
            .load(std::sync::atomic::Ordering::SeqCst)
        {
            return Err(ReleaseError("the device is busy".into()));
        }
        self.released.lock().unwrap().extend(ids.iter().cloned());
        Ok(())
    }
}

#[tokio::test]
async fn what_allocation_made_is_released_at_unprepare_and_when_prepare_fails() {
    let dir = tempfile::tempdir().unwrap();
    let list = DeviceList::new((0..3).map(|i| Device::new(format!("npu-{i}"))));
    let backend = Arc::new(Made {
        list: watch::channel(list).0,
        released: std::sync::Mutex::new(Vec::new()),
        refuse_release: std::sync::atomic::AtomicBool::new(false),
    });
    let claims = Fixed(HashMap::from([
        (
            "a".to_owned(),
            vec![allocated("first", "npu-0"), allocated("second", "npu-1")],
        ),
        ("b".to_owned(), vec![allocated("x", "npu-2")]),
    ]));
    let preparer = Preparer::new(
        "npu.example.com",
        "node-a",
        backend.clone(),
        Arc::new(claims),
        files_in(dir.path()),
    )
    .unwrap();
    // The second request fails: what the first one got is released again.
    let err = preparer.prepare(&[claim("a")]).await["a"]
        .clone()
        .unwrap_err()
        .to_string();
    assert!(err.contains("npu-1 cannot be made"), "{err}");
    assert_eq!(*backend.released.lock().unwrap(), ["npu-0"]);
    backend.released.lock().unwrap().clear();
    assert!(preparer.prepare(&[claim("b")]).await["b"].is_ok());
    // A release that fails keeps the claim prepared, for the kubelet to retry.
    backend
        .refuse_release
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let err = preparer.unprepare(&[claim("b")]).await["b"]
        .clone()
        .unwrap_err()
        .to_string();
    assert!(err.contains("the device is busy"), "{err}");
    assert_eq!(preparer.prepared().await.len(), 1);
    backend
        .refuse_release
        .store(false, std::sync::atomic::Ordering::SeqCst);
    assert!(preparer.unprepare(&[claim("b")]).await["b"].is_ok());
    assert!(preparer.prepared().await.is_empty());
    assert_eq!(*backend.released.lock().unwrap(), ["npu-2"]);
}

fn allocated(request: &str, device: &str) -> AllocatedDevice {
    AllocatedDevice {
        request: request.into(),
        pool: "node-a".into(),
        device: device.into(),
        hold: Hold::Exclusive,
        consumed: BTreeMap::new(),
        tolerates_unhealthy: false,
        pod_claim_name: None,
    }
}

fn files_in(dir: &Path) -> PrepareFiles {
    PrepareFiles {
        cdi_dir: dir.join("cdi"),
        checkpoint: dir.join("checkpoint.json"),
    }
}

fn claim(uid: &str) -> ClaimRef {
    ClaimRef {
        namespace: "ns".into(),
        name: format!("claim-{uid}"),
        uid: uid.into(),
    }
}

#[tokio::test]
async fn prepare_writes_a_spec_per_claim_and_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let list = DeviceList::new([
        Device::new("npu-0"),
        Device::new("NPU-1"),
        Device::new("npu-2").with_health(Health::unhealthy("hot")),
    ]);
    let (tx, _) = watch::channel(list);
    let backend: Arc<dyn ClaimBackend> = Arc::new(Npus(tx));
    let claims: Arc<dyn ClaimSource> = Arc::new(Fixed(HashMap::from([
        (
            "u1".to_owned(),
            vec![
                allocated("a", "npu-0"),
                allocated("a", &device_name("NPU-1")),
            ],
        ),
        ("u2".to_owned(), vec![allocated("a", "npu-2")]),
        ("u3".to_owned(), vec![allocated("a", "npu-9")]),
    ])));
    let files = files_in(dir.path());
    let preparer = Preparer::new(
        "npu.example.com",
        "node-a",
        backend.clone(),
        claims.clone(),
        files.clone(),
    )
    .unwrap();
    let results = preparer
        .prepare(&[claim("u1"), claim("u2"), claim("u3"), claim("u4")])
        .await;
    let devices = results["u1"].as_ref().unwrap();
    assert_eq!(devices.len(), 2);
    assert_eq!(
        devices[0].cdi_device_ids,
        vec!["npu.example.com/claim=u1-a".to_owned()]
    );
    assert!(
        devices[1].cdi_device_ids.is_empty(),
        "one CDI id per request"
    );
    assert_eq!(devices[1].id, "NPU-1");
    assert!(results["u2"]
        .as_ref()
        .unwrap_err()
        .to_string()
        .contains("unhealthy: hot"));
    assert!(results["u3"]
        .as_ref()
        .unwrap_err()
        .to_string()
        .contains("npu-9 is not one"));
    assert!(results["u4"]
        .as_ref()
        .unwrap_err()
        .to_string()
        .contains("no such claim"));
    let spec_file = spec_path(&files.cdi_dir, "npu.example.com", "u1");
    let spec = std::fs::read_to_string(&spec_file).unwrap();
    assert!(spec.contains("NPU_VISIBLE_DEVICES=npu-0,NPU-1"), "{spec}");

    // The spec on disk is the checkpoint's text: a start leaves it alone.
    let checkpoint = Checkpoint::load(&files.checkpoint, "npu.example.com").unwrap();
    let u1 = &checkpoint.claims["u1"];
    assert!(!restore_spec("npu.example.com", "u1", u1).unwrap());
    // Specs are written without an fsync: one a power loss cut short is written again from
    // the checkpoint at the next start.
    std::fs::write(&spec_file, "").unwrap();

    // A new process answers the repeat from the checkpoint, and can unprepare.
    drop(preparer);
    let again = Preparer::new("npu.example.com", "node-a", backend, claims, files).unwrap();
    assert_eq!(std::fs::read_to_string(&spec_file).unwrap(), spec);
    let results = again.prepare(&[claim("u1")]).await;
    assert_eq!(results["u1"].as_ref().unwrap(), devices);
    let results = again.unprepare(&[claim("u1"), claim("u9")]).await;
    assert!(results.values().all(Result::is_ok));
    assert!(!spec_file.exists());
    assert!(again.prepared().await.is_empty());
}

#[test]
fn stale_claim_specs_go_at_start_and_nothing_else_does() {
    let dir = tempfile::tempdir().unwrap();
    let cdi = dir.path().join("cdi");
    std::fs::create_dir_all(&cdi).unwrap();
    let driver = "npu.example.com";
    let spec = |kind: &str| format!(r#"{{"cdiVersion":"0.5.0","kind":"{kind}","devices":[]}}"#);
    let kept = spec_path(&cdi, driver, "prepared");
    let stale = spec_path(&cdi, driver, "gone");
    let other_kind = spec_path(&cdi, driver, "other-kind");
    let other_driver = spec_path(&cdi, "npu.example.com-x", "u");
    let not_ours = cdi.join("nvidia.com_gpu.json");
    std::fs::write(&kept, spec("npu.example.com/claim")).unwrap();
    std::fs::write(&stale, spec("npu.example.com/claim")).unwrap();
    std::fs::write(&other_kind, spec("example.com/else")).unwrap();
    std::fs::write(&other_driver, spec("npu.example.com-x/claim")).unwrap();
    std::fs::write(&not_ours, spec("npu.example.com/claim")).unwrap();
    let mut checkpoint = Checkpoint::new(driver);
    checkpoint.claims.insert(
        "prepared".into(),
        PreparedClaim {
            namespace: "ns".into(),
            name: "c".into(),
            devices: Vec::new(),
            cdi_spec: kept.clone(),
            cdi_spec_json: None,
        },
    );
    assert_eq!(remove_stale_specs(&cdi, driver, &checkpoint), 1);
    assert!(!stale.exists());
    for left in [&kept, &other_kind, &other_driver, &not_ours] {
        assert!(left.exists(), "{}", left.display());
    }
    assert_eq!(
        remove_stale_specs(&dir.path().join("none"), driver, &checkpoint),
        0
    );
}

/// The checkpoint the previous release wrote (format version 1: three claims on node-a: two
/// whole NPUs for two requests, a share of npu-2, admin access to npu-1), its CDI folder given.
fn previous_release_checkpoint(cdi_dir: &Path) -> String {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/checkpoint-v1.json"
    );
    std::fs::read_to_string(path)
        .unwrap()
        .replace("@CDI_DIR@", cdi_dir.to_str().unwrap())
}

#[tokio::test]
async fn an_upgraded_driver_restores_every_claim_the_previous_release_checkpointed() {
    let dir = tempfile::tempdir().unwrap();
    let files = files_in(dir.path());
    let old = previous_release_checkpoint(&files.cdi_dir);
    assert!(old.contains("\"version\": 1"), "the fixture is format 1");
    std::fs::write(&files.checkpoint, &old).unwrap();
    // What the previous release wrote in each claim's CDI spec, to compare with what is
    // written again: the CDI folder is a tmpfs, so after the reboot of an upgrade it is empty.
    let v1: serde_json::Value = serde_json::from_str(&old).unwrap();
    let old_specs: BTreeMap<String, String> = v1["claims"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(uid, c)| (uid.clone(), c["cdi_spec_json"].as_str().unwrap().to_owned()))
        .collect();
    assert_eq!(old_specs.len(), 3);

    let list = DeviceList::new([
        Device::new("npu-0"),
        Device::new("npu-1"),
        Device::new("npu-2"),
    ]);
    let (tx, _) = watch::channel(list);
    let backend: Arc<dyn ClaimBackend> = Arc::new(Npus(tx));
    // The API server knows none of them: every answer must come from the checkpoint.
    let claims: Arc<dyn ClaimSource> = Arc::new(Fixed(HashMap::new()));
    let preparer =
        Preparer::new("npu.example.com", "node-a", backend, claims, files.clone()).unwrap();
    let prepared = preparer.prepared().await;
    assert_eq!(prepared.keys().collect::<Vec<_>>(), ["u1", "u2", "u3"]);
    let holds: Vec<&Hold> = prepared
        .values()
        .flat_map(|c| c.devices.iter().map(|d| &d.hold))
        .collect();
    assert_eq!(
        holds,
        [
            &Hold::Exclusive,
            &Hold::Exclusive,
            &Hold::Share {
                share_id: "s-1".into()
            },
            &Hold::AdminAccess { share_id: None },
        ]
    );

    // The kubelet repeats its calls after the upgrade: each is answered as before, and each
    // claim's CDI spec is there again, as the previous release wrote it.
    let uids = [claim("u1"), claim("u2"), claim("u3")];
    let results = preparer.prepare(&uids).await;
    for (uid, result) in &results {
        let devices = result.as_ref().unwrap();
        assert_eq!(devices, &prepared[uid].devices, "{uid}");
        let spec = std::fs::read_to_string(spec_path(&files.cdi_dir, "npu.example.com", uid));
        assert_eq!(spec.unwrap(), old_specs[uid], "{uid}'s CDI spec");
    }
    assert_eq!(
        results["u1"].as_ref().unwrap()[0].cdi_device_ids,
        ["npu.example.com/claim=u1-a"]
    );

    // Its next write is the current format, compact, which it reads back the same.
    let results = preparer.unprepare(&[claim("u3")]).await;
    assert!(results.values().all(Result::is_ok));
    let new = std::fs::read_to_string(&files.checkpoint).unwrap();
    assert!(
        new.starts_with(&format!("{{\"version\":{}", crate::checkpoint::VERSION)),
        "{new}"
    );
    let reread = crate::checkpoint::Checkpoint::load(&files.checkpoint, "npu.example.com").unwrap();
    assert_eq!(reread.claims.keys().collect::<Vec<_>>(), ["u1", "u2"]);
    assert_eq!(reread.claims["u1"], prepared["u1"]);
    assert_eq!(reread.claims["u2"], prepared["u2"]);

    // And every claim it restored can be unprepared.
    let results = preparer.unprepare(&[claim("u1"), claim("u2")]).await;
    assert!(results.values().all(Result::is_ok));
    assert!(preparer.prepared().await.is_empty());
    for uid in ["u1", "u2", "u3"] {
        assert!(!spec_path(&files.cdi_dir, "npu.example.com", uid).exists());
    }
}

#[tokio::test]
async fn device_metadata_is_written_mounted_and_removed_with_the_claim() {
    let dir = tempfile::tempdir().unwrap();
    let list = DeviceList::new([Device::new("npu-0").with_numa_nodes([1])]);
    let (tx, _) = watch::channel(list);
    let from_template = AllocatedDevice {
        pod_claim_name: Some("npu".into()),
        ..allocated("npus/small", "npu-0")
    };
    let claims = Fixed(HashMap::from([("a".to_owned(), vec![from_template])]));
    let files = files_in(dir.path());
    let root = files.device_metadata_dir();
    // A folder left by a claim unprepared while devplug was down goes at start.
    std::fs::create_dir_all(root.join("stale/npus")).unwrap();
    let preparer = npu_preparer(tx, claims, &files).with_device_metadata(true);
    assert!(!root.join("stale").exists());
    assert!(preparer.prepare(&[claim("a")]).await["a"].is_ok());
    let host = root.join("a/npus/metadata.json");
    let text = std::fs::read_to_string(&host).unwrap();
    let first: serde_json::Value = serde_json::Deserializer::from_str(&text)
        .into_iter()
        .next()
        .unwrap()
        .unwrap();
    assert_eq!(first["podClaimName"], "npu");
    assert_eq!(first["requests"][0]["name"], "npus/small");
    assert_eq!(first["requests"][0]["devices"][0]["name"], "npu-0");
    let spec: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(spec_path(&files.cdi_dir, "npu.example.com", "a")).unwrap(),
    )
    .unwrap();
    let mount = &spec["devices"][0]["containerEdits"]["mounts"][0];
    assert_eq!(mount["hostPath"], host.display().to_string());
    assert_eq!(
        mount["containerPath"],
        "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/npu/npus/npu.example.com-metadata.json"
    );
    assert!(mount["options"]
        .as_array()
        .unwrap()
        .contains(&serde_json::json!("ro")));
    assert!(preparer.unprepare(&[claim("a")]).await["a"].is_ok());
    assert!(!root.join("a").exists(), "removed at unprepare");
}

#[tokio::test]
async fn without_device_metadata_no_file_and_no_mount() {
    let dir = tempfile::tempdir().unwrap();
    let (tx, _) = watch::channel(DeviceList::new([Device::new("npu-0")]));
    let claims = Fixed(HashMap::from([(
        "a".to_owned(),
        vec![allocated("npus", "npu-0")],
    )]));
    let files = files_in(dir.path());
    let preparer = npu_preparer(tx, claims, &files);
    assert!(preparer.prepare(&[claim("a")]).await["a"].is_ok());
    assert!(!files.device_metadata_dir().exists());
    let spec = std::fs::read_to_string(spec_path(&files.cdi_dir, "npu.example.com", "a")).unwrap();
    assert!(!spec.contains("mounts"), "{spec}");
}

/// A preparer of npu.example.com on node-a over the NPUs `tx` lists and `claims`.
fn npu_preparer(tx: watch::Sender<DeviceList>, claims: Fixed, files: &PrepareFiles) -> Preparer {
    Preparer::new(
        "npu.example.com",
        "node-a",
        Arc::new(Npus(tx)),
        Arc::new(claims),
        files.clone(),
    )
    .unwrap()
}
