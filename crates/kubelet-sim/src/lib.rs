//! kubelet-sim: a stand-in for the kubelet's device manager, over real Unix sockets in any folder.
//!
//! It serves `v1beta1.Registration` on `kubelet.sock`, validates registrations like the kubelet,
//! dials plugins back (authority `localhost`, 10 s), consumes ListAndWatch and derives capacity and
//! allocatable, allocates containers like the kubelet, runs PreStartContainer when asked, applies
//! the disconnect grace period, and simulates a kubelet restart exactly: every socket in the folder
//! is deleted and a new `kubelet.sock` is served.
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let kubelet = kubelet_sim::Kubelet::start("/tmp/device-plugins").await?;
//! let npu = kubelet
//!     .wait_for(std::time::Duration::from_secs(5), |node| {
//!         (node.capacity("dummy.com/npu").0 > 0).then_some(())
//!     })
//!     .await?;
//! let allocation = kubelet.allocate("pod-a", "main", "dummy.com/npu", 2).await?;
//! println!("{:?}", allocation.env("DUMMY_VISIBLE_DEVICES"));
//! # Ok(()) }
//! ```
//!
//! Files: `registration` (the Registration service and the ListAndWatch consumer),
//! `allocation` (the kubelet's allocation rules), `state` (what the node knows), and
//! [`fake_plugin`], a minimal device plugin written without the devplug library (another
//! vendor's plugin, for tests).

mod allocation;
pub mod fake_plugin;
mod registration;
mod state;

pub use allocation::AllocationError;
pub use state::{Allocation, NodeState, RegistrationRecord, ResourceState, SimDevice};

use allocation::ContainerKind;
use devplug_proto::constants::{
    CHECKPOINT_FILE_NAME, ENDPOINT_STOP_GRACE_SECS, KUBELET_SOCKET_NAME,
};
use devplug_proto::v1beta1::registration_server::RegistrationServer;
use registration::RegistrationService;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// How the simulated kubelet behaves.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// How long a disconnected resource is kept before removal (the kubelet: 5 minutes).
    pub grace: Duration,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            grace: Duration::from_secs(ENDPOINT_STOP_GRACE_SECS),
        }
    }
}

/// Errors of the simulator itself.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The folder or socket could not be prepared.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A [`Kubelet::wait_for`] condition did not come true in time.
    #[error("timed out after {0:?} waiting for the node state")]
    Timeout(Duration),
}

/// State shared by the handle, the Registration service and the stream consumers.
pub(crate) struct Shared {
    pub(crate) dir: PathBuf,
    pub(crate) config: SimConfig,
    state: Mutex<NodeState>,
    version: watch::Sender<u64>,
    pub(crate) admission: tokio::sync::Mutex<()>,
    /// Cancelled when the simulator stops; parent of every endpoint's token.
    pub(crate) stop: CancellationToken,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, NodeState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads the state.
    pub(crate) fn read<R>(&self, f: impl FnOnce(&NodeState) -> R) -> R {
        f(&self.lock())
    }

    /// Changes the state and wakes every waiter.
    pub(crate) fn modify<R>(&self, f: impl FnOnce(&mut NodeState) -> R) -> R {
        let result = f(&mut self.lock());
        self.version.send_modify(|v| *v += 1);
        result
    }
}

/// A running simulated kubelet. Dropping it stops serving.
pub struct Kubelet {
    shared: Arc<Shared>,
    server: Option<(CancellationToken, JoinHandle<()>)>,
}

impl Kubelet {
    /// Starts a kubelet serving `dir/kubelet.sock`, with the real 5-minute grace period.
    pub async fn start(dir: impl Into<PathBuf>) -> Result<Kubelet, SimError> {
        Kubelet::start_with(dir, SimConfig::default()).await
    }

