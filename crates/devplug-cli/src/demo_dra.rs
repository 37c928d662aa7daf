//! `devplug demo --dra`: the DRA path in a person's terms, on this machine, without root. A real
//! etcd, kube-apiserver and kube-scheduler (from `KUBEBUILDER_ASSETS`, else
//! `target/k8s-assets`), a Node, the kubelet simulator with its plugin watcher, and devplug's DRA
//! driver over 4 virtual NPUs on 2 NUMA nodes; then a DeviceClass, a ResourceClaim with a CEL
//! selector, a Pod, the scheduler's allocation, NodePrepareResources and the CDI spec it writes,
//! the pod's deletion and NodeUnprepareResources; then one GPU shared by capacity between pods
//! (`demo_dra_sharing.rs`). Everything lives in one temp folder, removed
//! at the end or on Ctrl-C, and the control plane is stopped either way.

use crate::demo::{detail, ms, step};
use crate::output::line;
use anyhow::Context;
use devplug::dra::AttributeValue;
use devplug::{AllocateError, Backend, ContainerEdits, Device, DeviceList};
use devplug_dra::kubelet::{KubeletDirs, Registered};
use devplug_dra::{DraDriver, DraDriverSettings};
use devplug_testkit::api_server::{self, ControlPlane};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::Api;
use kubelet_sim::{DraClaim, Kubelet, SimConfig};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// The DRA driver's name (a DNS subdomain, as the API server requires).
const DRIVER: &str = "npu.example.com";
/// The Node, and so the pool of the driver's ResourceSlices.
const NODE: &str = "demo-node";
/// Where the claim and the pod live.
const NAMESPACE: &str = "default";
const CLASS: &str = "npu";
const CLAIM: &str = "two-npus";
/// The claim's one request.
const REQUEST: &str = "npus";
const POD: &str = "trainer";
/// The claim's selector: NUMA node 1 only.
const SELECTOR: &str = "device.attributes[\"npu.example.com\"].numa == 1";
/// The environment variable the backend sets to the allocated ids.
const ENV: &str = "NPU_VISIBLE_DEVICES";
/// How long one step may take (the scheduler's first pass dominates).
const WAIT: Duration = Duration::from_secs(60);

/// Runs the demo, printing each step. Missing binaries are an error that says how to get them;
/// a shutdown signal (Ctrl-C) stops it early. The control plane is stopped and the temp folder
/// removed either way.
pub async fn demo() -> anyhow::Result<()> {
    let assets = find_assets()?;
    let dir = tempfile::Builder::new()
        .prefix("devplug-dra-demo-")
        .tempdir()
        .context("cannot create a temp folder")?;
    // Handlers first, so that a Ctrl-C at any point after the folder exists cleans it up.
    let interrupted = devplug::shutdown_signal();
    let outcome = tokio::select! {
        () = interrupted => Err(anyhow::anyhow!(
            "interrupted; the control plane is stopped and the demo's temp folder removed"
        )),
        outcome = walk(&assets, dir.path()) => outcome,
    };
    // `walk` is over (finished or dropped): the control plane it owned is stopped. The folder
    // goes now.
    let path = dir.path().to_owned();
    if let Err(err) = dir.close() {
        tracing::warn!(path = %path.display(), %err, "cannot remove the demo's temp folder");
    }
    outcome
}

/// How to get the binaries, after what is wrong.
fn how_to(problem: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "devplug demo --dra needs etcd, kube-apiserver and kube-scheduler: {problem}.\n\
         Get them with `setup-envtest use 1.36.x -p path` (controller-runtime's tool; it prints the \
         folder with etcd and kube-apiserver), put kube-scheduler of the same version in that \
         folder (https://dl.k8s.io/release/v1.36.N/bin/linux/amd64/kube-scheduler), then \
         `export KUBEBUILDER_ASSETS=<that folder>`."
    )
}

