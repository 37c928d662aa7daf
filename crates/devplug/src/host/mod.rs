//! The plugin host: runs one or many resources, each on its own socket in the kubelet's
//! device-plugins folder, and keeps each registered across kubelet restarts.
//!
//! - `apply`: a new set of resources applied to a running host ([`Host::apply`], a config
//!   reload), keeping unchanged resources' sockets and streams.
//! - `dir_watch`: inotify on the folder (kubelet.sock created, sockets deleted), following the
//!   folder itself when it is missing or removed and created again.
//! - [`backoff`]: retry delays, doubling to a cap, jittered for writers to the API server
//!   (registration's start fast: a Go kubelet binds before it listens).
//! - `feed`: the backend's list through the health hold-down to the kubelet; backend swaps.
//! - `socket`: socket names, owner-only binding, stale-file cleanup.
//! - `registration`: the `Register` call on kubelet.sock.
//! - `registration_socket`: a registration socket kept offered in the plugin watcher's folder
//!   ([`RegistrationSocket`], with its [`RefusedRetry`]), for the watcher route and for DRA
//!   drivers.
//! - `resource`: one resource's serve-and-register loop.
//! - `service`: the `DevicePlugin` gRPC service (ListAndWatch, Allocate, ...).
//! - `events`: device health transitions and registration changes as [`HostEvent`]s.
//! - `status`: what each resource is doing, for readiness, metrics and tests.
//! - `watchdog`: the pod resources follower: allocated counts, devices in use, and re-registering
//!   when the kubelet's allocatable falls short of what we stream.
//! - `watcher`: one resource registered through the kubelet's plugin watcher instead
//!   (`plugins_registry/`), chosen per resource with [`Registration`].

mod apply;
pub mod backoff;
mod dir_watch;
mod events;
mod feed;
mod metrics;
mod registration;
mod registration_socket;
mod resource;
mod service;
mod socket;
mod status;
mod watchdog;
mod watcher;

pub use apply::{Applied, ApplyFailure};
pub use events::HostEvent;
pub use metrics::{MetricsSnapshot, ALLOCATE_BUCKETS};
pub use registration_socket::{FolderHealth, RefusedRetry, Registered, RegistrationSocket};
pub use socket::{
    bind_owned_socket, bind_socket, check_socket_path, instance_tag, is_instance_tag,
    remove_dead_sockets, OwnedSocket, MAX_SOCKET_PATH,
};
pub use status::ResourceStatus;
pub use watcher::{WatcherDirs, RELINK_WAIT};

use crate::backend::{Backend, Options};
use crate::device::DeviceList;
use devplug_proto::resource_name::{self, InvalidResourceName};
use dir_watch::{DirEvent, FolderState};
use feed::FeedControl;
use resource::ResourceTask;
use status::StatusCell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock};
use std::time::Duration;
use tokio::sync::{broadcast, mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use watcher::WatcherTask;

/// Why the host could not start or add a resource.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// The kubelet would refuse this resource name.
    #[error(transparent)]
    InvalidResourceName(#[from] InvalidResourceName),
    /// The resource is not served by this host.
    #[error("resource {0:?} is not served by this process")]
    UnknownResource(String),
    /// The resource is already served by this host.
    #[error("resource {0:?} is already served by this process; each resource needs one backend")]
    DuplicateResource(String),
    /// The kubelet folder cannot be watched (inotify unavailable).
    #[error("cannot watch the kubelet folder {path}")]
    Folder {
        /// The folder.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The kubelet folder's path names something that is not a folder.
    #[error(
        "the kubelet folder {0} is a file, not a folder: give the kubelet's device-plugins folder"
    )]
    NotAFolder(PathBuf),
}

