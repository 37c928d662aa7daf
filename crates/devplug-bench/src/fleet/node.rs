//! One simulated node: a real `Node` object (allocatable CPU, memory and pods, `Ready`, its
//! lease renewed as a kubelet renews it) and devplug's real DRA driver for it: its own slice
//! publisher, preparer, checkpoint, CDI folder and kubelet-facing gRPC socket in a temp folder
//! of its own, over a virtual backend.

use super::{workload, Variant};
use anyhow::Context;
use devplug_backends::virtual_devices::{
    VirtualBackend, VirtualPartitions, VirtualSettings, VirtualShare,
};
use devplug_dra::kubelet::KubeletDirs;
use devplug_dra::{ClaimBackend, DraDriver, DraDriverSettings};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Patch, PatchParams, PostParams};
use kube::Api;
use serde_json::json;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// The namespace of the nodes' leases.
const LEASE_NAMESPACE: &str = "kube-node-lease";
/// How often a kubelet renews its lease (its default: a quarter of the 40 s lease).
pub const LEASE_RENEW: Duration = Duration::from_secs(10);

/// Where the nodes' CDI folders go: a tmpfs, as a node's `/var/run/cdi`.
const TMPFS: &str = "/dev/shm";

/// A simulated node's driver and where its files are.
pub struct SimNode {
    /// The Node's name (also the driver's pool).
    pub name: String,
    /// The driver's settings (to start it again).
    pub settings: DraDriverSettings,
    /// The driver, while it runs.
    pub driver: Option<DraDriver>,
    /// The running driver's backend (to break and mend its devices).
    backend: Option<Arc<VirtualBackend>>,
    /// The node's kubelet folders (the checkpoint's disk).
    pub root: tempfile::TempDir,
    /// The node's CDI folder: on tmpfs where `/dev/shm` is one, as a node's `/var/run/cdi` is
    /// (else in `root`); held for its removal at drop.
    cdi: Option<tempfile::TempDir>,
    variant: Variant,
    devices: usize,
    /// The running driver's `DRAPlugin` socket (each instance names its own), as the kubelet
    /// learns it from the registration.
    endpoint: tokio::sync::watch::Sender<PathBuf>,
}

impl SimNode {
    /// The folders of node `name`'s driver, in a temp folder of its own.
    pub fn new(
        name: &str,
        driver: &str,
        variant: Variant,
        devices: usize,
    ) -> anyhow::Result<SimNode> {
        let root = tempfile::Builder::new()
            .prefix("devplug-fleet-")
            .tempdir()?;
        let device_plugins = root.path().join("device-plugins");
        std::fs::create_dir_all(&device_plugins)?;
        let cdi = tempfile::Builder::new()
            .prefix("devplug-fleet-cdi-")
            .tempdir_in(TMPFS)
            .ok();
        let cdi_dir = cdi
            .as_ref()
            .map_or_else(|| root.path().join("cdi"), |d| d.path().to_owned());
        let settings = DraDriverSettings {
            driver: driver.to_owned(),
            node: name.to_owned(),
            dirs: KubeletDirs::beside(&device_plugins),
            cdi_dir,
            no_execute_after: None,
            device_metadata: false,
        };
        Ok(SimNode {
            name: name.to_owned(),
            settings,
            driver: None,
            backend: None,
            root,
            cdi,
            endpoint: tokio::sync::watch::Sender::new(PathBuf::new()),
            variant,
            devices,
        })
    }

    /// Whether its CDI folder is on tmpfs.
    pub fn cdi_on_tmpfs(&self) -> bool {
        self.cdi.is_some()
    }

    /// The running driver's `DRAPlugin` socket, as the kubelet learns it from each
    /// registration (a restarted driver serves another one).
    pub fn endpoint(&self) -> tokio::sync::watch::Receiver<PathBuf> {
        self.endpoint.subscribe()
    }

    /// Starts the driver with `client` (a new backend each time, as a new process has).
    pub async fn start_driver(&mut self, client: kube::Client) -> anyhow::Result<()> {
        let backend = Arc::new(VirtualBackend::new(&backend_settings(
            self.variant,
            self.devices,
        ))?);
        let serving: Arc<dyn ClaimBackend> = backend.clone();
        let driver = DraDriver::start(self.settings.clone(), serving, client)
            .await
            .with_context(|| format!("the driver of {}", self.name))?;
        self.endpoint.send_replace(driver.endpoint().to_owned());
        self.driver = Some(driver);
        self.backend = Some(backend);
        Ok(())
    }

    /// Changes the health of device `id` of the running driver's backend, as a device that
    /// breaks or recovers; false when nothing changed.
    pub fn set_health(&self, id: &str, health: devplug::Health) -> bool {
        self.backend
            .as_ref()
            .is_some_and(|b| b.set_health(id, health))
    }

    /// The slice specs the running driver would publish now, in the form
    /// [`devplug_dra::slices::slice_specs`] makes at generation 0 (none without a driver).
    pub fn wanted_slices(&self) -> Vec<k8s_openapi::api::resource::v1::ResourceSliceSpec> {
        let Some(backend) = &self.backend else {
            return Vec::new();
        };
        let list = devplug::Backend::devices(backend.as_ref()).borrow().clone();
        devplug_dra::slices::slice_specs(&self.settings.driver, &self.name, 0, &list).specs
    }