/// The folder of the control plane's binaries: `KUBEBUILDER_ASSETS` when set, else
/// `target/k8s-assets` in the current folder, else in the repository this binary was built from
/// (when it is still there).
fn find_assets() -> anyhow::Result<PathBuf> {
    let names = |missing: &[PathBuf]| -> String {
        missing
            .iter()
            .filter_map(|p| p.file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(", ")
    };
    if let Some(dir) = std::env::var_os("KUBEBUILDER_ASSETS") {
        let dir = PathBuf::from(dir);
        let missing = api_server::missing_binaries(&dir);
        if missing.is_empty() {
            return Ok(dir);
        }
        return Err(how_to(&format!(
            "KUBEBUILDER_ASSETS={} lacks {}",
            dir.display(),
            names(&missing)
        )));
    }
    let here = PathBuf::from("target/k8s-assets");
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .map(|root| root.join("target/k8s-assets"));
    for candidate in std::iter::once(here).chain(repo) {
        if api_server::missing_binaries(&candidate).is_empty() {
            return Ok(std::fs::canonicalize(&candidate).unwrap_or(candidate));
        }
    }
    Err(how_to(
        "KUBEBUILDER_ASSETS is not set, and no target/k8s-assets here or in devplug's checkout \
         holds them",
    ))
}

/// The demo's backend: NPUs that exist only in software, with a model, a NUMA node and memory
/// as DRA attributes; a container gets their ids in [`ENV`] and a device node `/dev/npu<N>`
/// each.
struct Npus(watch::Sender<DeviceList>);

impl Npus {
    /// `count` NPUs `npu-0`…, spread over NUMA nodes two by two.
    fn new(count: i64) -> Npus {
        let devices = (0..count).map(|i| {
            Device::new(format!("npu-{i}"))
                .with_numa_nodes([i / 2])
                .with_attribute("model", AttributeValue::String("dummy-x1".into()))
                .with_capacity("memory", 16 << 30)
        });
        Npus(watch::Sender::new(DeviceList::new(devices)))
    }
}

impl Backend for Npus {
    fn devices(&self) -> watch::Receiver<DeviceList> {
        self.0.subscribe()
    }

    fn allocate(&self, ids: &[String]) -> Result<ContainerEdits, AllocateError> {
        let list = self.0.borrow().clone();
        let mut edits = ContainerEdits::default().env(ENV, ids.join(","));
        for id in ids {
            if list.get(id).is_none() {
                return Err(AllocateError::InvalidRequest(format!("no NPU {id}")));
            }
            let path = format!("/dev/{}", id.replace('-', ""));
            edits.devices.push(devplug::DeviceNode {
                host_path: path.clone(),
                container_path: path,
                permissions: "rw".into(),
            });
        }
        Ok(edits)
    }
}

/// The NPUs go to claims whole, as the device plugin hands them.
impl devplug_dra::ClaimBackend for Npus {}

/// Waits until `check` gives a value, polling every 50 ms, at most [`WAIT`].
async fn until<T, F, Fut>(what: &str, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Option<T>>>,
{
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(value) = check().await? {
            return Ok(value);
        }
        if Instant::now() >= deadline {
            anyhow::bail!("{what} did not happen within {} s", WAIT.as_secs());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A Kubernetes object from its JSON form.
fn object<T: serde::de::DeserializeOwned>(value: serde_json::Value) -> anyhow::Result<T> {
    serde_json::from_value(value).context("building a Kubernetes object")
}

/// The demo's steps; the control plane's files go in `dir/control-plane`, the kubelet's in
/// `dir/kubelet`, CDI specs in `dir/cdi`.
async fn walk(assets: &Path, dir: &Path) -> anyhow::Result<()> {
    line("devplug demo --dra: devplug's DRA driver with a real API server and scheduler, a simulated kubelet (no cluster, no root)");
    line(&format!("folder: {}\n", dir.display()));

    step(
        1,
        &format!(
            "etcd, kube-apiserver and kube-scheduler start from {}",
            assets.display()
        ),
    );
    let started = Instant::now();
    // Declared first, dropped last: everything below talks to it.
    let mut plane = ControlPlane::start(assets, &dir.join("control-plane"))
        .await
        .map_err(|e| anyhow::anyhow!("cannot start the control plane: {e}"))?;
    plane
        .start_scheduler()
        .map_err(|e| anyhow::anyhow!("cannot start kube-scheduler: {e}"))?;
    detail(&format!(
        "the API server at {} is ready after {}; the scheduler runs beside it",
        plane.server().url,
        ms(started.elapsed())
    ));
    let client = devplug_cluster::from_kubeconfig(&plane.server().kubeconfig)
        .await
        .map_err(|e| anyhow::anyhow!("cannot use the control plane's kubeconfig: {e}"))?;

    step(2, &format!("Node {NODE} joins: allocatable cpu 4, memory 8Gi, pods 110; its not-ready taint removed, as the node controller does"));
    join_node(&client).await?;

    step(
        3,
        "the node's kubelet (the simulator) starts and watches plugins_registry",
    );
    let device_plugins = dir.join("kubelet/device-plugins");
    std::fs::create_dir_all(&device_plugins).context("cannot create the kubelet's folder")?;
    let config = SimConfig::default().with_watcher_beside(&device_plugins);
    let kubelet = Kubelet::start_with(&device_plugins, config).await?;

    step(
        4,
        &format!("devplug serves DRA driver {DRIVER}: 4 virtual NPUs on 2 NUMA nodes"),
    );
    let npus = Arc::new(Npus::new(4));
    let list = npus.0.borrow().clone();
    let dirs = KubeletDirs::beside(&device_plugins);
    let settings = DraDriverSettings {
        driver: DRIVER.into(),
        node: NODE.into(),
        dirs: dirs.clone(),
        cdi_dir: dir.join("cdi"),
        no_execute_after: None,
        device_metadata: false,
    };
    let started = Instant::now();
    let driver = DraDriver::start(settings.clone(), npus, client.clone())
        .await
        .context("cannot start the DRA driver")?;
    let published = tokio::time::timeout(WAIT, driver.slices().wait_published(&list))
        .await
        .context("the ResourceSlices were not published in time")?
        .context("the slice publisher stopped")?;
    let slices = our_slices(&client).await?;
    let names: Vec<&str> = slices
        .iter()
        .filter_map(|s| s.metadata.name.as_deref())
        .collect();
    detail(&format!(
        "ResourceSlice {} published in {}: pool {NODE}, generation {}, {} devices, as the API server holds them:",
        names.join(", "),
        ms(started.elapsed()),
        published.generation,
        published.devices
    ));
    show_slices(&slices);
    let mut registered = driver.registered();
    tokio::time::timeout(WAIT, registered.wait_for(|r| *r == Registered::Yes))
        .await
        .context("the kubelet did not register the driver in time")?
        .context("the driver stopped")?;
    // When the kubelet itself recorded the registration, not when this wait noticed it.
    let (service, took) = kubelet
        .read(|n| {
            n.dra_driver(DRIVER).last().map(|r| {
                (
                    r.service.to_string(),
                    r.registered_at.saturating_duration_since(started),
                )
            })
        })
        .context("the kubelet has no record of the driver's registration")?;
    detail(&format!(
        "the kubelet's plugin watcher found {} and registered the driver ({service}) after {} (its reconciler runs every second, so up to 1 s)",
        driver.registration_path().display(),
        ms(took)
    ));

    step(
        5,
        &format!("DeviceClass {CLASS}: device.driver == \"{DRIVER}\""),
    );
    let classes: Api<DeviceClass> = Api::all(client.clone());
    classes
        .create(
            &PostParams::default(),
            &object(json!({
                "metadata": { "name": CLASS },
                "spec": { "selectors": [{ "cel": {
                    "expression": format!("device.driver == \"{DRIVER}\"") } }] },
            }))?,
        )
        .await
        .context("cannot create the DeviceClass")?;

    step(
        6,
        &format!("ResourceClaim {CLAIM}: 2 devices of class {CLASS} where {SELECTOR}"),
    );
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), NAMESPACE);
    let claim = claims
        .create(
            &PostParams::default(),
            &object(json!({
                "metadata": { "name": CLAIM },
                "spec": { "devices": { "requests": [{
                    "name": REQUEST,
                    "exactly": {
                        "deviceClassName": CLASS,
                        "allocationMode": "ExactCount",
                        "count": 2,
                        "selectors": [{ "cel": { "expression": SELECTOR } }],
                    },
                }] } },
            }))?,
        )
        .await
        .context("cannot create the ResourceClaim")?;
    let claim_uid = claim
        .metadata
        .uid
        .context("the API server gave the claim no UID")?;

    step(
        7,
        &format!("Pod {POD} uses the claim; kube-scheduler allocates it and binds the pod"),
    );
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let started = Instant::now();
    let pod = pods
        .create(
            &PostParams::default(),
            &object(json!({
                "metadata": { "name": POD },
                "spec": {
                    "resourceClaims": [{ "name": REQUEST, "resourceClaimName": CLAIM }],
                    "containers": [{ "name": "main", "image": "example.invalid/trainer",
                                     "resources": { "claims": [{ "name": REQUEST }] } }],
                },
            }))?,
        )
        .await
        .context("cannot create the Pod")?;
    let pod_uid = pod
        .metadata
        .uid
        .context("the API server gave the pod no UID")?;
    let bound = until("the pod's binding", || async {
        let pod = pods.get(POD).await.context("cannot read the Pod")?;
        Ok(pod.spec.and_then(|s| s.node_name))
    })
    .await?;
    let claim = claims
        .get(CLAIM)
        .await
        .context("cannot read the ResourceClaim")?;
    let status = claim.status.unwrap_or_default();
    let results = status
        .allocation
        .and_then(|a| a.devices)
        .and_then(|d| d.results)
        .unwrap_or_default();
    let devices: Vec<&str> = results.iter().map(|r| r.device.as_str()).collect();
    let pools: Vec<&str> = results.iter().map(|r| r.pool.as_str()).collect();
    let reserved: Vec<String> = status
        .reserved_for
        .unwrap_or_default()
        .into_iter()
        .map(|r| format!("{}/{}", r.resource, r.name))
        .collect();
    detail(&format!(
        "allocated {} (driver {DRIVER}, pool {}, request {REQUEST}): the two NPUs on NUMA node 1",
        devices.join(", "),
        pools.first().copied().unwrap_or("?")
    ));
    detail(&format!(
        "the claim is reserved for {}; the pod is bound to {bound}, {} after it was created",
        reserved.join(", "),
        ms(started.elapsed())
    ));

    step(
        8,
        &format!(
            "the kubelet prepares the pod's claim: NodePrepareResources on {}, the socket the plugin watcher registered",
            driver.endpoint().display()
        ),
    );
    let sim_claim = DraClaim::new(NAMESPACE, CLAIM, &claim_uid);
    let started = Instant::now();
    kubelet
        .dra_prepare_pod(&pod_uid, &[(DRIVER, sim_claim)])
        .await
        .context("NodePrepareResources failed")?;
    let elapsed = started.elapsed();
    let prepared = kubelet
        .read(|n| n.dra_claim(DRIVER, &claim_uid).cloned())
        .context("the kubelet has no record of the prepared claim")?;
    let names: Vec<&str> = prepared
        .devices
        .iter()
        .map(|d| d.device_name.as_str())
        .collect();
    detail(&format!(
        "answered in {}: devices {}",
        ms(elapsed),
        names.join(", ")
    ));
    for id in prepared.cdi_device_ids() {
        detail(&format!("CDI id: {id}"));
    }
    let spec_path = devplug_dra::prepare::spec_path(&settings.cdi_dir, DRIVER, &claim_uid);
    show_spec(&spec_path)?;

    step(
        9,
        &format!("Pod {POD} is deleted; the kubelet unprepares its claim: NodeUnprepareResources"),
    );
    pods.delete(POD, &DeleteParams::default().grace_period(0))
        .await
        .context("cannot delete the Pod")?;
    let started = Instant::now();
    kubelet
        .dra_remove_pod(&pod_uid)
        .await
        .context("NodeUnprepareResources failed")?;
    detail(&format!(
        "answered in {}; CDI spec {}: {}",
        ms(started.elapsed()),
        file_name(&spec_path),
        if spec_path.exists() {
            "still there"
        } else {
            "removed"
        }
    ));
    if spec_path.exists() {
        anyhow::bail!("the claim's CDI spec {} is left", spec_path.display());
    }

    step(
        10,
        &format!(
            "sharing by capacity: driver {} with one GPU that claims share, packed by the scheduler",
            crate::demo_dra_sharing::DRIVER
        ),
    );
    let sharing = crate::demo_dra_sharing::walk(
        &client,
        &kubelet,
        &dirs,
        NODE,
        NAMESPACE,
        &settings.cdi_dir,
        WAIT,
    )
    .await?;

    step(
        11,
        "devplug's drivers are removed (sockets and the node's ResourceSlices; a plain stop would \
         keep the slices for its next start), then the control plane stops",
    );
    let started = Instant::now();
    let mut problems = driver.remove().await;
    problems.extend(sharing.remove().await);
    if !problems.is_empty() {
        anyhow::bail!("the DRA drivers did not clean up: {}", problems.join("; "));
    }
    let left = slice_count(&client).await?;
    detail(&format!(
        "driver stopped in {}; ResourceSlices left for {NODE}: {left}",
        ms(started.elapsed())
    ));
    kubelet.stop().await;
    let took = plane.stop();
    detail(&format!(
        "etcd, kube-apiserver and kube-scheduler stopped in {}",
        ms(took)
    ));
    line("\ndone.");
    Ok(())
}

/// Creates the Node and makes it schedulable: the not-ready taint added at admission removed,
/// capacity and allocatable set, a Ready condition.
async fn join_node(client: &kube::Client) -> anyhow::Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .create(
            &PostParams::default(),
            &object(json!({
                "metadata": { "name": NODE, "labels": { "kubernetes.io/hostname": NODE } },
            }))?,
        )
        .await
        .context("cannot create the Node")?;
    nodes
        .patch(
            NODE,
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "taints": [] } })),
        )
        .await
        .context("cannot remove the Node's not-ready taint")?;
    nodes
        .patch_status(
            NODE,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": {
                "capacity": { "cpu": "4", "memory": "8Gi", "pods": "110" },
                "allocatable": { "cpu": "4", "memory": "8Gi", "pods": "110" },
                "conditions": [{ "type": "Ready", "status": "True", "reason": "KubeletReady",
                                 "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                                 "lastTransitionTime": "2026-01-01T00:00:00Z" }],
            } })),
        )
        .await
        .context("cannot set the Node's status")?;
    Ok(())
}