/// Serves device plugin resources to the kubelet until shut down.
///
/// ```no_run
/// # async fn example(backend: impl devplug::Backend) -> Result<(), devplug::HostError> {
/// let host = devplug::Host::new(devplug::DEFAULT_KUBELET_DIR)?;
/// host.add("vendor.example/npu", backend)?;
/// devplug::shutdown_signal().await;
/// host.shutdown().await;
/// # Ok(()) }
/// ```
pub struct Host {
    dir: PathBuf,
    events: broadcast::Sender<DirEvent>,
    folder: watch::Receiver<FolderState>,
    resources: Arc<Mutex<BTreeMap<String, Running>>>,
    stop: CancellationToken,
    pod_resources: Arc<Mutex<watchdog::PodResourcesView>>,
    in_use: Arc<watch::Sender<crate::podresources::InUse>>,
    host_events: broadcast::Sender<HostEvent>,
    watcher_dirs: WatcherDirs,
    refused_retry: RefusedRetry,
    /// The plugin-watcher folder's follower, started with the first watcher-route resource.
    registry: OnceLock<(broadcast::Sender<DirEvent>, watch::Receiver<FolderState>)>,
}

struct Running {
    shared: Arc<ResourceShared>,
    settings: ResourceSettings,
    feed: mpsc::UnboundedSender<FeedControl>,
    status: StatusCell,
    stop: CancellationToken,
    task: JoinHandle<Option<String>>,
}

/// What [`Host::shutdown`] could not clean up.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Sockets of ours still in the kubelet folder, each with why it could not be removed.
    pub left_behind: Vec<String>,
}

impl ShutdownReport {
    /// True when every socket of ours was removed.
    pub fn is_clean(&self) -> bool {
        self.left_behind.is_empty()
    }
}

/// How a resource registers with the kubelet. Both routes exist on every
/// kubelet since 1.13; use one per resource, never both.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Registration {
    /// `Register` on `device-plugins/kubelet.sock`, the documented route; the plugin socket
    /// lives in `device-plugins/`.
    #[default]
    Socket,
    /// A registration socket in the kubelet's `plugins_registry/` ([`WatcherDirs`]), found by
    /// the kubelet's plugin watcher; the plugin socket lives outside `device-plugins/`, so a
    /// restarting kubelet does not delete it.
    Watcher,
}

/// How the host treats one resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResourceSettings {
    /// How long a device that came back must stay healthy before the kubelet is told.
    pub health_hold_down: Duration,
    /// How the resource registers with the kubelet.
    pub registration: Registration,
    /// The longest the host waits for the backend's first discovery
    /// ([`Backend::discovered`]) before it registers with whatever list there is.
    pub first_discovery_wait: Duration,
}

/// The default [`ResourceSettings::first_discovery_wait`]: 20 s. Registering waits for the
/// backend's first discovery so that the kubelet's first list is the truth; the bound is for a
/// driver whose initialization hangs (an `nvmlInit` that never returns), which must not keep
/// the resource away from the kubelet for good. Loading NVML and initializing 8 GPUs without
/// persistence mode takes seconds, not tens of seconds; a discovery that ends later is still
/// sent, as a second list.
pub const FIRST_DISCOVERY_WAIT: Duration = Duration::from_secs(20);

/// The hold-down used by [`Host::add`]: long enough to ride out a flapping device, short enough
/// that a recovered device is usable soon.
pub const DEFAULT_HEALTH_HOLD_DOWN: Duration = Duration::from_secs(5);

impl Default for ResourceSettings {
    fn default() -> Self {
        ResourceSettings {
            health_hold_down: DEFAULT_HEALTH_HOLD_DOWN,
            registration: Registration::Socket,
            first_discovery_wait: FIRST_DISCOVERY_WAIT,
        }
    }
}

/// What [`Host::update`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Updated {
    /// Swapped in place: same socket, streams untouched; the kubelet sees one new list.
    InPlace,
    /// The backend asks for other options, which the kubelet reads only at registration: the
    /// resource was restarted and registered again.
    Restarted,
}

