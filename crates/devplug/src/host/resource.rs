//! One resource's lifecycle with the kubelet: serve a socket, register, and keep both true.
//!
//! The loop reconciles rather than reacts: on any event it checks whether our socket file is
//! still the one we bound (the kubelet deletes every socket when it restarts) and whether the
//! current `kubelet.sock` is the one we registered with, and fixes what is not. Events come from
//! inotify; the only timers are retry delays, and they run only while something is wrong.
//!
//! Two kubelet habits shape the retries:
//! - a Go kubelet creates `kubelet.sock` before it listens, so the first dial is often refused:
//!   retries start at 1 ms, and a new `kubelet.sock` starts the sequence again;
//! - kubelets up to 1.36 disconnect whichever client holds the resource name when any stream of
//!   it ends, so an old instance stopping (a rolling upgrade) or an old stream's late end cuts
//!   off our newer registration: when the kubelet closes a stream that was live, we register
//!   again at once.

use super::backoff::Backoff;
use super::dir_watch::{DirEvent, FolderState};
use super::registration::register;
use super::service::PluginService;
use super::socket::{self, FileIdentity};
use super::status::StatusCell;
use super::ResourceShared;
use devplug_proto::constants::KUBELET_SOCKET_NAME;
use devplug_proto::uds;
use devplug_proto::v1beta1::device_plugin_server::DevicePluginServer;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{broadcast, watch};
use tokio::task::JoinHandle;
use tokio::time::{sleep_until, Instant};
use tokio_util::sync::CancellationToken;

/// Registration retries: from 1 ms (a refused dial during the kubelet's bind→listen gap) to 10 s.
const REGISTER_FIRST: Duration = Duration::from_millis(1);
const REGISTER_MAX: Duration = Duration::from_secs(10);
/// A refused registration (the kubelet answered no) is not a race: wait at least this long.
const REFUSED_MIN: Duration = Duration::from_millis(100);
/// Binding our socket: errors here are about permissions or space, not races.
const BIND_FIRST: Duration = Duration::from_millis(100);
/// After the kubelet dropped our stream without restarting, we register again at once (the
/// kubelet does not redial on its own). If it drops the new stream within
/// this long too, the next attempt waits, doubling from 1 ms up to 1 s.
const RELINK_CALM: Duration = Duration::from_secs(1);

/// Everything one resource task needs.
pub(crate) struct ResourceTask {
    pub(crate) shared: Arc<ResourceShared>,
    pub(crate) dir: PathBuf,
    pub(crate) socket_name: String,
    pub(crate) events: broadcast::Receiver<DirEvent>,
    pub(crate) folder: watch::Receiver<FolderState>,
    pub(crate) status: StatusCell,
    pub(crate) stop: CancellationToken,
}

