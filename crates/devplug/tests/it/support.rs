//! A small real backend for tests, and helpers to wait on the simulator.

use devplug::Host;
use devplug::{
    AllocateError, Backend, ContainerEdits, Device, DeviceList, Health, Options, PreferenceRequest,
};
use devplug_proto::v1beta1 as pb;
use kubelet_sim::{Kubelet, NodeState, SimConfig};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

pub const WAIT: Duration = Duration::from_secs(10);

/// A backend with a fixed set of devices whose health tests can change. Allocation sets
/// `TEST_DEVICES` to the ids; preferences prefer the highest ids; pre-start calls are recorded.
#[derive(Clone)]
pub struct TestBackend {
    tx: Arc<watch::Sender<DeviceList>>,
    pub options: Options,
    pub pre_started: Arc<Mutex<Vec<Vec<String>>>>,
}

impl TestBackend {
    pub fn new(count: usize) -> Self {
        let devices = (0..count).map(|i| Device::new(format!("dev-{i}")));
        TestBackend {
            tx: Arc::new(watch::Sender::new(DeviceList::new(devices))),
            options: Options::default(),
            pre_started: Arc::default(),
        }
    }

    pub fn with_options(mut self, options: Options) -> Self {
        self.options = options;
        self
    }

    pub fn set_health(&self, id: &str, health: Health) {
        self.tx.send_modify(|list| {
            list.set_health(id, health);
        });
    }

    pub fn publish(&self, devices: Vec<Device>) {
        self.tx.send_replace(DeviceList::new(devices));
    }
}

impl Backend for TestBackend {
    fn devices(&self) -> watch::Receiver<DeviceList> {
        self.tx.subscribe()
    }

    fn allocate(&self, ids: &[String]) -> Result<ContainerEdits, AllocateError> {
        Ok(ContainerEdits::default().env("TEST_DEVICES", ids.join(",")))
    }

    fn preferred(&self, request: &PreferenceRequest<'_>) -> Vec<String> {
        let mut ids: Vec<String> = request.available.to_vec();
        ids.sort();
        ids.reverse();
        ids
    }

    fn pre_start(
        &self,
        ids: &[String],
    ) -> devplug::backend::BoxFuture<'_, Result<(), devplug::PreStartError>> {
        self.pre_started.lock().unwrap().push(ids.to_vec());
        Box::pin(async { Ok(()) })
    }

    fn options(&self) -> Options {
        self.options
    }
}

/// Settings with no health hold-down, for tests that flip health back and forth.
pub fn no_hold_down() -> devplug::ResourceSettings {
    devplug::ResourceSettings {
        health_hold_down: Duration::ZERO,
        ..Default::default()
    }
}

/// A started simulator in a fresh temp folder, with a short grace period.
pub async fn kubelet(grace: Duration) -> (tempfile::TempDir, Kubelet) {
    let dir = tempfile::tempdir().unwrap();
    let config = SimConfig {
        grace,
        ..SimConfig::default()
    };
    let kubelet = Kubelet::start_with(dir.path(), config).await.unwrap();
    (dir, kubelet)
}

/// Waits until the kubelet sees `(capacity, allocatable)` for `resource`.
pub async fn wait_capacity(kubelet: &Kubelet, resource: &str, want: (usize, usize)) {
    let got = kubelet
        .wait_for(WAIT, |node: &NodeState| {
            (node.capacity(resource) == want).then_some(())
        })
        .await;
    if got.is_err() {
        let now = kubelet.read(|node| node.capacity(resource));
        panic!("{resource}: wanted (capacity, allocatable) = {want:?}, the kubelet has {now:?}");
    }
}

/// The socket `resource` is served on right now.
pub fn plugin_socket(host: &Host, resource: &str) -> PathBuf {
    let status = host.status(resource).unwrap();
    let socket = status.borrow().socket.clone();
    socket.unwrap()
}

/// An Allocate request for one container asking for `ids`.
pub fn allocate_request(ids: &[&str]) -> pb::AllocateRequest {
    pb::AllocateRequest {
        container_requests: vec![pb::ContainerAllocateRequest {
            devices_ids: ids.iter().map(|s| s.to_string()).collect(),
        }],
    }
}