/// The ResourceSlices of our driver on our node.
async fn our_slices(client: &kube::Client) -> anyhow::Result<Vec<ResourceSlice>> {
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let list = slices
        .list(&ListParams::default().fields(&format!("spec.nodeName={NODE},spec.driver={DRIVER}")))
        .await
        .context("cannot list ResourceSlices")?;
    Ok(list.items)
}

/// How many ResourceSlices of our driver our node has.
async fn slice_count(client: &kube::Client) -> anyhow::Result<usize> {
    Ok(our_slices(client).await?.len())
}

/// Prints the devices of `slices`: name, model, NUMA node, memory.
fn show_slices(slices: &[ResourceSlice]) {
    let mut rows = vec![vec![
        "DEVICE".to_owned(),
        "MODEL".to_owned(),
        "NUMA".to_owned(),
        "MEMORY".to_owned(),
    ]];
    for slice in slices {
        for device in slice.spec.devices.iter().flatten() {
            let none = Default::default();
            let attributes = device.attributes.as_ref().unwrap_or(&none);
            let attribute = |key: &str| -> String {
                attributes
                    .get(key)
                    .map(|a| {
                        a.string
                            .clone()
                            .or_else(|| a.int.map(|i| i.to_string()))
                            .or_else(|| a.bool.map(|b| b.to_string()))
                            .or_else(|| a.version.clone())
                            .unwrap_or_default()
                    })
                    .unwrap_or_else(|| "-".to_owned())
            };
            let memory = device
                .capacity
                .as_ref()
                .and_then(|c| c.get("memory"))
                .map(|c| bytes(&c.value.0))
                .unwrap_or_else(|| "-".to_owned());
            rows.push(vec![
                device.name.clone(),
                attribute("model"),
                attribute("numa"),
                memory,
            ]);
        }
    }
    line("");
    for row in crate::inspect::render::table(&rows).lines() {
        detail(row);
    }
    line("");
}

