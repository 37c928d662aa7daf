//! What a running driver can say about itself, for probes and metrics: whether its slices are
//! published and current, whether the kubelet registered it, and how its claim calls went. A cheap, cloneable view: it
//! reads the publisher's counters and the latest-value channels, never the API server.

use crate::kubelet::Registered;
use crate::slices::{Published, SliceCounters};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use tokio::sync::watch;

/// A running driver's state, as probes and metrics read it.
#[derive(Debug, Clone)]
pub struct DraHealth {
    /// The driver's name.
    pub driver: String,
    /// The slice publisher's counters.
    pub counters: Arc<SliceCounters>,
    /// The counters of the kubelet's prepare and unprepare calls.
    pub claims: Arc<crate::claim_metrics::ClaimMetrics>,
    /// The claims' device status writes.
    pub status: Arc<crate::device_status::DeviceStatusCounters>,
    /// What the API server last confirmed (`None` until the first publish).
    pub published: watch::Receiver<Option<Published>>,
    /// What the kubelet last said about the registration.
    pub registered: watch::Receiver<Registered>,
    /// Whether the plugin watcher's folder, where its registration socket goes, can be followed.
    pub registry: devplug::host::FolderHealth,
}

impl DraHealth {
    /// `Err` with the reason when the driver cannot do its job until something outside it is
    /// fixed: the plugin watcher's folder cannot be followed (e.g. its path is a file), so the
    /// kubelet can never find the driver.
    pub fn working(&self) -> Result<(), String> {
        self.registry
            .check()
            .map_err(|reason| format!("DRA driver {}: {reason}", self.driver))
    }

    /// Why the driver is not ready, or `None` when it is: its slices are published and, as far
    /// as it knows, current, and the kubelet registered it.
    pub fn not_ready(&self) -> Option<String> {
        let mut missing = Vec::new();
        let failures = self.counters.consecutive_failures.load(Relaxed);
        if failures > 0 {
            let last = self.counters.last_success_unix.load(Relaxed);
            let since = if last == 0 {
                "never published".to_owned()
            } else {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs());
                format!("last published {} s ago", now.saturating_sub(last))
            };
            missing.push(format!(
                "its ResourceSlices may be stale: {failures} publish attempts failed in a row \
                 ({since}; the log says why)"
            ));
        } else if self.published.borrow().is_none() {
            missing.push("its ResourceSlices are not published yet".to_owned());
        }
        match &*self.registered.borrow() {
            Registered::Yes => {}
            Registered::Waiting => {
                missing.push("the kubelet's plugin watcher has not registered it yet".to_owned())
            }
            Registered::Refused(reason) => {
                missing.push(format!("the kubelet refused its registration: {reason}"))
            }
        }
        (!missing.is_empty()).then(|| missing.join("; "))
    }
}
