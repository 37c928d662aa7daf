//! The plugin host: runs one or many resources, each on its own socket in the kubelet's
//! device-plugins folder, and keeps each registered across kubelet restarts.
//!
//! - `dir_watch`: inotify on the folder (kubelet.sock created, sockets deleted).
//! - `socket`: socket names, owner-only binding, stale-file cleanup.
//! - `registration`: the `Register` call on kubelet.sock.
//! - `resource`: one resource's serve-and-register loop.
//! - `service`: the `DevicePlugin` gRPC service (ListAndWatch, Allocate, ...).
//! - `status`: what each resource is doing, for readiness, metrics and tests.

mod dir_watch;
mod registration;
mod resource;
mod service;
mod socket;
mod status;

pub use status::ResourceStatus;

use crate::backend::Backend;
use devplug_proto::resource_name::{self, InvalidResourceName};
use dir_watch::DirEvent;
use resource::ResourceTask;
use status::StatusCell;
use std::collections::BTreeMap;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::{broadcast, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Why the host could not start or add a resource.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// The kubelet would refuse this resource name.
    #[error(transparent)]
    InvalidResourceName(#[from] InvalidResourceName),
    /// The resource is already served by this host.
    #[error("resource {0:?} is already served by this process; each resource needs one backend")]
    DuplicateResource(String),
    /// The kubelet folder cannot be created or watched.
    #[error("cannot watch the kubelet folder {path}: {source}")]
    Folder {
        /// The folder.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
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
    resources: Mutex<BTreeMap<String, Running>>,
    stop: CancellationToken,
}

struct Running {
    status: StatusCell,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl Host {
    /// A host for the kubelet folder `dir` (created with mode 0750 if missing, as the kubelet
    /// does). Must be called inside a tokio runtime.
    pub fn new(dir: impl Into<PathBuf>) -> Result<Host, HostError> {
        let dir = dir.into();
        let folder_error = |source| HostError::Folder {
            path: dir.clone(),
            source,
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o750)
            .create(&dir)
            .map_err(folder_error)?;
        let stop = CancellationToken::new();
        let events = dir_watch::watch(&dir, stop.clone()).map_err(folder_error)?;
        Ok(Host {
            dir,
            events,
            resources: Mutex::new(BTreeMap::new()),
            stop,
        })
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
        resource_name::validate(resource)?;
        let mut resources = self.lock();
        if resources.contains_key(resource) {
            return Err(HostError::DuplicateResource(resource.to_owned()));
        }
        let status = StatusCell::new();
        let stop = self.stop.child_token();
        let task = ResourceTask {
            resource: Arc::from(resource),
            backend,
            dir: self.dir.clone(),
            socket_name: socket::instance_name(resource),
            events: self.events.subscribe(),
            status: status.clone(),
            stop: stop.clone(),
        };
        let task = tokio::spawn(task.run());
        let receiver = status.subscribe();
        resources.insert(resource.to_owned(), Running { status, stop, task });
        Ok(receiver)
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

    /// Ready when every resource is registered and streaming to the kubelet.
    pub fn is_ready(&self) -> bool {
        let resources = self.lock();
        !resources.is_empty()
            && resources
                .values()
                .all(|r| r.status.subscribe().borrow().is_ready())
    }

    /// Stops every resource: ends streams, closes listeners and removes our sockets.
    pub async fn shutdown(self) {
        self.stop.cancel();
        let running = std::mem::take(&mut *self.lock());
        for (_, r) in running {
            let _ = r.task.await;
        }
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