/// A socket we bound and serve.
pub(crate) struct Served {
    pub(crate) path: PathBuf,
    pub(crate) identity: FileIdentity,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl Served {
    /// Serves `router` on a socket freshly bound (owner-only, under a dot-name, then renamed into
    /// place) at `path`, until `stop` is cancelled.
    pub(crate) fn start(
        path: &Path,
        router: tonic::transport::server::Router,
        stop: CancellationToken,
        what: String,
    ) -> std::io::Result<Served> {
        let (listener, identity) = socket::bind_owner_only(path)?;
        let task = uds::spawn_server(router, listener, stop.clone().cancelled_owned(), what);
        Ok(Served {
            path: path.to_owned(),
            identity,
            stop,
            task,
        })
    }

    /// Whether the file at our path is still the socket we bound.
    pub(crate) fn is_linked(&self) -> bool {
        FileIdentity::of(&self.path) == Some(self.identity)
    }
}

impl Served {
    /// Stops serving: ends our streams, closes the listener, removes the file if still ours.
    /// Returns what could not be removed, with why.
    pub(crate) async fn stop(self) -> Option<String> {
        self.stop.cancel();
        let mut task = self.task;
        if tokio::time::timeout(Duration::from_secs(1), &mut task)
            .await
            .is_err()
        {
            task.abort();
        }
        match socket::remove_if_ours(&self.path, self.identity) {
            Ok(()) => None,
            Err(err) => {
                tracing::warn!(path = %self.path.display(), %err, "cannot remove our socket");
                Some(format!("{}: {err}", self.path.display()))
            }
        }
    }
}

impl ResourceTask {
    /// Runs until stopped; returns the socket it could not remove at the end, if any.
    pub(crate) async fn run(mut self) -> Option<String> {
        let resource = self.shared.resource.clone();
        let socket_path = self.dir.join(&self.socket_name);
        let kubelet_socket = self.dir.join(KUBELET_SOCKET_NAME);
        socket::remove_stale(&self.dir, &resource, &socket_path).await;

        let mut served: Option<Served> = None;
        // The kubelet.sock we registered with; None means "register when one is there".
        let mut registered_with: Option<FileIdentity> = None;
        let mut registered_at: Option<Instant> = None;
        let mut register_backoff = Backoff::new(REGISTER_FIRST, REGISTER_MAX);
        let mut bind_backoff = Backoff::new(BIND_FIRST, REGISTER_MAX);
        let mut relink_backoff = Backoff::new(REGISTER_FIRST, RELINK_CALM);
        let mut retry_at: Option<Instant> = None;
        let mut bind_at: Option<Instant> = None;
        let mut waiting_logged = false;
        let mut folder_logged = false;
        let mut last_error: Option<String> = None;
        let mut lost_streams = self.status.lost_streams();
        let mut relinks = self.status.relinks();
        // A kubelet restart shows as our socket deleted and/or a new kubelet.sock. Count it once,
        // and only if we had registered with the kubelet before (a first kubelet start that wipes
        // the socket we bound while waiting is not a restart).
        let mut restart_countable = false;

        loop {
            let folder_present = matches!(*self.folder.borrow_and_update(), FolderState::Present);
            // 1. Our socket must be the file we bound.
            let linked = served
                .as_ref()
                .is_some_and(|s| FileIdentity::of(&s.path) == Some(s.identity));
            if !linked {
                if let Some(old) = served.take() {
                    if restart_countable {
                        restart_countable = false;
                        self.status.counters.kubelet_restarted();
                    }
                    tracing::info!(resource = %resource, "our socket was removed (kubelet restart?); binding a fresh one");
                    let _ = old.stop().await;
                }
                registered_with = None;
                self.status.update(|s| {
                    s.registered = false;
                    s.socket = None;
                });
                let bind_due = bind_at.is_none_or(|at| at <= Instant::now());
                if !folder_present {
                    if !folder_logged {
                        folder_logged = true;
                        tracing::info!(resource = %resource, dir = %self.dir.display(), "waiting for the kubelet folder");
                    }
                } else if bind_due {
                    folder_logged = false;
                    match self.serve(&socket_path) {
                        Ok(s) => {
                            bind_at = None;
                            bind_backoff.reset();
                            self.status.update(|st| st.socket = Some(s.path.clone()));
                            served = Some(s);
                        }
                        Err(err) => {
                            let delay = bind_backoff.next_delay();
                            tracing::error!(resource = %resource, path = %socket_path.display(), error = %bind_error(&err), retry_in = ?delay, "cannot bind the plugin socket");
                            bind_at = Some(Instant::now() + delay);
                        }
                    }
                }
            }

            // 2. Register with the kubelet that is there now, unless we already did.
            let kubelet = FileIdentity::of(&kubelet_socket);
            let due = retry_at.is_none_or(|at| at <= Instant::now());
            if registered_with.is_some() && kubelet != registered_with && restart_countable {
                // A new kubelet.sock while we were registered: a kubelet restart.
                restart_countable = false;
                self.status.counters.kubelet_restarted();
            }
            if served.is_some() && kubelet.is_some() && kubelet != registered_with && due {
                waiting_logged = false;
                self.status.update(|s| s.registered = false);
                self.status.next_attempt();
                let options = self.shared.backend().options();
                let attempt = register(&kubelet_socket, &resource, &self.socket_name, options);
                let outcome = tokio::select! {
                    _ = self.stop.cancelled() => break,
                    outcome = attempt => outcome,
                };
                match outcome {
                    Ok(()) => {
                        tracing::info!(resource = %resource, endpoint = %self.socket_name, "registered with the kubelet");
                        registered_with = kubelet;
                        registered_at = Some(Instant::now());
                        restart_countable = true;
                        self.status.counters.registered();
                        register_backoff.reset();
                        retry_at = None;
                        last_error = None;
                        self.status.update(|s| {
                            s.registered = true;
                            s.registrations += 1;
                            s.last_error = None;
                        });
                    }
                    Err(err) => {
                        let mut delay = register_backoff.next_delay();
                        if err.is_refusal() {
                            delay = delay.max(REFUSED_MIN);
                        }
                        let message = err.to_string();
                        if last_error.as_deref() != Some(message.as_str()) {
                            // The first refused dial of a kubelet that is still starting is
                            // expected; say so only if it lasts.
                            if delay < REFUSED_MIN {
                                tracing::debug!(resource = %resource, error = %message, retry_in = ?delay, "registration failed; retrying");
                            } else {
                                tracing::warn!(resource = %resource, error = %message, retry_in = ?delay, "registration failed; retrying");
                                last_error = Some(message.clone());
                            }
                        } else {
                            tracing::debug!(resource = %resource, error = %message, "registration failed again");
                        }
                        self.status.counters.registration_failed();
                        self.status.update(|s| s.last_error = Some(message));
                        retry_at = Some(Instant::now() + delay);
                    }
                }
            } else if kubelet.is_none() && folder_present && !waiting_logged {
                waiting_logged = true;
                tracing::info!(resource = %resource, path = %kubelet_socket.display(), "waiting for the kubelet socket");
            }

            // 3. Sleep until something happens.
            let wake_at = match (retry_at, bind_at) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            tokio::select! {
                _ = self.stop.cancelled() => break,
                _ = sleep_until(wake_at.unwrap_or_else(far_future)), if wake_at.is_some() => {
                    let now = Instant::now();
                    if retry_at.is_some_and(|at| at <= now) {
                        retry_at = None;
                    }
                    if bind_at.is_some_and(|at| at <= now) {
                        bind_at = None;
                    }
                }
                changed = lost_streams.changed() => {
                    let attempt = *lost_streams.borrow_and_update();
                    if changed.is_ok() && self.status.is_current(attempt) && registered_with.is_some() {
                        registered_with = None;
                        // At once, unless the kubelet keeps dropping us right after registering.
                        let calm = registered_at.is_none_or(|at| at.elapsed() >= RELINK_CALM);
                        if calm {
                            relink_backoff.reset();
                            retry_at = None;
                        } else {
                            retry_at = Some(Instant::now() + relink_backoff.next_delay());
                        }
                        tracing::info!(resource = %resource, "the kubelet closed our device stream; registering again");
                    }
                }
                changed = relinks.changed() => {
                    if changed.is_ok() && registered_with.is_some() {
                        registered_with = None;
                        retry_at = None;
                        tracing::warn!(resource = %resource, "the kubelet's allocatable is short of our healthy devices; registering again");
                    }
                }
                changed = self.folder.changed() => {
                    if changed.is_err() {
                        // The folder watch ended: only at shutdown.
                        self.stop.cancelled().await;
                        break;
                    }
                    // The folder came back: bind at once.
                    bind_at = None;
                    bind_backoff.reset();
                }
                event = self.events.recv() => match event {
                    // A new kubelet.sock: a new kubelet. Register now, and forget the delay that
                    // grew while the old one was down.
                    Ok(DirEvent::Created(name)) if name == KUBELET_SOCKET_NAME => {
                        retry_at = None;
                        register_backoff.reset();
                    }
                    // Anything else in the folder (our socket deleted, events lost): check again.
                    Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                    Err(broadcast::error::RecvError::Closed) => {
                        self.stop.cancelled().await;
                        break;
                    }
                },
            }
        }

        let left = match served.take() {
            Some(s) => s.stop().await,
            None => None,
        };
        self.status.update(|s| {
            s.registered = false;
            s.socket = None;
        });
        tracing::info!(resource = %resource, "stopped");
        left
    }

