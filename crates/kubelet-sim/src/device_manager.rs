//! The device manager: [`Kubelet`], the handle a test holds (start, allocate, DRA calls,
//! restart, crash, stop), and the kubelet's boot (the state it shares with the Registration
//! service, the stream consumers and the plugin watcher is `Shared`): every socket in the
//! folder deleted (`clean_plugin_dir`), `kubelet.sock` bound then served, the plugin watcher
//! and the pod resources server started.

use crate::allocation::{self, AllocationError, ContainerKind};
use crate::config::SimConfig;
use crate::dra::{self, ClaimResults, DraClaim, DraDevice, DraError};
use crate::registration::{self, RegistrationService};
use crate::shared::Shared;
use crate::state::{Allocation, NodeState};
use crate::{plugin_watcher, pod_resources};
use devplug_proto::constants::{CHECKPOINT_FILE_NAME, KUBELET_SOCKET_NAME};
use devplug_proto::v1beta1::registration_server::RegistrationServer;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

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
            session: Mutex::new(CancellationToken::new()),
            dir,
            config,
            state: Mutex::new(NodeState::default()),
            version: watch::Sender::new(0),
            admission: tokio::sync::Mutex::new(()),
            stop: CancellationToken::new(),
            failing_connects: std::sync::atomic::AtomicUsize::new(0),
        });
        let mut kubelet = Kubelet {
            shared,
            server: None,
        };
        kubelet.boot().await?;
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
            r.endpoint.as_ref()?;
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

    /// Makes the next `count` dials back to a plugin fail, as when the kubelet cannot reach the
    /// plugin's socket in time (`failed to dial device plugin`); on either route. For fault tests.
    pub fn fail_next_plugin_connects(&self, count: usize) {
        self.shared
            .failing_connects
            .store(count, std::sync::atomic::Ordering::SeqCst);
    }

    /// The pod resources socket, when served.
    pub fn pod_resources_socket(&self) -> Option<&Path> {
        self.shared.config.pod_resources_socket.as_deref()
    }

    /// Calls `NodePrepareResources` for `claims` on a registered plugin of `driver`, over the
    /// service version chosen at registration, within [`SimConfig::dra_call_timeout`]. Each
    /// requested claim gets a result: its devices, or why not (missing from the answer, or the
    /// plugin's `error`). Claims that succeed are kept as prepared
    /// ([`NodeState::dra_prepared`]). This is the bare per-driver call: it asks the plugin even
    /// for claims already prepared ([`Kubelet::dra_prepare_pod`] skips those, as the kubelet
    /// does).
    pub async fn dra_prepare(
        &self,
        driver: &str,
        claims: &[DraClaim],
    ) -> Result<ClaimResults<Vec<DraDevice>>, DraError> {
        dra::prepare(&self.shared, driver, claims).await
    }

    /// Opens `driver`'s device health stream (`DRAResourceHealth/NodeWatchResources`) on its
    /// chosen endpoint, as the kubelet does once the driver registers; each message lists
    /// devices with their health.
    pub async fn dra_watch_health(&self, driver: &str) -> Result<dra::HealthStream, DraError> {
        dra::watch_health(&self.shared, driver).await
    }

    /// Calls `NodeUnprepareResources` for `claims` on a registered plugin of `driver`; claims
    /// that succeed are no longer prepared.
    pub async fn dra_unprepare(
        &self,
        driver: &str,
        claims: &[DraClaim],
    ) -> Result<ClaimResults<()>, DraError> {
        dra::unprepare(&self.shared, driver, claims).await
    }

    /// Prepares a pod's claims as the kubelet does before starting it: every driver must be
    /// registered (otherwise nothing changes), the pod then references each claim, and the
    /// claims not prepared yet (for another pod) are prepared in one call per driver. The first
    /// failure, whole-call or per-claim, is the error.
    pub async fn dra_prepare_pod(
        &self,
        pod_uid: &str,
        claims: &[(&str, DraClaim)],
    ) -> Result<(), DraError> {
        dra::prepare_pod(&self.shared, pod_uid, claims).await
    }

    /// Unprepares a removed pod's claims as the kubelet does: a claim another pod still
    /// references only loses this pod's reference; the others are unprepared in one call per
    /// driver. On a failure the pod keeps its references, so calling it again retries. Returns
    /// false if the pod referenced no claim.
    pub async fn dra_remove_pod(&self, pod_uid: &str) -> Result<bool, DraError> {
        dra::remove_pod(&self.shared, pod_uid).await
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
        self.halt(true).await;
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
        self.boot().await
    }

    /// Simulates the kubelet process dying: it stops answering and every plugin connection
    /// drops, but `kubelet.sock` stays behind as a stale file that refuses connections (nobody
    /// removes it), as after a crash or `systemctl kill`. [`Kubelet::restart`] brings it back.
    pub async fn crash(&mut self) {
        self.halt(false).await;
    }

    /// Stops serving and drops every plugin connection. Sockets of plugins stay in place.
    pub async fn stop(mut self) {
        self.halt(true).await;
        self.shared.stop.cancel();
    }

    /// Deletes every socket in the folder, then serves kubelet.sock: bound first, listening
    /// only after [`SimConfig::listen_delay`], as a Go kubelet's `net.Listen` does in two steps.
    async fn boot(&mut self) -> Result<(), SimError> {
        clean_plugin_dir(&self.shared.dir);
        let path = self.socket_path();
        let io_error = |what| {
            let path = path.clone();
            move |source| SimError::Io { what, path, source }
        };
        let socket = tokio::net::UnixSocket::new_stream().map_err(io_error("cannot create"))?;
        socket.bind(&path).map_err(io_error("cannot bind"))?;
        let bound = Instant::now();
        self.shared.modify(|node| node.bound_at = Some(bound));
        if !self.shared.config.listen_delay.is_zero() {
            tokio::time::sleep(self.shared.config.listen_delay).await;
        }
        let listener = socket.listen(1024).map_err(io_error("cannot listen on"))?;
        let stop = self.shared.stop.child_token();
        *self
            .shared
            .session
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = stop.clone();
        if let Some(registry) = &self.shared.config.plugins_registry {
            plugin_watcher::spawn(self.shared.clone(), registry.clone(), stop.clone());
        }
        if let Some(path) = &self.shared.config.pod_resources_socket {
            let io_error = |what| {
                let path = path.clone();
                move |source| SimError::Io { what, path, source }
            };
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(io_error("cannot create"))?;
            }
            let _ = std::fs::remove_file(path);
            let listener = tokio::net::UnixListener::bind(path).map_err(io_error("cannot bind"))?;
            let service = pod_resources::PodResourcesService {
                shared: self.shared.clone(),
                limit: Arc::new(Mutex::new(pod_resources::RateLimit::new())),
            };
            devplug_proto::uds::spawn_server(
                tonic::transport::Server::builder().add_service(
                    devplug_proto::podresources::pod_resources_lister_server::PodResourcesListerServer::new(service),
                ),
                listener,
                stop.clone().cancelled_owned(),
                "the pod resources server".to_owned(),
            );
        }
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

    /// Stops serving kubelet.sock and ends every plugin connection of this session; removes
    /// the kubelet.sock file when `remove_socket`.
    async fn halt(&mut self, remove_socket: bool) {
        if let Some((stop, task)) = self.server.take() {
            stop.cancel();
            let _ = tokio::time::timeout(Duration::from_secs(2), task).await;
        }
        // The plugin manager's registrations die with the process (plugins register again
        // through the watcher); prepared claims stay, as the claim checkpoint keeps them.
        self.shared.modify(|node| node.dra.plugins.clear());
        if remove_socket {
            let _ = std::fs::remove_file(self.socket_path());
        }
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
