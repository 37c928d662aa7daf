//! The unhealthy-taint clock: when each unhealthy device was first seen so (its taint's
//! `timeAdded`), and when its `NoSchedule` taint turns `NoExecute` (once it has been unhealthy
//! for `no_execute_after`).

use super::spec::Unhealthy;
use devplug::DeviceList;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::time::Instant;

/// When each unhealthy device turned unhealthy, and which of their taints are `NoExecute`.
pub(super) struct TaintClock {
    /// When each unhealthy device was first seen so (its taint's `timeAdded`).
    unhealthy_since: BTreeMap<String, Time>,
    /// The same, on the monotonic clock: when its taint turns `NoExecute`.
    unhealthy_at: BTreeMap<String, Instant>,
    /// The unhealthy devices whose taint is `NoExecute`, since when.
    no_execute_since: BTreeMap<String, Time>,
    /// How long a device stays unhealthy before its taint turns `NoExecute` (none: never).
    no_execute_after: Option<Duration>,
}

impl TaintClock {
    /// A clock with no unhealthy device yet.
    pub(super) fn new(no_execute_after: Option<Duration>) -> TaintClock {
        TaintClock {
            unhealthy_since: BTreeMap::new(),
            unhealthy_at: BTreeMap::new(),
            no_execute_since: BTreeMap::new(),
            no_execute_after,
        }
    }

    /// When the next unhealthy device's taint turns `NoExecute`, if one will.
    pub(super) fn escalation_due(&self) -> Option<Instant> {
        let after = self.no_execute_after?;
        self.unhealthy_at
            .iter()
            .filter(|(id, _)| !self.no_execute_since.contains_key(*id))
            .filter_map(|(_, at)| at.checked_add(after))
            .min()
    }

    /// Follows a new device list of `driver`: devices healthy (or gone) again are forgotten,
    /// newly unhealthy ones are timed from now, and those unhealthy for `no_execute_after` turn
    /// `NoExecute` (one WARN each).
    pub(super) fn update(&mut self, list: &DeviceList, driver: &str) {
        // Seconds, as the API server keeps a time: what we write is what we read back.
        let now = Time(
            k8s_openapi::jiff::Timestamp::from_second(
                k8s_openapi::jiff::Timestamp::now().as_second(),
            )
            .unwrap_or_else(|_| k8s_openapi::jiff::Timestamp::now()),
        );
        let still = |id: &String| list.get(id).is_some_and(|d| !d.health.is_healthy());
        self.unhealthy_since.retain(|id, _| still(id));
        self.unhealthy_at.retain(|id, _| still(id));
        self.no_execute_since.retain(|id, _| still(id));
        let instant = Instant::now();
        for device in list.devices() {
            if !device.health.is_healthy() && !self.unhealthy_since.contains_key(&device.id) {
                self.unhealthy_since.insert(device.id.clone(), now.clone());
                self.unhealthy_at.insert(device.id.clone(), instant);
            }
        }
        if let Some(after) = self.no_execute_after {
            for (id, at) in &self.unhealthy_at {
                let due = at.checked_add(after).is_some_and(|due| due <= instant);
                if due && !self.no_execute_since.contains_key(id) {
                    tracing::warn!(driver = %driver, device = %id, after = ?after,
                        "device unhealthy for no_execute_after: its taint is now NoExecute (pods that do not tolerate it are evicted)");
                    self.no_execute_since.insert(id.clone(), now.clone());
                }
            }
        }
    }

    /// The unhealthy devices as tainted, with the taint key `key`.
    pub(super) fn taints<'a>(&'a self, key: &'a str) -> Unhealthy<'a> {
        Unhealthy::Taint {
            key,
            since: &self.unhealthy_since,
            no_execute: &self.no_execute_since,
        }
    }
}
