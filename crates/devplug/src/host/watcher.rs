//! One resource registered through the kubelet's plugin watcher instead of `kubelet.sock`
//!.
//!
//! Two sockets per resource:
//! - the DevicePlugin socket, in a folder of ours *outside* `device-plugins/` (a restarting
//!   kubelet deletes every socket there, and would then dial a dead path when it re-reads the
//!   registration socket);
//! - the registration socket, in `plugins_registry/`, kept offered by a
//!   [`RegistrationSocket`](super::RegistrationSocket) (the building block the DRA driver uses
//!   too): bound under a dot-name and renamed into place, created again when deleted, offered
//!   again after a delay when the kubelet refused it.
//!
//! The kubelet registers us by itself: at its start (a walk of the folder) and when our socket
//! appears. What this task adds:
//! - our DevicePlugin socket deleted: both sockets are created again;
//! - the kubelet closed our stream and no new stream came within [`RELINK_WAIT`] (a kubelet that
//!   restarts comes back through its own walk well within that): the registration socket is
//!   created again, which the watcher sees as a new plugin.

use super::backoff::Backoff;
use super::dir_watch::{next_news, DirEvent, FolderNews, FolderState};
use super::registration_socket::{Offering, RefusedRetry, RegistrationEvent, RegistrationSocket};
use super::resource::{bind_error, far_future, serve_plugin, Served};
use super::socket;
use super::status::StatusCell;
use super::ResourceShared;
use devplug_proto::constants::{PLUGIN_TYPE_DEVICE_PLUGIN, VERSION};
use devplug_proto::pluginregistration::PluginInfo;
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
        let (reports_tx, mut reports) = mpsc::unbounded_channel();
        let mut lost_streams = self.status.lost_streams();
        let mut relinks = self.status.relinks();

        let mut plugin: Option<Served> = None;
        let mut registration: Option<RegistrationSocket> = None;
        let mut bind_backoff = Backoff::new(BIND_FIRST, BIND_MAX);
        let mut bind_at: Option<Instant> = None;
        let mut relink_check: Option<Instant> = None;
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

            // 2. Once the plugin socket is served, the registration socket is kept offered.
            if plugin.is_some() && registration.is_none() {
                let status = self.status.clone();
                registration = Some(RegistrationSocket::start_with(
                    Offering {
                        info: PluginInfo {
                            r#type: PLUGIN_TYPE_DEVICE_PLUGIN.to_owned(),
                            name: resource.to_string(),
                            endpoint: plugin_path.display().to_string(),
                            supported_versions: vec![VERSION.to_owned()],
                        },
                        path: registration_path.clone(),
                        refused_retry: self.refused_retry,
                        events: self.events.resubscribe(),
                        folder: self.folder.clone(),
                        on_offer: Some(Arc::new(move || status.next_attempt())),
                        report: Some(reports_tx.clone()),
                    },
                    self.stop.child_token(),
                ));
            }

            // 3. Sleep until something happens.
            let wake_at = [bind_at, relink_check].into_iter().flatten().min();
            tokio::select! {
                _ = self.stop.cancelled() => break,
                _ = sleep_until(wake_at.unwrap_or_else(far_future)), if wake_at.is_some() => {
                    let now = Instant::now();
                    if bind_at.is_some_and(|at| at <= now) {
                        bind_at = None;
                    }
                    if relink_check.is_some_and(|at| at <= now) {
                        relink_check = None;
                        let streams = self.status.subscribe().borrow().streams;
                        if streams == 0 {
                            if let Some(socket) = &registration {
                                tracing::info!(resource = %resource, "the kubelet did not come back for our devices; offering the registration socket again");
                                socket.reoffer();
                            }
                        }
                    }
                }
                report = reports.recv() => {
                    let Some(report) = report else { break };
                    if matches!(report, RegistrationEvent::Registered { .. }) {
                        relink_check = None;
                    }
                    self.on_registration(report);
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
                        if let Some(socket) = &registration {
                            tracing::warn!(resource = %resource, "the kubelet's allocatable is short of our healthy devices; offering the registration socket again");
                            socket.reoffer();
                            self.status.update(|s| s.registered = false);
                        }
                    }
                }
                news = next_news(&mut self.folder, &mut self.events) => match news {
                    // The folder came or went: bind at once when it is there.
                    FolderNews::State => {
                        bind_at = None;
                        bind_backoff.reset();
                    }
                    FolderNews::Inside => {}
                    FolderNews::Ended => {
                        self.stop.cancelled().await;
                        break;
                    }
                },
            }
        }

        // The registration socket first: the kubelet deregisters us, then the endpoint goes.
        let mut left = None;
        if let Some(socket) = registration.take() {
            left = socket.stop().await;
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

    /// The registration socket's news, into this resource's status and counters.
    fn on_registration(&self, report: RegistrationEvent) {
        let resource = &self.shared.resource;
        match report {
            RegistrationEvent::Offered | RegistrationEvent::Withdrawn => {
                self.status.update(|s| s.registered = false);
            }
            RegistrationEvent::Registered { again } => {
                if again {
                    // Registered again through the same socket: a new kubelet found it.
                    self.status.counters.kubelet_restarted();
                }
                self.status.counters.registered();
                tracing::info!(resource = %resource, "registered with the kubelet through the plugin watcher");
                self.status.update(|s| {
                    s.registered = true;
                    s.registrations += 1;
                    s.last_error = None;
                });
            }
            RegistrationEvent::Refused { error } => {
                self.status.counters.registration_failed();
                self.status.update(|s| {
                    s.registered = false;
                    s.last_error = Some(format!("the kubelet refused the registration: {error}"));
                });
            }
        }
    }
}

/// Creates `dir` (and its parents) if missing; a new folder is owner-only.
fn make_private_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}