    /// Binds a fresh socket and serves the DevicePlugin service on it.
    fn serve(&self, path: &Path) -> std::io::Result<Served> {
        serve_plugin(&self.shared, &self.status, &self.stop, path)
    }
}

/// Binds a fresh socket at `path` and serves the resource's DevicePlugin service on it.
pub(crate) fn serve_plugin(
    shared: &Arc<ResourceShared>,
    status: &StatusCell,
    parent: &CancellationToken,
    path: &Path,
) -> std::io::Result<Served> {
    let stop = parent.child_token();
    let service = PluginService {
        shared: shared.clone(),
        stop: stop.clone(),
        status: status.clone(),
    };
    Served::start(
        path,
        tonic::transport::Server::builder().add_service(DevicePluginServer::new(service)),
        stop,
        format!("the plugin server of {}", shared.resource),
    )
}

/// A bind error, with the fix where there is an obvious one.
pub(crate) fn bind_error(err: &std::io::Error) -> String {
    match err.kind() {
        std::io::ErrorKind::PermissionDenied => format!(
            "{err}: the kubelet folder is not writable by this user; run devplug as root (the \
             kubelet's folder is root's), or give it write access to the folder"
        ),
        std::io::ErrorKind::ReadOnlyFilesystem => {
            format!("{err}: the kubelet folder is read-only; mount it read-write")
        }
        _ => err.to_string(),
    }
}

pub(crate) fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(86_400)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bind_errors_say_what_to_do() {
        let denied = std::io::Error::from(std::io::ErrorKind::PermissionDenied);
        assert!(bind_error(&denied).contains("run devplug as root"));
        let read_only = std::io::Error::from(std::io::ErrorKind::ReadOnlyFilesystem);
        assert!(bind_error(&read_only).contains("read-only"));
        let other = std::io::Error::from(std::io::ErrorKind::AddrInUse);
        assert_eq!(bind_error(&other), other.to_string());
    }
}
