//! One resource registered through the kubelet's plugin watcher instead of `kubelet.sock`
//!.
//!
//! Two sockets per resource:
//! - the DevicePlugin socket, in a folder of ours *outside* `device-plugins/` (a restarting
//!   kubelet deletes every socket there, and would then dial a dead path when it re-reads the
//!   registration socket);
//! - the registration socket, in `plugins_registry/`, serving `pluginregistration.Registration`:
//!   `GetInfo` answered from memory (the kubelet gives it 1 s) and `NotifyRegistrationStatus`.
//!   It is bound under a dot-name and renamed into place (`socket::bind_owner_only`), so the
//!   watcher, which ignores dot-names, only ever sees a socket that is already served.
//!
//! The kubelet registers us by itself: at its start (a walk of the folder) and when our socket
//! appears. What we do:
//! - `Notify(false)`: the kubelet never retries a failed `RegisterPlugin` (kubernetes#133725), so
//!   after a delay we delete the registration socket and create it again;
//! - the registration socket deleted (an operator, a script): created again at once;
//! - our DevicePlugin socket deleted: both sockets are created again;
//! - the kubelet closed our stream and no new stream came within [`RELINK_WAIT`] (a kubelet that
//!   restarts comes back through its own walk well within that): the registration socket is
//!   created again, which the watcher sees as a new plugin.

use super::backoff::Backoff;
use super::dir_watch::{DirEvent, FolderState};
use super::resource::{bind_error, far_future, serve_plugin, Served};
use super::socket;
use super::status::StatusCell;
use super::ResourceShared;
use devplug_proto::constants::{PLUGIN_TYPE_DEVICE_PLUGIN, VERSION};
use devplug_proto::pluginregistration::{
    self as pr, registration_server::RegistrationServer, InfoRequest, PluginInfo,
    RegistrationStatus, RegistrationStatusResponse,
};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{broadcast, mpsc, watch};
use tokio::time::{sleep_until, Instant};
use tokio_util::sync::CancellationToken;

/// After the kubelet closed our stream, how long to wait for it to come back on its own (a
/// restarting kubelet finds our socket by its walk; its reconciler runs every second) before
/// creating the registration socket again.
pub const RELINK_WAIT: Duration = Duration::from_secs(3);
/// Binding a socket: errors here are about permissions or space, not races.
const BIND_FIRST: Duration = Duration::from_millis(100);
const BIND_MAX: Duration = Duration::from_secs(10);

/// The folders of the plugin-watcher route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatcherDirs {
    /// The kubelet's plugin-watcher folder (`/var/lib/kubelet/plugins_registry`).
    pub registry: PathBuf,
    /// Where the DevicePlugin sockets go: any folder the kubelet can reach that is not
    /// `device-plugins/` (default `/var/lib/kubelet/plugins/devplug`). Created if missing.
    pub sockets: PathBuf,
}

impl WatcherDirs {
    /// The folders beside a device-plugins folder: `../plugins_registry` and `../plugins/devplug`.
    pub fn beside(device_plugins: &Path) -> WatcherDirs {
        let root = device_plugins
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("/"));
        WatcherDirs {
            registry: root.join("plugins_registry"),
            sockets: root.join("plugins").join("devplug"),
        }
    }
}

/// How long to wait before offering the registration socket again after the kubelet refused it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefusedRetry {
    /// The first delay.
    pub first: Duration,
    /// The longest delay (the delay doubles while the kubelet keeps refusing).
    pub max: Duration,
}

impl Default for RefusedRetry {
    fn default() -> Self {
        RefusedRetry {
            first: Duration::from_secs(1),
            max: Duration::from_secs(60),
        }
    }
}

/// What `NotifyRegistrationStatus` said, tagged with the registration socket it came through.
struct Note {
    generation: u64,
    registered: bool,
    error: String,
}

/// The `pluginregistration.Registration` service of one registration socket.
struct RegistrationService {
    info: PluginInfo,
    generation: u64,
    notes: mpsc::UnboundedSender<Note>,
}

#[tonic::async_trait]
impl pr::registration_server::Registration for RegistrationService {
    async fn get_info(
        &self,
        _: tonic::Request<InfoRequest>,
    ) -> Result<tonic::Response<PluginInfo>, tonic::Status> {
        Ok(tonic::Response::new(self.info.clone()))
    }

    async fn notify_registration_status(
        &self,
        request: tonic::Request<RegistrationStatus>,
    ) -> Result<tonic::Response<RegistrationStatusResponse>, tonic::Status> {
        let status = request.into_inner();
        let _ = self.notes.send(Note {
            generation: self.generation,
            registered: status.plugin_registered,
            error: status.error,
        });
        Ok(tonic::Response::new(RegistrationStatusResponse {}))
    }
}

