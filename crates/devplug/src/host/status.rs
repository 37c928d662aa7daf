//! What a resource is doing right now (socket, registration, open streams), published on a watch
//! channel so that tests, readiness probes and metrics read it without asking the resource task.

use super::metrics::Counters;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// The state of one resource's connection with the kubelet.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResourceStatus {
    /// The socket currently served, if one is bound.
    pub socket: Option<PathBuf>,
    /// Registered with the current kubelet.
    pub registered: bool,
    /// Successful registrations since the resource started.
    pub registrations: u64,
    /// Open ListAndWatch streams.
    pub streams: usize,
    /// The last registration error, cleared on success.
    pub last_error: Option<String>,
    /// Why the current device list cannot be sent (over the kubelet's 4 MiB limit); the
    /// kubelet keeps the last list it got, or waits for a first one.
    pub list_error: Option<String>,
}

impl ResourceStatus {
    /// Ready: registered, the kubelet is streaming the device list, and the list can be sent.
    pub fn is_ready(&self) -> bool {
        self.registered && self.streams > 0 && self.list_error.is_none()
    }

    /// Why the resource is not ready, in a few words; `None` when ready.
    pub fn not_ready_reason(&self) -> Option<String> {
        if let Some(err) = &self.list_error {
            return Some(format!("device list not sent: {err}"));
        }
        if !self.registered {
            return Some(match &self.last_error {
                Some(err) => format!("not registered: {err}"),
                None => "not registered with a kubelet yet".to_owned(),
            });
        }
        if self.streams == 0 {
            return Some("registered, but the kubelet has no ListAndWatch stream open".to_owned());
        }
        None
    }
}

/// Shared handle to a resource's status, plus the signal that the kubelet dropped its stream.
///
/// Streams are tagged with the registration attempt that was current when they opened. Only
/// when the last stream of the current attempt closes is the kubelet taken to have gone quiet:
/// a stream dropped by an old kubelet, or an inspector leaving while the kubelet still streams,
/// is not.
#[derive(Clone)]
pub(crate) struct StatusCell {
    tx: Arc<watch::Sender<ResourceStatus>>,
    pub(crate) counters: Arc<Counters>,
    attempt: Arc<AtomicU64>,
    open_by_attempt: Arc<Mutex<BTreeMap<u64, usize>>>,
    lost: Arc<watch::Sender<u64>>,
    relink: Arc<watch::Sender<u64>>,
}

impl StatusCell {
    pub(crate) fn new() -> Self {
        StatusCell {
            tx: Arc::new(watch::Sender::new(ResourceStatus::default())),
            counters: Arc::default(),
            attempt: Arc::new(AtomicU64::new(0)),
            open_by_attempt: Arc::default(),
            lost: Arc::new(watch::Sender::new(0)),
            relink: Arc::new(watch::Sender::new(0)),
        }
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<ResourceStatus> {
        self.tx.subscribe()
    }

    pub(crate) fn update(&self, f: impl FnOnce(&mut ResourceStatus)) {
        self.tx.send_modify(f);
    }

    /// Counts an open stream until the guard drops. A stream that ends while its socket is still
    /// served (the client left, not us) is reported as lost.
    pub(crate) fn stream_opened(&self, stop: CancellationToken) -> StreamGuard {
        self.update(|s| s.streams += 1);
        let attempt = self.attempt.load(Ordering::SeqCst);
        *self.open_streams().entry(attempt).or_default() += 1;
        StreamGuard {
            cell: self.clone(),
            stop,
            attempt,
        }
    }

    /// Records whether the device list can be sent; wakes watchers only on a change.
    pub(crate) fn set_list_error(&self, error: Option<String>) {
        self.tx.send_if_modified(|s| {
            if s.list_error == error {
                false
            } else {
                s.list_error = error;
                true
            }
        });
    }

    /// Starts a new registration attempt; streams opened from now on belong to it.
    pub(crate) fn next_attempt(&self) {
        self.attempt.fetch_add(1, Ordering::SeqCst);
    }

    /// Asks the resource's loop to register again (the pod resources watchdog saw the kubelet
    /// lose our endpoint).
    pub(crate) fn request_relink(&self) {
        self.relink.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Receives every [`StatusCell::request_relink`].
    pub(crate) fn relinks(&self) -> watch::Receiver<u64> {
        self.relink.subscribe()
    }

    /// Receives the attempt number of every stream a client dropped while we still served it.
    pub(crate) fn lost_streams(&self) -> watch::Receiver<u64> {
        self.lost.subscribe()
    }

    fn open_streams(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, usize>> {
        self.open_by_attempt
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// True if a lost stream of `attempt` belongs to the current registration.
    pub(crate) fn is_current(&self, attempt: u64) -> bool {
        attempt == self.attempt.load(Ordering::SeqCst)
    }
}

/// Keeps a stream counted while alive.
pub(crate) struct StreamGuard {
    cell: StatusCell,
    stop: CancellationToken,
    attempt: u64,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.cell
            .update(|s| s.streams = s.streams.saturating_sub(1));
        let last_of_attempt = {
            let mut open = self.cell.open_streams();
            let count = open.entry(self.attempt).or_default();
            *count = count.saturating_sub(1);
            let last = *count == 0;
            if last {
                open.remove(&self.attempt);
            }
            last
        };
        if last_of_attempt && !self.stop.is_cancelled() {
            self.cell.lost.send_replace(self.attempt);
        }
    }
}