/// What the socket's service and the resource loop share: the current backend and the list the
/// kubelet sees.
pub(crate) struct ResourceShared {
    pub(crate) resource: Arc<str>,
    backend: RwLock<Arc<dyn Backend>>,
    pub(crate) devices: watch::Receiver<DeviceList>,
}

impl ResourceShared {
    /// The current backend.
    pub(crate) fn backend(&self) -> Arc<dyn Backend> {
        self.backend
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn set_backend(&self, backend: Arc<dyn Backend>) {
        *self.backend.write().unwrap_or_else(|e| e.into_inner()) = backend;
    }
}

/// Waits for `backend`'s first discovery, `wait` at most; says so if it had to stop waiting.
async fn wait_discovered(resource: &str, backend: &dyn Backend, wait: Duration) {
    let started = std::time::Instant::now();
    if tokio::time::timeout(wait, backend.discovered())
        .await
        .is_err()
    {
        tracing::warn!(
            resource,
            waited = ?wait,
            "the backend's first discovery has not ended; registering with the devices found so far"
        );
    } else if started.elapsed() >= Duration::from_millis(100) {
        tracing::info!(resource, took = ?started.elapsed(), "first discovery ended");
    }
}

/// Holds a resource's registration task back until its backend's first discovery has ended.
struct FirstDiscovery {
    shared: Arc<ResourceShared>,
    wait: Duration,
    stop: CancellationToken,
}

fn first_discovery(
    shared: Arc<ResourceShared>,
    wait: Duration,
    stop: CancellationToken,
) -> FirstDiscovery {
    FirstDiscovery { shared, wait, stop }
}

impl FirstDiscovery {
    /// Runs `task` once the first discovery has ended (or the wait is over); nothing if the
    /// resource is stopped before.
    async fn then_run(
        self,
        task: impl std::future::Future<Output = Option<String>>,
    ) -> Option<String> {
        let backend = self.shared.backend();
        tokio::select! {
            _ = self.stop.cancelled() => return None,
            _ = wait_discovered(&self.shared.resource, backend.as_ref(), self.wait) => {}
        }
        drop(backend);
        task.await
    }
}

impl Host {
    /// A host for the kubelet folder `dir`. The folder is not created: the kubelet creates it.
    /// If it is missing (no kubelet yet, or a wrong path), the host waits for it without
    /// polling, and follows it if it is removed and created again. Must be called inside a tokio
    /// runtime.
    pub fn new(dir: impl Into<PathBuf>) -> Result<Host, HostError> {
        let dir = dir.into();
        if dir.exists() && !dir.is_dir() {
            return Err(HostError::NotAFolder(dir));
        }
        let stop = CancellationToken::new();
        let folder = dir_watch::watch(&dir, stop.clone()).map_err(|source| HostError::Folder {
            path: dir.clone(),
            source,
        })?;
        if let FolderState::Missing { watching } = &*folder.state.borrow() {
            tracing::info!(dir = %dir.display(), watching = %watching.display(), "the kubelet folder does not exist yet; waiting for it");
        }
        Ok(Host {
            watcher_dirs: WatcherDirs::beside(&dir),
            dir,
            events: folder.events,
            folder: folder.state,
            resources: Arc::default(),
            stop,
            pod_resources: Arc::default(),
            in_use: Arc::new(watch::Sender::new(Default::default())),
            host_events: broadcast::channel(256).0,
            refused_retry: RefusedRetry::default(),
            registry: OnceLock::new(),
        })
    }

    /// Uses `dirs` for resources that register through the plugin watcher (default:
    /// [`WatcherDirs::beside`] the kubelet folder). Call before adding resources.
    pub fn with_watcher_dirs(mut self, dirs: WatcherDirs) -> Host {
        self.watcher_dirs = dirs;
        self
    }

    /// How long a watcher-route resource waits before offering itself again after the kubelet
    /// refused it (default 1 s doubling to 60 s).
    pub fn with_refused_retry(mut self, retry: RefusedRetry) -> Host {
        self.refused_retry = retry;
        self
    }

