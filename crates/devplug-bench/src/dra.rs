//! DRA figures: how long a device change takes to reach the API server as an updated
//! ResourceSlice, and `NodePrepareResources` / `NodeUnprepareResources` as the kubelet
//! simulator calls them (one claim a call: the claim read from the API server, the backend's
//! edits, the CDI spec and the checkpoint written and synced). Needs the test control plane
//! (`KUBEBUILDER_ASSETS`: docs/testing.md, "Tests against a real API server"): `devplug-bench dra`.

use crate::{print_row, WAIT};
use anyhow::Context;
use devplug::dra::AttributeValue;
use devplug::{AllocateError, Backend, ContainerEdits, Device, DeviceList, Health};
use devplug_dra::kubelet::{KubeletDirs, Registered};
use devplug_dra::{ClaimBackend, DraDriver, DraDriverSettings};
use devplug_testkit::api_server::{self, ApiServer};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Patch, PatchParams, PostParams};
use kube::Api;
use kubelet_sim::{DraClaim, Kubelet, SimConfig};
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

const DRIVER: &str = "bench.example.com";
const NODE: &str = "bench-dra-node";
const DEVICES: usize = 64;

struct Devices(watch::Sender<DeviceList>);

impl Backend for Devices {
    fn devices(&self) -> watch::Receiver<DeviceList> {
        self.0.subscribe()
    }
    fn allocate(&self, ids: &[String]) -> Result<ContainerEdits, AllocateError> {
        Ok(ContainerEdits::default().env("BENCH_VISIBLE_DEVICES", ids.join(",")))
    }
}

impl ClaimBackend for Devices {}

/// Prints the DRA rows of the table.
pub async fn figures(changes: usize, claims: usize) -> anyhow::Result<()> {
    let server = ApiServer::shared("devplug-bench dra").context(
        "devplug-bench dra needs KUBEBUILDER_ASSETS (docs/testing.md, \"Tests against a real API server\")",
    )?;
    let client = api_server::client(&server.kubeconfig)
        .await
        .map_err(anyhow::Error::msg)?;
    let nodes: Api<Node> = Api::all(client.clone());
    let node: Node = serde_json::from_value(json!({ "metadata": { "name": NODE } }))?;
    nodes.create(&PostParams::default(), &node).await?;

    let root = tempfile::tempdir()?;
    let device_plugins = root.path().join("device-plugins");
    std::fs::create_dir_all(&device_plugins)?;
    let config = SimConfig {
        watcher_reconcile: Duration::from_millis(50),
        ..SimConfig::default()
    }
    .with_watcher_beside(&device_plugins);
    let kubelet = Kubelet::start_with(&device_plugins, config).await?;
    let list = DeviceList::new((0..DEVICES).map(|i| {
        Device::new(format!("dev-{i}"))
            .with_numa_nodes([(i % 2) as i64])
            .with_attribute("model", AttributeValue::String("bench".into()))
    }));
    let (devices, _) = watch::channel(list);
    let backend: Arc<dyn ClaimBackend> = Arc::new(Devices(devices.clone()));
    let settings = DraDriverSettings {
        driver: DRIVER.into(),
        node: NODE.into(),
        dirs: KubeletDirs::beside(&device_plugins),
        cdi_dir: root.path().join("cdi"),
        no_execute_after: None,
        device_metadata: false,
    };
    let driver = DraDriver::start(settings, backend, client.clone()).await?;
    let mut registered = driver.registered();
    tokio::time::timeout(WAIT, registered.wait_for(|r| *r == Registered::Yes))
        .await
        .context("the simulator did not register the driver")??;
    let first = devices.borrow().clone();
    tokio::time::timeout(WAIT, driver.slices().wait_published(&first))
        .await
        .context("the first slice was not published")?;

    // A device turns unhealthy (or healthy again): the time until the API server holds the
    // slice without (or with) it.
    let mut samples = Vec::with_capacity(changes);
    for i in 0..changes {
        let health = if i % 2 == 0 {
            Health::unhealthy("bench")
        } else {
            Health::Healthy
        };
        let started = Instant::now();
        devices.send_modify(|list| {
            list.set_health("dev-0", health);
        });
        let now = devices.borrow().clone();
        tokio::time::timeout(WAIT, driver.slices().wait_published(&now))
            .await
            .context("a change was not published")?;
        samples.push(started.elapsed());
    }
    print_row(
        &format!("DRA: device health change → ResourceSlice updated at the API server ({DEVICES} devices)"),
        &mut samples,
    );

    // Claims allocated as the scheduler would (status written here), then prepared and
    // unprepared by the kubelet simulator, one claim a call.
    let client_for_breakdown = client.clone();
    let api: Api<ResourceClaim> = Api::namespaced(client, "default");
    let mut refs = Vec::with_capacity(claims);
    for i in 0..claims {
        let name = format!("bench-claim-{i}");
        let claim: ResourceClaim = serde_json::from_value(json!({
            "metadata": { "name": name },
            "spec": { "devices": { "requests": [{ "name": "devs", "exactly": {
                "deviceClassName": "bench", "allocationMode": "ExactCount", "count": 2 } }] } },
        }))?;
        let created = api.create(&PostParams::default(), &claim).await?;
        let uid = created.metadata.uid.clone().unwrap_or_default();
        let a = (2 * i) % DEVICES;
        let status = json!({ "status": { "allocation": { "devices": { "results": [
            { "request": "devs", "driver": DRIVER, "pool": NODE, "device": format!("dev-{a}") },
            { "request": "devs", "driver": DRIVER, "pool": NODE, "device": format!("dev-{}", a + 1) },
        ] } } } });
        api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
            .await?;
        refs.push(DraClaim::new("default", &name, &uid));
    }
    // In rounds of as many claims as the devices hold (each claim takes 2): the claims of a
    // round prepared, prepared again, then unprepared, so no device is held by two claims.
    let mut prepare = Vec::with_capacity(claims);
    let mut repeat = Vec::with_capacity(claims);
    let mut unprepare = Vec::with_capacity(claims);
    let mut parts: Option<Breakdown> = None;
    for round in refs.chunks(DEVICES / 2) {
        for claim in round {
            let started = Instant::now();
            let answer = kubelet
                .dra_prepare(DRIVER, std::slice::from_ref(claim))
                .await?;
            prepare.push(started.elapsed());
            if let Some(Err(err)) = answer.values().next() {
                anyhow::bail!("prepare failed: {err:?}");
            }
        }
        let part = breakdown(&client_for_breakdown, root.path(), round, &driver).await?;
        match &mut parts {
            Some(parts) => parts.extend(part),
            None => parts = Some(part),
        }
        for claim in round {
            let started = Instant::now();
            kubelet
                .dra_prepare(DRIVER, std::slice::from_ref(claim))
                .await?;
            repeat.push(started.elapsed());
        }
        for claim in round {
            let started = Instant::now();
            kubelet
                .dra_unprepare(DRIVER, std::slice::from_ref(claim))
                .await?;
            unprepare.push(started.elapsed());
        }
    }
    if let Some(mut parts) = parts {
        parts.print();
    }
    print_row(
        "DRA: NodePrepareResources, 1 claim of 2 devices (API read + CDI spec + checkpoint, synced)",
        &mut prepare,
    );
    print_row(
        "DRA: NodePrepareResources repeated (answered from the checkpoint)",
        &mut repeat,
    );
    print_row(
        "DRA: NodeUnprepareResources, 1 claim (spec removed, checkpoint synced)",
        &mut unprepare,
    );
    let problems = driver.shutdown().await;
    anyhow::ensure!(problems.is_empty(), "shutdown: {problems:?}");
    kubelet.stop().await;
    Ok(())
}