/// Prints the container edits of each device of the CDI spec at `path`.
fn show_spec(path: &Path) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the CDI spec {}", path.display()))?;
    let spec: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("the CDI spec {} is not JSON", path.display()))?;
    let kind = spec["kind"].as_str().unwrap_or_default();
    detail(&format!(
        "CDI spec {} (kind {kind}, in the folder the container runtime reads):",
        path.display()
    ));
    for device in spec["devices"].as_array().into_iter().flatten() {
        let name = device["name"].as_str().unwrap_or_default();
        detail(&format!("  device {name}:"));
        let edits = &device["containerEdits"];
        for env in edits["env"].as_array().into_iter().flatten() {
            detail(&format!("    env {}", env.as_str().unwrap_or_default()));
        }
        for node in edits["deviceNodes"].as_array().into_iter().flatten() {
            detail(&format!(
                "    device node {} ({})",
                node["path"].as_str().unwrap_or_default(),
                node["permissions"].as_str().unwrap_or_default()
            ));
        }
    }
    Ok(())
}

/// A quantity as the API server holds it, with whole GiB spelled out: `17179869184 (16 GiB)`.
fn bytes(quantity: &str) -> String {
    match quantity.parse::<u64>() {
        Ok(n) if n >= 1 << 30 && n % (1 << 30) == 0 => format!("{quantity} ({} GiB)", n >> 30),
        _ => quantity.to_owned(),
    }
}

/// The last part of `path`.
fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}