    /// The folders of the plugin-watcher route.
    pub fn watcher_dirs(&self) -> &WatcherDirs {
        &self.watcher_dirs
    }

    /// Follows the kubelet's pod resources API on `socket` until shutdown, one call per
    /// `interval` at most (use [`crate::podresources::MIN_INTERVAL`] or more in production: the
    /// kubelet's 100 QPS are shared by every client on the node). It gives
    /// [`MetricsSnapshot::allocated`], [`Host::in_use`], and a watchdog: a resource whose
    /// allocatable at the kubelet stays below the healthy devices we stream registers again
    /// ([`MetricsSnapshot::watchdog_reregistrations`]). A kubelet without the API (or a wrong
    /// path) is logged and retried; nothing else is affected.
    pub fn watch_pod_resources(&self, socket: PathBuf, interval: Duration) {
        tokio::spawn(watchdog::run(
            socket,
            interval,
            self.resources.clone(),
            self.pod_resources.clone(),
            self.in_use.clone(),
            self.stop.clone(),
        ));
    }

    /// Device health transitions and registration changes of every resource, for operators
    /// (the cluster side turns them into Node events). A slow reader loses the oldest events.
    pub fn events(&self) -> broadcast::Receiver<HostEvent> {
        self.host_events.subscribe()
    }

    /// Devices in use by pods, per resource (any resource on the node, not only ours), from
    /// [`Host::watch_pod_resources`]; empty until it answers. For backends that act on use
    /// (sharing, cleanup of freed devices).
    pub fn in_use(&self) -> watch::Receiver<crate::podresources::InUse> {
        self.in_use.subscribe()
    }

    /// The plugin-watcher folder's follower, started on first use.
    fn registry_watch(
        &self,
    ) -> Result<(broadcast::Receiver<DirEvent>, watch::Receiver<FolderState>), HostError> {
        if let Some((events, state)) = self.registry.get() {
            return Ok((events.subscribe(), state.clone()));
        }
        let dir = &self.watcher_dirs.registry;
        let folder =
            dir_watch::watch(dir, self.stop.clone()).map_err(|source| HostError::Folder {
                path: dir.clone(),
                source,
            })?;
        let (events, state) = self.registry.get_or_init(|| (folder.events, folder.state));
        Ok((events.subscribe(), state.clone()))
    }

    /// The kubelet folder this host serves in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Starts serving `resource` from `backend`: binds its socket, waits for the kubelet if it is
    /// not there yet, registers, and re-registers after every kubelet restart.
    pub fn add(
        &self,
        resource: &str,
        backend: impl Backend,
    ) -> Result<watch::Receiver<ResourceStatus>, HostError> {
        self.add_shared(resource, Arc::new(backend))
    }

    /// Like [`Host::add`], for a backend that is already shared.
    pub fn add_shared(
        &self,
        resource: &str,
        backend: Arc<dyn Backend>,
    ) -> Result<watch::Receiver<ResourceStatus>, HostError> {
        self.add_with(resource, backend, ResourceSettings::default())
    }