/// Where `NodePrepareResources` spends its time: each piece of the prepare path timed on its
/// own, for the same claims, right after they were prepared. The claim read is the driver's
/// own GET ([`KubeClaims`]); the CDI spec (temp file, rename) and the checkpoint (temp file,
/// fsync, rename) are written as the preparer writes them, the checkpoint with as many claims as it held when
/// each claim was prepared; the backend is this bench's (an env var of the device ids).
async fn breakdown(
    client: &kube::Client,
    root: &std::path::Path,
    refs: &[DraClaim],
    driver: &DraDriver,
) -> anyhow::Result<Breakdown> {
    use devplug_dra::checkpoint::Checkpoint;
    use devplug_dra::claims::{ClaimRef, ClaimSource, KubeClaims};
    let source = KubeClaims::new(client.clone(), DRIVER);
    let mut read = Vec::with_capacity(refs.len());
    for claim in refs {
        let claim = ClaimRef {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            uid: claim.uid.clone(),
        };
        let started = Instant::now();
        source
            .allocation(&claim)
            .await
            .map_err(anyhow::Error::msg)?;
        read.push(started.elapsed());
    }
    let prepared = driver.prepared().await;
    let spec_dir = root.join("breakdown-cdi");
    let mut spec = Vec::with_capacity(prepared.len());
    let mut checkpoint = Checkpoint::new(DRIVER);
    let mut save = Vec::with_capacity(prepared.len());
    let path = root.join("breakdown-checkpoint").join("checkpoint.json");
    for (uid, claim) in &prepared {
        let json = claim.cdi_spec_json.clone().unwrap_or_default();
        let started = Instant::now();
        devplug::cdi::write_atomic_unsynced(
            &spec_dir.join(format!("{uid}.json")),
            json.as_bytes(),
        )?;
        spec.push(started.elapsed());
        checkpoint.claims.insert(uid.clone(), claim.clone());
        let started = Instant::now();
        checkpoint.save(&path)?;
        save.push(started.elapsed());
    }
    let backend = Devices(watch::channel(DeviceList::default()).0);
    let mut edits = Vec::with_capacity(refs.len());
    for i in 0..refs.len() {
        let ids = [
            format!("dev-{}", (2 * i) % DEVICES),
            format!("dev-{}", (2 * i + 1) % DEVICES),
        ];
        let started = Instant::now();
        backend.allocate(&ids)?;
        edits.push(started.elapsed());
    }
    Ok(Breakdown {
        read,
        spec,
        save,
        edits,
    })
}

/// The parts of the prepare path, timed apart.
struct Breakdown {
    read: Vec<Duration>,
    spec: Vec<Duration>,
    save: Vec<Duration>,
    edits: Vec<Duration>,
}

impl Breakdown {
    fn extend(&mut self, other: Breakdown) {
        self.read.extend(other.read);
        self.spec.extend(other.spec);
        self.save.extend(other.save);
        self.edits.extend(other.edits);
    }

    fn print(&mut self) {
        print_row(
            "DRA prepare, its parts: the claim read (GET from the API server)",
            &mut self.read,
        );
        print_row(
            "DRA prepare, its parts: the CDI spec written (temp file, rename; no fsync: the checkpoint holds it)",
            &mut self.spec,
        );
        print_row(
            "DRA prepare, its parts: the checkpoint written (1 to 32 claims; temp file, fsync, rename)",
            &mut self.save,
        );
        print_row(
            "DRA prepare, its parts: the backend's edits",
            &mut self.edits,
        );
    }
}