    /// Starts a kubelet with the given behaviour.
    pub async fn start_with(
        dir: impl Into<PathBuf>,
        config: SimConfig,
    ) -> Result<Kubelet, SimError> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir).map_err(|source| SimError::Io {
            what: "cannot create",
            path: dir.clone(),
            source,
        })?;
        let shared = Arc::new(Shared {
            dir,
            config,
            state: Mutex::new(NodeState::default()),
            version: watch::Sender::new(0),
            admission: tokio::sync::Mutex::new(()),
            stop: CancellationToken::new(),
        });
        let mut kubelet = Kubelet {
            shared,
            server: None,
        };
        kubelet.boot()?;
        Ok(kubelet)
    }

    /// The device-plugins folder.
    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }

    /// The path of `kubelet.sock`.
    pub fn socket_path(&self) -> PathBuf {
        self.shared.dir.join(KUBELET_SOCKET_NAME)
    }

    /// Reads the node state now.
    pub fn read<R>(&self, f: impl FnOnce(&NodeState) -> R) -> R {
        self.shared.read(f)
    }

    /// Waits until `check` returns `Some` for the node state, re-checking on every change.
    pub async fn wait_for<T>(
        &self,
        timeout: Duration,
        mut check: impl FnMut(&NodeState) -> Option<T>,
    ) -> Result<T, SimError> {
        let mut changes = self.shared.version.subscribe();
        let waiting = async {
            loop {
                changes.borrow_and_update();
                if let Some(found) = self.shared.read(&mut check) {
                    return found;
                }
                if changes.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        };
        tokio::time::timeout(timeout, waiting)
            .await
            .map_err(|_| SimError::Timeout(timeout))
    }

    /// Admits an app container asking for `count` devices of `resource`, like the kubelet.
    pub async fn allocate(
        &self,
        pod: &str,
        container: &str,
        resource: &str,
        count: usize,
    ) -> Result<Allocation, AllocationError> {
        allocation::allocate(
            &self.shared,
            pod,
            container,
            ContainerKind::App,
            resource,
            count,
        )
        .await
    }

    /// Admits an init container; its devices are reused by the pod's later containers.
    pub async fn allocate_init(
        &self,
        pod: &str,
        container: &str,
        resource: &str,
        count: usize,
    ) -> Result<Allocation, AllocationError> {
        allocation::allocate(
            &self.shared,
            pod,
            container,
            ContainerKind::Init,
            resource,
            count,
        )
        .await
    }

    /// Starts a container: calls PreStartContainer if the plugin asked for it. Returns whether
    /// it was called.
    pub async fn start_container(
        &self,
        pod: &str,
        container: &str,
        resource: &str,
    ) -> Result<bool, AllocationError> {
        allocation::pre_start(&self.shared, pod, container, resource).await
    }

    /// Drops the plugin connection of `resource` without restarting, as when the kubelet's
    /// ListAndWatch fails: devices turn unhealthy, the grace period starts, and the kubelet does
    /// not dial again (the plugin has to register again). Returns false if not connected.
    pub fn disconnect(&self, resource: &str) -> bool {
        let generation = self.shared.read(|node| {
            let r = node.resource(resource)?;
            let endpoint = r.endpoint.as_ref()?;
            endpoint.stop.cancel();
            Some(r.generation)
        });
        match generation {
            Some(generation) => {
                registration::disconnect(&self.shared, resource, generation);
                true
            }
            None => false,
        }
    }

    /// Removes a terminated pod; its devices become free.
    pub fn remove_pod(&self, pod: &str) -> bool {
        self.shared.modify(|node| node.pods.remove(pod).is_some())
    }

    /// Simulates a kubelet restart: stop serving, drop every plugin connection, delete every
    /// socket in the folder (the checkpoint and other files stay), then serve a new
    /// `kubelet.sock`. Known resources are kept as the checkpoint restores them: no devices and
    /// a stopped endpoint, so capacity reads 0 until the plugin registers again. Allocations stay.
    pub async fn restart(&mut self) -> Result<(), SimError> {
        self.halt().await;
        let shared = self.shared.clone();
        let mut expired = Vec::new();
        shared.modify(|node| {
            node.restarts += 1;
            for (name, r) in node.resources.iter_mut() {
                if let Some(endpoint) = r.endpoint.take() {
                    endpoint.stop.cancel();
                }
                r.devices.clear();
                r.generation += 1;
                r.stopped_at = Some(Instant::now());
                expired.push((name.clone(), r.generation));
            }
        });
        for (name, generation) in expired {
            registration::schedule_removal(&shared, &name, generation);
        }
        self.boot()
    }

    /// Stops serving and drops every plugin connection. Sockets of plugins stay in place.
    pub async fn stop(mut self) {
        self.halt().await;
        self.shared.stop.cancel();
    }

    /// Deletes every socket in the folder, then serves kubelet.sock.
    fn boot(&mut self) -> Result<(), SimError> {
        clean_plugin_dir(&self.shared.dir);
        let path = self.socket_path();
        let listener = tokio::net::UnixListener::bind(&path).map_err(|source| SimError::Io {
            what: "cannot bind",
            path: path.clone(),
            source,
        })?;
        let stop = self.shared.stop.child_token();
        let service = RegistrationService {
            shared: self.shared.clone(),
        };
        let task = devplug_proto::uds::spawn_server(
            tonic::transport::Server::builder().add_service(RegistrationServer::new(service)),
            listener,
            stop.clone().cancelled_owned(),
            "the kubelet.sock server".to_owned(),
        );
        self.server = Some((stop, task));
        Ok(())
    }

    async fn halt(&mut self) {
        if let Some((stop, task)) = self.server.take() {
            stop.cancel();
            let _ = tokio::time::timeout(Duration::from_secs(2), task).await;
        }
        let _ = std::fs::remove_file(self.socket_path());
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        self.shared.stop.cancel();
    }
}

/// The kubelet's `CleanupPluginDirectory`: removes every Unix socket except the checkpoint.
fn clean_plugin_dir(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let is_socket = entry.file_type().is_ok_and(|t| t.is_socket());
        if is_socket && entry.file_name() != CHECKPOINT_FILE_NAME {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}