    /// Like [`Host::add`], with settings.
    pub fn add_with(
        &self,
        resource: &str,
        backend: Arc<dyn Backend>,
        settings: ResourceSettings,
    ) -> Result<watch::Receiver<ResourceStatus>, HostError> {
        resource_name::validate(resource)?;
        let mut resources = self.lock();
        if resources.contains_key(resource) {
            return Err(HostError::DuplicateResource(resource.to_owned()));
        }
        let status = StatusCell::new();
        let stop = self.stop.child_token();
        let name: Arc<str> = Arc::from(resource);
        let (feed, devices) = feed::spawn(
            name.clone(),
            backend.devices(),
            settings.health_hold_down,
            stop.clone(),
        );
        let shared = Arc::new(ResourceShared {
            resource: name,
            backend: RwLock::new(backend),
            devices,
        });
        let discovered =
            first_discovery(shared.clone(), settings.first_discovery_wait, stop.clone());
        let task = match settings.registration {
            Registration::Socket => tokio::spawn(
                discovered.then_run(
                    ResourceTask {
                        shared: shared.clone(),
                        dir: self.dir.clone(),
                        socket_name: socket::instance_name(resource),
                        events: self.events.subscribe(),
                        folder: self.folder.clone(),
                        status: status.clone(),
                        stop: stop.clone(),
                    }
                    .run(),
                ),
            ),
            Registration::Watcher => {
                let (events, folder) = match self.registry_watch() {
                    Ok(watch) => watch,
                    Err(err) => {
                        stop.cancel();
                        return Err(err);
                    }
                };
                tokio::spawn(
                    discovered.then_run(
                        WatcherTask {
                            shared: shared.clone(),
                            dirs: self.watcher_dirs.clone(),
                            socket_name: socket::instance_name(resource),
                            events,
                            folder,
                            status: status.clone(),
                            stop: stop.clone(),
                            refused_retry: self.refused_retry,
                        }
                        .run(),
                    ),
                )
            }
        };
        let receiver = status.subscribe();
        events::spawn(
            shared.resource.clone(),
            shared.devices.clone(),
            status.subscribe(),
            self.host_events.clone(),
            stop.clone(),
        );
        let running = Running {
            shared,
            settings,
            feed,
            status,
            stop,
            task,
        };
        resources.insert(resource.to_owned(), running);
        Ok(receiver)
    }

    /// Replaces the backend and settings of a served resource. When the new backend asks for the
    /// same [`Options`] and the registration route is the same, the swap is in place: the socket and the kubelet's stream stay, and the
    /// kubelet sees one new device list. Otherwise the resource is restarted and registers again,
    /// because the kubelet reads options only at registration.
    pub async fn update(
        &self,
        resource: &str,
        backend: Arc<dyn Backend>,
        settings: ResourceSettings,
    ) -> Result<Updated, HostError> {
        // The new backend's first list, not an empty one, replaces the old list.
        wait_discovered(resource, backend.as_ref(), settings.first_discovery_wait).await;
        let in_place = {
            let mut resources = self.lock();
            let Some(running) = resources.get_mut(resource) else {
                return Err(HostError::UnknownResource(resource.to_owned()));
            };
            let old_options: Options = running.shared.backend().options();
            if old_options == backend.options()
                && running.settings.registration == settings.registration
            {
                let source = backend.devices();
                running.shared.set_backend(backend.clone());
                let _ = running.feed.send(FeedControl::Source(source));
                if running.settings != settings {
                    let _ = running
                        .feed
                        .send(FeedControl::HoldDown(settings.health_hold_down));
                    running.settings = settings;
                }
                true
            } else {
                false
            }
        };
        if in_place {
            return Ok(Updated::InPlace);
        }
        self.remove(resource).await;
        self.add_with(resource, backend, settings)?;
        Ok(Updated::Restarted)
    }

    /// Stops serving `resource`: ends its streams and removes its socket. The kubelet marks its
    /// devices unhealthy and drops the resource after its grace period. Returns false if the
    /// resource was not served.
    pub async fn remove(&self, resource: &str) -> bool {
        let running = self.lock().remove(resource);
        match running {
            Some(running) => {
                running.stop.cancel();
                let _ = running.task.await;
                true
            }
            None => false,
        }
    }