/// Everything one watcher-route resource task needs.
pub(crate) struct WatcherTask {
    pub(crate) shared: Arc<ResourceShared>,
    pub(crate) dirs: WatcherDirs,
    pub(crate) socket_name: String,
    pub(crate) events: broadcast::Receiver<DirEvent>,
    pub(crate) folder: watch::Receiver<FolderState>,
    pub(crate) status: StatusCell,
    pub(crate) stop: CancellationToken,
    pub(crate) refused_retry: RefusedRetry,
}

impl WatcherTask {
    /// Runs until stopped; returns the socket it could not remove at the end, if any.
    pub(crate) async fn run(mut self) -> Option<String> {
        let resource = self.shared.resource.clone();
        let plugin_path = self.dirs.sockets.join(&self.socket_name);
        let registration_path = self.dirs.registry.join(&self.socket_name);
        let (notes_tx, mut notes) = mpsc::unbounded_channel();
        let mut lost_streams = self.status.lost_streams();
        let mut relinks = self.status.relinks();

        let mut plugin: Option<Served> = None;
        let mut registration: Option<Served> = None;
        let mut generation: u64 = 0;
        // The registration socket generation the kubelet last accepted.
        let mut accepted: Option<u64> = None;
        let mut bind_backoff = Backoff::new(BIND_FIRST, BIND_MAX);
        let mut refused_backoff = Backoff::new(self.refused_retry.first, self.refused_retry.max);
        let mut bind_at: Option<Instant> = None;
        let mut offer_at: Option<Instant> = None;
        let mut relink_check: Option<Instant> = None;
        let mut folder_logged = false;
        let mut cleaned = false;

        loop {
            let folder_present = matches!(*self.folder.borrow_and_update(), FolderState::Present);
            let bind_due = bind_at.is_none_or(|at| at <= Instant::now());
            if !cleaned && folder_present {
                cleaned = true;
                socket::remove_stale(&self.dirs.registry, &resource, &registration_path).await;
                socket::remove_stale(&self.dirs.sockets, &resource, &plugin_path).await;
            }

            // 1. Our DevicePlugin socket must be the file we bound.
            if !plugin.as_ref().is_some_and(Served::is_linked) {
                if let Some(old) = plugin.take() {
                    tracing::info!(resource = %resource, path = %old.path.display(), "our plugin socket was removed; binding a fresh one");
                    let _ = old.stop().await;
                    // The kubelet must dial the new socket: offer the registration again.
                    if let Some(old) = registration.take() {
                        let _ = old.stop().await;
                    }
                }
                self.status.update(|s| {
                    s.registered = false;
                    s.socket = None;
                });
                if bind_due {
                    let bound = make_private_dir(&self.dirs.sockets).and_then(|()| {
                        serve_plugin(&self.shared, &self.status, &self.stop, &plugin_path)
                    });
                    match bound {
                        Ok(served) => {
                            bind_at = None;
                            bind_backoff.reset();
                            self.status.update(|s| s.socket = Some(served.path.clone()));
                            plugin = Some(served);
                        }
                        Err(err) => {
                            let delay = bind_backoff.next_delay();
                            tracing::error!(resource = %resource, path = %plugin_path.display(), error = %bind_error(&err), retry_in = ?delay, "cannot bind the plugin socket");
                            bind_at = Some(Instant::now() + delay);
                        }
                    }
                }
            }

            // 2. The registration socket must be there (unless a refusal delay runs).
            let offer_due = offer_at.is_none_or(|at| at <= Instant::now());
            if plugin.is_some() && !registration.as_ref().is_some_and(Served::is_linked) {
                if let Some(old) = registration.take() {
                    tracing::info!(resource = %resource, path = %old.path.display(), "our registration socket was removed; creating it again");
                    let _ = old.stop().await;
                    self.status.update(|s| s.registered = false);
                }
                if !folder_present {
                    if !folder_logged {
                        folder_logged = true;
                        tracing::info!(resource = %resource, dir = %self.dirs.registry.display(), "waiting for the kubelet's plugin-watcher folder");
                    }
                } else if offer_due && bind_due {
                    folder_logged = false;
                    generation += 1;
                    self.status.next_attempt();
                    match self.offer(&plugin_path, &registration_path, generation, &notes_tx) {
                        Ok(served) => {
                            offer_at = None;
                            bind_backoff.reset();
                            tracing::info!(resource = %resource, path = %registration_path.display(), "registration socket ready for the kubelet's plugin watcher");
                            registration = Some(served);
                        }
                        Err(err) => {
                            let delay = bind_backoff.next_delay();
                            tracing::error!(resource = %resource, path = %registration_path.display(), error = %bind_error(&err), retry_in = ?delay, "cannot bind the registration socket");
                            bind_at = Some(Instant::now() + delay);
                        }
                    }
                }
            }

            // 3. Sleep until something happens.
            let wake_at = [bind_at, offer_at, relink_check]
                .into_iter()
                .flatten()
                .min();
            tokio::select! {
                _ = self.stop.cancelled() => break,
                _ = sleep_until(wake_at.unwrap_or_else(far_future)), if wake_at.is_some() => {
                    let now = Instant::now();
                    if bind_at.is_some_and(|at| at <= now) {
                        bind_at = None;
                    }
                    if offer_at.is_some_and(|at| at <= now) {
                        offer_at = None;
                    }
                    if relink_check.is_some_and(|at| at <= now) {
                        relink_check = None;
                        let streams = self.status.subscribe().borrow().streams;
                        if streams == 0 {
                            if let Some(old) = registration.take() {
                                tracing::info!(resource = %resource, "the kubelet did not come back for our devices; offering the registration socket again");
                                let _ = old.stop().await;
                            }
                        }
                    }
                }
                note = notes.recv() => {
                    let Some(note) = note else { break };
                    if note.generation != generation {
                        continue;
                    }
                    if note.registered {
                        if accepted == Some(generation) {
                            // Registered again through the same socket: a new kubelet found it.
                            self.status.counters.kubelet_restarted();
                        }
                        accepted = Some(generation);
                        refused_backoff.reset();
                        relink_check = None;
                        self.status.counters.registered();
                        tracing::info!(resource = %resource, "registered with the kubelet through the plugin watcher");
                        self.status.update(|s| {
                            s.registered = true;
                            s.registrations += 1;
                            s.last_error = None;
                        });
                    } else {
                        let delay = refused_backoff.next_delay();
                        tracing::warn!(resource = %resource, error = %note.error, retry_in = ?delay, "the kubelet refused the registration; offering it again after a delay");
                        self.status.counters.registration_failed();
                        self.status.update(|s| {
                            s.registered = false;
                            s.last_error = Some(format!("the kubelet refused the registration: {}", note.error));
                        });
                        if let Some(old) = registration.take() {
                            let _ = old.stop().await;
                        }
                        offer_at = Some(Instant::now() + delay);
                    }
                }
                changed = lost_streams.changed() => {
                    let attempt = *lost_streams.borrow_and_update();
                    if changed.is_ok() && self.status.is_current(attempt) && registration.is_some() {
                        self.status.update(|s| s.registered = false);
                        relink_check = Some(Instant::now() + RELINK_WAIT);
                        tracing::info!(resource = %resource, "the kubelet closed our device stream; waiting for it to come back");
                    }
                }
                changed = relinks.changed() => {
                    if changed.is_ok() {
                        if let Some(old) = registration.take() {
                            tracing::warn!(resource = %resource, "the kubelet's allocatable is short of our healthy devices; offering the registration socket again");
                            let _ = old.stop().await;
                            self.status.update(|s| s.registered = false);
                        }
                    }
                }
                changed = self.folder.changed() => {
                    if changed.is_err() {
                        self.stop.cancelled().await;
                        break;
                    }
                    bind_at = None;
                    bind_backoff.reset();
                }
                event = self.events.recv() => match event {
                    Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                    Err(broadcast::error::RecvError::Closed) => {
                        self.stop.cancelled().await;
                        break;
                    }
                },
            }
        }

        // The registration socket first: the kubelet deregisters us, then the endpoint goes.
        let mut left = None;
        if let Some(served) = registration.take() {
            left = served.stop().await;
        }
        if let Some(served) = plugin.take() {
            left = served.stop().await.or(left);
        }
        self.status.update(|s| {
            s.registered = false;
            s.socket = None;
        });
        tracing::info!(resource = %resource, "stopped");
        left
    }

    /// Binds and serves the registration socket, generation `generation`.
    fn offer(
        &self,
        plugin_path: &Path,
        registration_path: &Path,
        generation: u64,
        notes: &mpsc::UnboundedSender<Note>,
    ) -> std::io::Result<Served> {
        let service = RegistrationService {
            info: PluginInfo {
                r#type: PLUGIN_TYPE_DEVICE_PLUGIN.to_owned(),
                name: self.shared.resource.to_string(),
                endpoint: plugin_path.display().to_string(),
                supported_versions: vec![VERSION.to_owned()],
            },
            generation,
            notes: notes.clone(),
        };
        Served::start(
            registration_path,
            tonic::transport::Server::builder().add_service(RegistrationServer::new(service)),
            self.stop.child_token(),
            format!("the registration socket of {}", self.shared.resource),
        )
    }
}

/// Creates `dir` (and its parents) if missing; a new folder is owner-only.
fn make_private_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}