    /// Stops the driver as devplug stops at SIGTERM: sockets removed; the slices, the
    /// checkpoint and CDI specs kept. Returns what could not be cleaned up.
    pub async fn stop_driver(&mut self) -> Vec<String> {
        self.backend = None;
        match self.driver.take() {
            Some(driver) => driver.shutdown().await,
            None => Vec::new(),
        }
    }

    /// Stops the driver for good, its slices deleted (the stand-in kubelet does not wipe a gone
    /// driver's slices as the kubelet does). Returns what could not be cleaned up.
    pub async fn remove_driver(&mut self) -> Vec<String> {
        self.backend = None;
        match self.driver.take() {
            Some(driver) => driver.remove().await,
            None => Vec::new(),
        }
    }
}

/// The virtual backend of one node: `devices` devices, whole, shared by capacity or
/// partitioned.
pub fn backend_settings(variant: Variant, devices: usize) -> VirtualSettings {
    let mut settings = VirtualSettings {
        env: "FLEET_DEVICES".into(),
        id_prefix: "dev-".into(),
        ..VirtualSettings::new(devices)
    };
    match variant {
        Variant::Whole => {}
        Variant::Share => {
            settings.share = Some(VirtualShare {
                cores: 100,
                memory: None,
                memory_step: "256Mi".into(),
            });
        }
        Variant::Partitions => {
            settings.partitions = Some(VirtualPartitions {
                slices: 2,
                sizes: vec![1],
            });
        }
    }
    settings
}

fn now() -> String {
    k8s_openapi::jiff::Timestamp::now().to_string()
}

/// Creates Node `name` (64 CPUs, 256 GiB, 110 pods, `Ready`) and its lease; in a shared
/// cluster (`group`), labelled with its group and tainted so that only the run's pods land on
/// it.
pub async fn create_node(
    client: &kube::Client,
    name: &str,
    group: Option<&str>,
) -> anyhow::Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    let mut node = json!({
        "metadata": { "name": name, "labels": { "kubernetes.io/hostname": name, "devplug-fleet": "node" } },
    });
    if let Some(group) = group {
        node["metadata"]["labels"][workload::GROUP_LABEL] = json!(group);
        node["spec"] = json!({ "taints": [{ "key": workload::SIMULATED_TAINT, "value": "true", "effect": "NoSchedule" }] });
    }
    let node: Node = serde_json::from_value(node)?;
    nodes.create(&PostParams::default(), &node).await?;
    let resources = json!({ "cpu": "64", "memory": "256Gi", "pods": "110" });
    let at = now();
    let status = json!({ "status": {
        "capacity": resources, "allocatable": resources,
        "conditions": [{ "type": "Ready", "status": "True", "reason": "KubeletReady",
            "message": "devplug-bench fleet: a simulated node", "lastHeartbeatTime": at,
            "lastTransitionTime": at }],
        "nodeInfo": { "kubeletVersion": "v1.36.2", "containerRuntimeVersion": "containerd://2.2.7",
            "architecture": "amd64", "operatingSystem": "linux", "bootID": "", "kernelVersion": "",
            "kubeProxyVersion": "", "machineID": "", "osImage": "", "systemUUID": "" },
    } });
    nodes
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), LEASE_NAMESPACE);
    let lease: Lease = serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": { "holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": micro_now() },
    }))?;
    leases.create(&PostParams::default(), &lease).await?;
    Ok(())
}

/// Deletes Node `name` and its lease (a run's end on a shared cluster).
pub async fn remove_node(client: &kube::Client, name: &str) -> anyhow::Result<()> {
    let gone = |result: Result<_, kube::Error>| match result {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.is_not_found() => Ok(()),
        Err(err) => Err(anyhow::Error::from(err).context(format!("delete Node {name}"))),
    };
    let nodes: Api<Node> = Api::all(client.clone());
    gone(nodes.delete(name, &Default::default()).await.map(|_| ()))?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), LEASE_NAMESPACE);
    gone(leases.delete(name, &Default::default()).await.map(|_| ()))
}

fn micro_now() -> String {
    let t = k8s_openapi::jiff::Timestamp::now();
    t.strftime("%Y-%m-%dT%H:%M:%S%.6fZ").to_string()
}

/// Renews every node's lease every [`LEASE_RENEW`], spread evenly over the interval, until
/// the task is aborted; each renewal is a task of its own, so a slow API server delays no other
/// node's (as each kubelet renews its own); a failure (the API server away) is retried at the
/// next turn.
pub async fn renew_leases(client: kube::Client, names: Vec<String>) {
    let leases: Api<Lease> = Api::namespaced(client, LEASE_NAMESPACE);
    let count = u32::try_from(names.len().max(1)).unwrap_or(u32::MAX);
    let mut tick = tokio::time::interval(LEASE_RENEW / count);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    for name in names.iter().cycle() {
        tick.tick().await;
        let (leases, name) = (leases.clone(), name.clone());
        tokio::spawn(async move {
            let patch = json!({ "spec": { "renewTime": micro_now() } });
            if let Err(err) = leases
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                tracing::debug!(node = %name, %err, "lease not renewed");
            }
        });
    }
}
