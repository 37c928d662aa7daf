//! Claims that cannot all be prepared, against the real API server (1.36): 500 claims in one
//! call, the same claim prepared by two calls at once, and in one call beside good claims a
//! claim of another node's pool, one with only another driver's devices, one that does not
//! exist and one deleted and made again (another UID). Each bad claim gets its own error, the
//! good ones are prepared, nothing prepared is lost; a CDI folder that cannot be written fails
//! only the new claim; a corrupt checkpoint stops the driver with the file's name. The
//! allocations are written into the claims' status as the scheduler writes them (no scheduler
//! needed to say what it allocated). Skips loudly without `KUBEBUILDER_ASSETS`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use devplug_testkit::dra_node as common;

use devplug::{AllocateError, Backend, ContainerEdits, Device, DeviceList};
use devplug_dra::claims::{ClaimRef, KubeClaims};
use devplug_dra::prepare::{PrepareFiles, Preparer};
use devplug_dra::ClaimBackend;
use devplug_testkit::api_server::{self, ApiServer};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::Api;
use serde_json::json;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::watch;

const DRIVER: &str = "npu.example.com";
const NODE: &str = "faults-node";
const NS: &str = "dra-claim-faults";
const CLAIMS: usize = 500;

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

/// Creates claim `name` allocated `(driver, pool, device)`, as the scheduler would write it;
/// its reference.
async fn allocated(
    claims: &Api<ResourceClaim>,
    name: &str,
    driver: &str,
    pool: &str,
    device: &str,
) -> ClaimRef {
    let created = claims
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": { "name": name },
                "spec": { "devices": { "requests": [{
                    "name": "npu",
                    "exactly": { "deviceClassName": "npu" },
                }] } },
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let status = json!({ "status": { "allocation": { "devices": { "results": [{
        "request": "npu", "driver": driver, "pool": pool, "device": device,
    }] } } } });
    claims
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
    ClaimRef {
        namespace: NS.into(),
        name: name.into(),
        uid: created.metadata.uid.unwrap(),
    }
}

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_bad_claim_gets_its_own_error_and_nothing_prepared_is_lost() {
    let Some(server) =
        ApiServer::shared("each_bad_claim_gets_its_own_error_and_nothing_prepared_is_lost")
    else {
        return;
    };
    let client = api_server::client(&server.kubeconfig).await.unwrap();
    common::namespace(&client, NS).await;
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), NS);
    let root = tempfile::tempdir().unwrap();
    let files = PrepareFiles {
        cdi_dir: root.path().join("cdi"),
        checkpoint: root.path().join("driver/checkpoint.json"),
    };
    let (devices, _) = watch::channel(DeviceList::new(
        (0..CLAIMS + 4).map(|i| Device::new(format!("npu-{i}"))),
    ));
    let backend: Arc<dyn ClaimBackend> = Arc::new(Npus(devices));
    let preparer = Arc::new(
        Preparer::new(
            DRIVER,
            NODE,
            backend.clone(),
            Arc::new(KubeClaims::new(client.clone(), DRIVER)),
            files.clone(),
        )
        .unwrap(),
    );

    // 500 claims, one device each, prepared in one call.
    let started = Instant::now();
    let mut good = Vec::new();
    for i in 0..CLAIMS {
        good.push(allocated(&claims, &format!("c{i}"), DRIVER, NODE, &format!("npu-{i}")).await);
    }
    eprintln!(
        "{CLAIMS} claims made and allocated in {:?}",
        started.elapsed()
    );
    let started = Instant::now();
    let results = preparer.prepare(&good).await;
    let took = started.elapsed();
    eprintln!("NodePrepareResources of {CLAIMS} claims in one call: {took:?}");
    assert_eq!(results.len(), CLAIMS);
    assert!(
        results.values().all(Result::is_ok),
        "{:?}",
        results.values().find(|r| r.is_err())
    );
    let specs = std::fs::read_dir(&files.cdi_dir).unwrap().count();
    assert_eq!(specs, CLAIMS, "one CDI spec a claim");

    // The same new claim prepared by two calls at once: one spec, the same answer.
    let twice = allocated(&claims, "twice", DRIVER, NODE, &format!("npu-{CLAIMS}")).await;
    let (a, b) = tokio::join!(
        preparer.prepare(std::slice::from_ref(&twice)),
        preparer.prepare(std::slice::from_ref(&twice))
    );
    assert_eq!(
        a[&twice.uid].as_ref().unwrap(),
        b[&twice.uid].as_ref().unwrap()
    );
    assert_eq!(
        std::fs::read_dir(&files.cdi_dir).unwrap().count(),
        CLAIMS + 1
    );

    // Bad claims beside a good one, in one call: each its own error.
    let next = CLAIMS + 1;
    let fine = allocated(&claims, "fine", DRIVER, NODE, &format!("npu-{next}")).await;
    let elsewhere = allocated(&claims, "elsewhere", DRIVER, "other-node", "npu-0").await;
    let foreign = allocated(&claims, "foreign", "gpu.example.com", NODE, "gpu-0").await;
    let missing = ClaimRef {
        namespace: NS.into(),
        name: "missing".into(),
        uid: "7b7c1a9e-0000-4000-8000-000000000001".into(),
    };
    let remade = allocated(
        &claims,
        "remade",
        DRIVER,
        NODE,
        &format!("npu-{}", next + 1),
    )
    .await;
    claims
        .delete("remade", &DeleteParams::default())
        .await
        .unwrap();
    allocated(
        &claims,
        "remade",
        DRIVER,
        NODE,
        &format!("npu-{}", next + 1),
    )
    .await;
    let results = preparer
        .prepare(&[
            fine.clone(),
            elsewhere.clone(),
            foreign.clone(),
            missing.clone(),
            remade.clone(),
        ])
        .await;
    assert!(results[&fine.uid].is_ok(), "{results:?}");
    let error = |c: &ClaimRef| results[&c.uid].as_ref().unwrap_err().to_string();
    assert!(
        error(&elsewhere).contains("is in pool \"other-node\", not this node's pool"),
        "{}",
        error(&elsewhere)
    );
    assert!(
        error(&foreign).contains("has no device of driver npu.example.com"),
        "{}",
        error(&foreign)
    );
    assert!(error(&missing).contains("missing"), "{}", error(&missing));
    assert!(
        error(&remade).contains("deleted and created again"),
        "{}",
        error(&remade)
    );

    // The CDI folder cannot be written (a file stands where it should be): the new claim fails
    // with the reason, the prepared ones stay prepared.
    std::fs::rename(&files.cdi_dir, root.path().join("cdi-moved")).unwrap();
    std::fs::write(&files.cdi_dir, "not a folder").unwrap();
    let blocked = allocated(
        &claims,
        "blocked",
        DRIVER,
        NODE,
        &format!("npu-{}", next + 2),
    )
    .await;
    let results = preparer.prepare(std::slice::from_ref(&blocked)).await;
    let err = results[&blocked.uid].as_ref().unwrap_err().to_string();
    assert!(err.contains("cannot write the CDI spec"), "{err}");
    assert_eq!(
        preparer.prepared().await.len(),
        CLAIMS + 2,
        "nothing prepared is lost"
    );
    std::fs::remove_file(&files.cdi_dir).unwrap();
    std::fs::rename(root.path().join("cdi-moved"), &files.cdi_dir).unwrap();

    // All unprepared in one call.
    let started = Instant::now();
    let mut all = good.clone();
    all.extend([twice.clone(), fine.clone()]);
    let gone = preparer.unprepare(&all).await;
    eprintln!(
        "NodeUnprepareResources of {} claims in one call: {:?}",
        all.len(),
        started.elapsed()
    );
    assert!(gone.values().all(Result::is_ok));
    assert!(preparer.prepared().await.is_empty());
    assert_eq!(std::fs::read_dir(&files.cdi_dir).unwrap().count(), 0);

    // A corrupt checkpoint stops a driver from starting, naming the file.
    drop(preparer);
    std::fs::write(&files.checkpoint, "{ not json").unwrap();
    let err = Preparer::new(
        DRIVER,
        NODE,
        backend,
        Arc::new(KubeClaims::new(client.clone(), DRIVER)),
        files.clone(),
    )
    .err()
    .expect("a corrupt checkpoint is refused");
    assert!(err.to_string().contains("checkpoint.json"), "{err}");
}
