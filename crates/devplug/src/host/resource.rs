//! One resource's lifecycle with the kubelet: serve a socket, register, and keep both true.
//!
//! The loop reconciles rather than reacts: on any event it checks whether our socket file is
//! still the one we bound (the kubelet deletes every socket when it restarts) and whether the
//! current `kubelet.sock` is the one we registered with, and fixes what is not. Events come from
//! inotify; the only timers are the registration backoff and the re-registration delay after the
//! kubelet dropped our stream, and both run only while something is wrong.

use super::dir_watch::DirEvent;
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
use tokio::sync::broadcast;
use tokio::task::JoinHandle;
use tokio::time::{sleep_until, Instant};
use tokio_util::sync::CancellationToken;

const BACKOFF_START: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(10);
/// After the kubelet dropped our stream without restarting, register again after this delay
/// (the kubelet does not redial on its own, protocol.md §4.7).
const STREAM_LOST_DELAY: Duration = Duration::from_secs(1);

/// Everything one resource task needs.
pub(crate) struct ResourceTask {
    pub(crate) shared: Arc<ResourceShared>,
    pub(crate) dir: PathBuf,
    pub(crate) socket_name: String,
    pub(crate) events: broadcast::Receiver<DirEvent>,
    pub(crate) status: StatusCell,
    pub(crate) stop: CancellationToken,
}

/// A socket we bound and serve.
struct Served {
    path: PathBuf,
    identity: FileIdentity,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl Served {
    /// Stops serving: ends our streams, closes the listener, removes the file if still ours.
    async fn stop(self) {
        self.stop.cancel();
        let mut task = self.task;
        if tokio::time::timeout(Duration::from_secs(1), &mut task)
            .await
            .is_err()
        {
            task.abort();
        }
        socket::remove_if_ours(&self.path, self.identity);
    }
}

impl ResourceTask {
    pub(crate) async fn run(mut self) {
        let resource = self.shared.resource.clone();
        let socket_path = self.dir.join(&self.socket_name);
        let kubelet_socket = self.dir.join(KUBELET_SOCKET_NAME);
        socket::remove_stale(&self.dir, &resource, &socket_path).await;

        let mut served: Option<Served> = None;
        // The kubelet.sock we registered with; None means "register when one is there".
        let mut registered_with: Option<FileIdentity> = None;
        let mut backoff = BACKOFF_START;
        let mut retry_at: Option<Instant> = None;
        let mut waiting_logged = false;
        let mut last_error: Option<String> = None;
        let mut lost_streams = self.status.lost_streams();
        // A kubelet restart shows as our socket deleted and/or a new kubelet.sock. Count it once,
        // and only if we had registered with the kubelet before (a first kubelet start that wipes
        // the socket we bound while waiting is not a restart).
        let mut restart_countable = false;

        loop {
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
                    old.stop().await;
                }
                registered_with = None;
                self.status.update(|s| {
                    s.registered = false;
                    s.socket = None;
                });
                match self.serve(&socket_path) {
                    Ok(s) => {
                        self.status.update(|st| st.socket = Some(s.path.clone()));
                        served = Some(s);
                    }
                    Err(err) => {
                        tracing::error!(resource = %resource, path = %socket_path.display(), %err, "cannot bind the plugin socket");
                        retry_at = Some(Instant::now() + backoff);
                        backoff = (backoff * 2).min(BACKOFF_MAX);
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
                        restart_countable = true;
                        self.status.counters.registered();
                        backoff = BACKOFF_START;
                        retry_at = None;
                        last_error = None;
                        self.status.update(|s| {
                            s.registered = true;
                            s.registrations += 1;
                            s.last_error = None;
                        });
                    }
                    Err(err) => {
                        let message = err.to_string();
                        if last_error.as_deref() != Some(message.as_str()) {
                            tracing::warn!(resource = %resource, error = %message, retry_in = ?backoff, "registration failed; retrying");
                        } else {
                            tracing::debug!(resource = %resource, error = %message, "registration failed again");
                        }
                        self.status.counters.registration_failed();
                        self.status.update(|s| s.last_error = Some(message.clone()));
                        last_error = Some(message);
                        retry_at = Some(Instant::now() + backoff);
                        backoff = (backoff * 2).min(BACKOFF_MAX);
                    }
                }
            } else if kubelet.is_none() && !waiting_logged {
                waiting_logged = true;
                tracing::info!(resource = %resource, path = %kubelet_socket.display(), "waiting for the kubelet socket");
            }

            // 3. Sleep until something happens.
            tokio::select! {
                _ = self.stop.cancelled() => break,
                _ = sleep_until(retry_at.unwrap_or_else(far_future)), if retry_at.is_some() => {
                    retry_at = None;
                }
                changed = lost_streams.changed() => {
                    let attempt = *lost_streams.borrow_and_update();
                    if changed.is_ok() && self.status.is_current(attempt) && registered_with.is_some() {
                        tracing::info!(resource = %resource, "the kubelet closed our device stream; registering again shortly");
                        registered_with = None;
                        retry_at = Some(Instant::now() + STREAM_LOST_DELAY);
                    }
                }
                event = self.events.recv() => match event {
                    // A new kubelet.sock: register now, whatever backoff was running.
                    Ok(DirEvent::Created(name)) if name == KUBELET_SOCKET_NAME => retry_at = None,
                    // Anything else in the folder (our socket deleted, events lost): check again.
                    Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                    Err(broadcast::error::RecvError::Closed) => {
                        tracing::warn!(resource = %resource, "folder watch ended; kubelet restarts will not be noticed");
                        self.stop.cancelled().await;
                        break;
                    }
                },
            }
        }

        if let Some(s) = served.take() {
            s.stop().await;
        }
        self.status.update(|s| {
            s.registered = false;
            s.socket = None;
        });
        tracing::info!(resource = %resource, "stopped");
    }

    /// Binds a fresh socket and serves the DevicePlugin service on it.
    fn serve(&self, path: &Path) -> std::io::Result<Served> {
        let (listener, identity) = socket::bind_owner_only(path)?;
        let stop = self.stop.child_token();
        let service = PluginService {
            shared: self.shared.clone(),
            stop: stop.clone(),
            status: self.status.clone(),
        };
        let task = uds::spawn_server(
            tonic::transport::Server::builder().add_service(DevicePluginServer::new(service)),
            listener,
            stop.clone().cancelled_owned(),
            format!("the plugin server of {}", self.shared.resource),
        );
        Ok(Served {
            path: path.to_owned(),
            identity,
            stop,
            task,
        })
    }
}

fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(86_400)
}
