//! Counters of one resource's traffic with the kubelet, kept as atomics (no metrics library in
//! the core) and read as a [`MetricsSnapshot`] by whoever exports them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the Allocate latency buckets, in seconds.
pub const ALLOCATE_BUCKETS: [f64; 10] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.05, 0.25,
];

/// Live counters of one resource.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    registrations: AtomicU64,
    registration_failures: AtomicU64,
    kubelet_restarts: AtomicU64,
    watchdog_reregistrations: AtomicU64,
    list_updates: AtomicU64,
    allocations: AtomicU64,
    allocation_errors: AtomicU64,
    allocate_nanos: AtomicU64,
    allocate_buckets: [AtomicU64; ALLOCATE_BUCKETS.len()],
}

/// A reading of one resource's counters, plus its state.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MetricsSnapshot {
    /// Successful registrations.
    pub registrations: u64,
    /// Failed registration attempts.
    pub registration_failures: u64,
    /// Kubelet restarts noticed (our socket deleted, or a new kubelet.sock while registered).
    pub kubelet_restarts: u64,
    /// Registrations started by the pod resources watchdog: the kubelet's allocatable for the
    /// resource stayed below the healthy devices we stream (it lost our endpoint).
    pub watchdog_reregistrations: u64,
    /// ListAndWatch messages sent, over all streams.
    pub list_updates: u64,
    /// Allocate calls answered.
    pub allocations: u64,
    /// Allocate calls answered with an error.
    pub allocation_errors: u64,
    /// Total time spent answering Allocate, in seconds.
    pub allocate_seconds: f64,
    /// Allocate calls per latency bucket (cumulative, as Prometheus expects), matching
    /// [`ALLOCATE_BUCKETS`].
    pub allocate_buckets: Vec<u64>,
    /// Healthy devices the kubelet is told about.
    pub healthy: usize,
    /// Unhealthy devices the kubelet is told about.
    pub unhealthy: usize,
    /// Each unhealthy device with its reason (the kubelet only sees "Unhealthy").
    pub unhealthy_reasons: Vec<(String, String)>,
    /// Registered with the current kubelet.
    pub registered: bool,
    /// Open ListAndWatch streams.
    pub streams: usize,
    /// Why the device list cannot be sent to the kubelet (over its 4 MiB limit), if so.
    pub list_error: Option<String>,
    /// Why the resource is not ready, if it is not: the backend's reason
    /// ([`crate::Backend::not_ready`]) first, else the connection's.
    pub not_ready: Option<String>,
    /// Problems the backend reports that do not stop it, as (kind, detail).
    pub warnings: Vec<(String, String)>,
    /// Devices allocated to pods, from the kubelet's pod resources API; `None` until known
    /// (no [`Host::watch_pod_resources`](crate::Host::watch_pod_resources), or no answer yet).
    pub allocated: Option<usize>,
    /// Devices the kubelet can allocate under this resource's name that the resource does not
    /// serve: another device plugin registered the same name on this node (the kubelet keeps
    /// the last registration). From the pod resources API; `None` until known.
    pub foreign_devices: Option<usize>,
}

impl Counters {
    pub(crate) fn registered(&self) {
        self.registrations.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn registration_failed(&self) {
        self.registration_failures.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn kubelet_restarted(&self) {
        self.kubelet_restarts.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn watchdog_reregistered(&self) {
        self.watchdog_reregistrations
            .fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn list_sent(&self) {
        self.list_updates.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn allocated(&self, took: Duration, ok: bool) {
        self.allocations.fetch_add(1, Ordering::Relaxed);
        if !ok {
            self.allocation_errors.fetch_add(1, Ordering::Relaxed);
        }
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.allocate_nanos.fetch_add(nanos, Ordering::Relaxed);
        let secs = took.as_secs_f64();
        if let Some(i) = ALLOCATE_BUCKETS.iter().position(|&le| secs <= le) {
            self.allocate_buckets[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(crate) fn snapshot(&self) -> MetricsSnapshot {
        let mut cumulative = 0;
        let allocate_buckets = self
            .allocate_buckets
            .iter()
            .map(|b| {
                cumulative += b.load(Ordering::Relaxed);
                cumulative
            })
            .collect();
        MetricsSnapshot {
            registrations: self.registrations.load(Ordering::Relaxed),
            registration_failures: self.registration_failures.load(Ordering::Relaxed),
            kubelet_restarts: self.kubelet_restarts.load(Ordering::Relaxed),
            watchdog_reregistrations: self.watchdog_reregistrations.load(Ordering::Relaxed),
            list_updates: self.list_updates.load(Ordering::Relaxed),
            allocations: self.allocations.load(Ordering::Relaxed),
            allocation_errors: self.allocation_errors.load(Ordering::Relaxed),
            allocate_seconds: self.allocate_nanos.load(Ordering::Relaxed) as f64 / 1e9,
            allocate_buckets,
            ..MetricsSnapshot::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative() {
        let c = Counters::default();
        c.allocated(Duration::from_micros(80), true);
        c.allocated(Duration::from_millis(3), false);
        c.allocated(Duration::from_secs(1), true);
        let s = c.snapshot();
        assert_eq!(s.allocations, 3);
        assert_eq!(s.allocation_errors, 1);
        assert_eq!(s.allocate_buckets[0], 0);
        assert_eq!(s.allocate_buckets[1], 1, "80 µs <= 100 µs");
        assert_eq!(s.allocate_buckets[6], 2, "3 ms <= 5 ms");
        assert_eq!(
            *s.allocate_buckets.last().unwrap(),
            2,
            "1 s is only in +Inf"
        );
        assert!((s.allocate_seconds - 1.00308).abs() < 1e-9);
    }
}
