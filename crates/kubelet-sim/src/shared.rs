//! `Shared`: the simulated kubelet's state and settings that its handle
//! ([`Kubelet`](crate::Kubelet)), the Registration service, the stream consumers, the plugin
//! watcher, the pod resources server and the DRA side share, with the version that wakes
//! waiters.

use crate::config::SimConfig;
use crate::state::NodeState;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// State shared by the handle, the Registration service and the stream consumers.
pub(crate) struct Shared {
    pub(crate) dir: PathBuf,
    /// Cancelled when this kubelet process "dies" (restart, crash, stop): ends every plugin
    /// connection it made. Replaced at each boot.
    pub(crate) session: Mutex<CancellationToken>,
    pub(crate) config: SimConfig,
    pub(crate) state: Mutex<NodeState>,
    pub(crate) version: watch::Sender<u64>,
    pub(crate) admission: tokio::sync::Mutex<()>,
    /// Cancelled when the simulator stops; parent of every endpoint's token.
    pub(crate) stop: CancellationToken,
    /// How many of the next dials back to a plugin fail (fault injection).
    pub(crate) failing_connects: std::sync::atomic::AtomicUsize,
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