    /// The resources served, in name order.
    pub fn resources(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    /// The status of `resource`, if served.
    pub fn status(&self, resource: &str) -> Option<watch::Receiver<ResourceStatus>> {
        self.lock().get(resource).map(|r| r.status.subscribe())
    }

    /// Counters and state of every resource, in name order, for exporting as metrics.
    pub fn metrics(&self) -> Vec<(String, MetricsSnapshot)> {
        let (allocated, foreign, known) = {
            let view = self.pod_resources.lock().unwrap_or_else(|e| e.into_inner());
            (view.allocated.clone(), view.foreign.clone(), view.known)
        };
        self.lock()
            .iter()
            .map(|(name, r)| {
                let status = r.status.subscribe().borrow().clone();
                let devices = r.shared.devices.borrow().clone();
                let healthy = devices.healthy_count();
                let unhealthy_reasons = devices
                    .devices()
                    .iter()
                    .filter_map(|d| match &d.health {
                        crate::Health::Unhealthy { reason } => Some((d.id.clone(), reason.clone())),
                        crate::Health::Healthy => None,
                    })
                    .collect();
                let snapshot = MetricsSnapshot {
                    healthy,
                    unhealthy: devices.len() - healthy,
                    unhealthy_reasons,
                    registered: status.registered,
                    streams: status.streams,
                    list_error: status.list_error.clone(),
                    not_ready: r
                        .shared
                        .backend()
                        .not_ready()
                        .or_else(|| status.not_ready_reason()),
                    warnings: r
                        .shared
                        .backend()
                        .warnings()
                        .into_iter()
                        .map(|w| (w.kind.to_owned(), w.detail))
                        .collect(),
                    allocated: known.then(|| allocated.get(name).copied().unwrap_or(0)),
                    foreign_devices: known.then(|| foreign.get(name).copied().unwrap_or(0)),
                    ..r.status.counters.snapshot()
                };
                (name.clone(), snapshot)
            })
            .collect()
    }

    /// Whether the host is working: `Err` with the reason when it cannot follow the kubelet
    /// folder (and so would miss kubelet restarts). A missing folder is not an error: the host
    /// waits for it.
    pub fn health(&self) -> Result<(), String> {
        if let FolderState::Broken(reason) = &*self.folder.borrow() {
            return Err(reason.clone());
        }
        // The plugin watcher's folder, once a resource registers through it.
        if let Some((_, state)) = self.registry.get() {
            if let FolderState::Broken(reason) = &*state.borrow() {
                return Err(reason.clone());
            }
        }
        Ok(())
    }

    /// Whether the kubelet folder exists right now.
    pub fn folder_present(&self) -> bool {
        matches!(*self.folder.borrow(), FolderState::Present)
    }

    /// Whether the plugin watcher's folder (`plugins_registry/`) is there, once a resource
    /// registers through it (`registration: watcher`); `None` while none does.
    pub fn registry_present(&self) -> Option<bool> {
        self.registry
            .get()
            .map(|(_, state)| matches!(*state.borrow(), FolderState::Present))
    }

    /// Ready when every resource is registered and streaming to the kubelet, and no backend
    /// says it cannot serve its devices ([`Backend::not_ready`]).
    pub fn is_ready(&self) -> bool {
        let resources = self.lock();
        !resources.is_empty()
            && resources.values().all(|r| {
                r.status.subscribe().borrow().is_ready() && r.shared.backend().not_ready().is_none()
            })
    }

    /// Stops every resource: ends streams, closes listeners and removes our sockets. The report
    /// names any socket that could not be removed (e.g. a read-only folder).
    pub async fn shutdown(&self) -> ShutdownReport {
        self.stop.cancel();
        let running = std::mem::take(&mut *self.lock());
        let watcher = running
            .values()
            .any(|r| r.settings.registration == Registration::Watcher);
        let mut report = ShutdownReport::default();
        for (_, r) in running {
            if let Ok(Some(left)) = r.task.await {
                report.left_behind.push(left);
            }
        }
        // The watcher route's socket folder, made at its first bind: gone once empty (a folder
        // still holding a socket, or mounted into a container, stays; neither is an error).
        if watcher {
            let _ = std::fs::remove_dir(&self.watcher_dirs.sockets);
        }
        report
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Running>> {
        // A panic while holding this lock cannot leave the map half-updated.
        self.resources.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
