//! The pod resources follower of a host: one client, polling the kubelet's
//! `GetAllocatableResources` and `List` in turn, each at most once per interval.
//!
//! - `List` gives the devices allocated per resource (for `/metrics`) and the devices in use
//!   (published on a watch channel for backends that want it).
//! - `GetAllocatableResources` is the watchdog: when, on [`STRIKES`] polls in a row, the kubelet
//!   can allocate fewer of our devices than the healthy ones we stream to it while we believe we
//!   are registered (with no registration and no change of our list in between), the kubelet
//!   lost our endpoint (the name-keyed disconnect of §3, a stream it
//!   dropped without telling us): the resource registers again, and the metric counts it.
//! - `GetAllocatableResources` also shows devices under one of our resource names that we do
//!   not serve: another device plugin registered the same name on this node (the kubelet keeps
//!   one endpoint per name, the last registered). That is said at WARN when it starts and at
//!   INFO when it ends, and counted per resource for `/metrics`.

use super::Running;
use crate::podresources::{self, InUse, PodResourcesClient, PodResourcesError};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Polls in a row with a short allocatable before registering again (one poll can race a
/// health change that the kubelet has not applied yet).
pub(crate) const STRIKES: u32 = 2;

/// What the follower learned, shared with the host.
#[derive(Debug, Default)]
pub(crate) struct PodResourcesView {
    /// Devices allocated to pods, by resource (only resources seen in a `List`).
    pub(crate) allocated: BTreeMap<String, usize>,
    /// Devices the kubelet can allocate under one of our resource names that we do not serve,
    /// by resource.
    pub(crate) foreign: BTreeMap<String, usize>,
    /// Whether a `List` answered at least once.
    pub(crate) known: bool,
}

/// Runs the follower until `stop`.
pub(crate) async fn run(
    socket: PathBuf,
    interval: Duration,
    resources: Arc<Mutex<BTreeMap<String, Running>>>,
    view: Arc<Mutex<PodResourcesView>>,
    in_use: Arc<watch::Sender<InUse>>,
    stop: CancellationToken,
) {
    let mut client: Option<PodResourcesClient> = None;
    let mut strikes: BTreeMap<String, Strikes> = BTreeMap::new();
    let mut last_error: Option<String> = None;
    let mut foreign_seen: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    loop {
        let round = async {
            if client.is_none() {
                let c = PodResourcesClient::connect(&socket, Duration::from_secs(10)).await?;
                client = Some(c.with_interval(interval));
            }
            let Some(c) = client.as_mut() else {
                return Err(PodResourcesError::Call(tonic::Status::unavailable(
                    "no client",
                )));
            };
            let allocatable = c.allocatable().await?;
            let list = c.list().await?;
            Ok((allocatable, list))
        };
        let result = tokio::select! {
            _ = stop.cancelled() => return,
            result = round => result,
        };
        match result {
            Ok((allocatable, list)) => {
                last_error = None;
                let counts = podresources::allocatable_counts(&allocatable);
                let held = podresources::holders(&list);
                let foreign =
                    foreign_devices(&resources, &podresources::allocatable_ids(&allocatable));
                report_foreign(&foreign, &mut foreign_seen);
                {
                    let mut v = view.lock().unwrap_or_else(|e| e.into_inner());
                    v.allocated = held.iter().map(|(r, ids)| (r.clone(), ids.len())).collect();
                    v.foreign = foreign
                        .iter()
                        .map(|(r, ids)| (r.clone(), ids.len()))
                        .collect();
                    v.known = true;
                }
                let now: InUse = held
                    .into_iter()
                    .map(|(r, ids)| (r, ids.into_keys().collect()))
                    .collect();
                in_use.send_if_modified(|current| {
                    let changed = *current != now;
                    if changed {
                        *current = now;
                    }
                    changed
                });
                check(&resources, &counts, &mut strikes);
            }
            Err(err) => {
                let message = err.to_string();
                if last_error.as_deref() != Some(message.as_str()) {
                    tracing::warn!(socket = %socket.display(), error = %message, "pod resources: the kubelet did not answer; retrying");
                    last_error = Some(message);
                }
                if matches!(err, PodResourcesError::Connect { .. }) {
                    client = None;
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(interval) => {}
                    }
                }
            }
        }
    }
}

/// For each served resource, the ids the kubelet can allocate under its name that it does not
/// serve (only resources with some).
fn foreign_devices(
    resources: &Mutex<BTreeMap<String, Running>>,
    allocatable: &BTreeMap<String, BTreeSet<String>>,
) -> BTreeMap<String, BTreeSet<String>> {
    let resources = resources.lock().unwrap_or_else(|e| e.into_inner());
    resources
        .iter()
        .filter_map(|(name, running)| {
            let ours = running.shared.devices.borrow();
            let other: BTreeSet<String> = allocatable
                .get(name)?
                .iter()
                .filter(|id| ours.get(id).is_none())
                .cloned()
                .collect();
            (!other.is_empty()).then(|| (name.clone(), other))
        })
        .collect()
}

/// Says when another plugin's devices appear under one of our names (WARN) and when they are
/// gone (INFO), once per change; `seen` is what was said last.
fn report_foreign(
    now: &BTreeMap<String, BTreeSet<String>>,
    seen: &mut BTreeMap<String, BTreeSet<String>>,
) {
    for (name, ids) in now {
        if seen.get(name) != Some(ids) {
            let sample: Vec<&str> = ids.iter().take(5).map(String::as_str).collect();
            tracing::warn!(
                resource = %name,
                foreign = ids.len(),
                ids = ?sample,
                "the kubelet lists devices of this resource that devplug does not serve: another \
                 device plugin registered the same resource name on this node, and the kubelet \
                 keeps only the last registration; turn the other plugin off on this node \
                 (docs/gpus.md, cutting over)"
            );
        }
    }
    for name in seen.keys() {
        if !now.contains_key(name) {
            tracing::info!(resource = %name, "the kubelet lists only devplug's devices of this resource again");
        }
    }
    *seen = now.clone();
}

/// The watchdog's decision for every served resource.
fn check(
    resources: &Mutex<BTreeMap<String, Running>>,
    allocatable: &BTreeMap<String, usize>,
    strikes: &mut BTreeMap<String, Strikes>,
) {
    let resources = resources.lock().unwrap_or_else(|e| e.into_inner());
    strikes.retain(|name, _| resources.contains_key(name));
    for (name, running) in resources.iter() {
        let status = running.status.subscribe().borrow().clone();
        let healthy = running.shared.devices.borrow().healthy_count();
        let kubelet = allocatable.get(name).copied().unwrap_or(0);
        let short = status.registered && status.streams > 0 && kubelet < healthy;
        let record = strikes.entry(name.clone()).or_default();
        if record.after_poll(short, status.registrations, healthy) {
            tracing::warn!(resource = %name, kubelet_allocatable = kubelet, healthy, "the kubelet lost our endpoint; registering again");
            running.status.counters.watchdog_reregistered();
            running.status.request_relink();
        }
    }
}

/// One resource's run of polls that found the kubelet short of our healthy devices.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Strikes {
    /// Short polls in a row.
    count: u32,
    /// Our registrations and healthy devices at the last short poll: a run only goes on while
    /// both stay the same. A new registration (the kubelet restarted, or we registered again)
    /// or a changed list starts a new run, because the kubelet may not have caught up yet: two
    /// such races on consecutive polls are not a lost endpoint.
    registrations: u64,
    healthy: usize,
}

impl Strikes {
    /// The record after one more poll; `true` when the resource must register again.
    fn after_poll(&mut self, short: bool, registrations: u64, healthy: usize) -> bool {
        if !short {
            *self = Strikes::default();
            return false;
        }
        let same_run =
            self.count > 0 && self.registrations == registrations && self.healthy == healthy;
        self.count = if same_run {
            self.count.saturating_add(1)
        } else {
            1
        };
        self.registrations = registrations;
        self.healthy = healthy;
        if self.count >= STRIKES {
            *self = Strikes::default();
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shortfall_on_consecutive_polls_of_one_registration_and_list_fires_once() {
        let mut s = Strikes::default();
        assert!(!s.after_poll(true, 1, 4));
        assert!(s.after_poll(true, 1, 4));
        // The record starts over after firing.
        assert!(!s.after_poll(true, 1, 4));
        // A poll that is not short ends the run.
        assert!(!s.after_poll(false, 1, 4));
        assert!(!s.after_poll(true, 1, 4));
    }

    #[test]
    fn a_new_registration_or_a_changed_list_between_polls_starts_a_new_run() {
        // Short while a new device was on its way to the kubelet, then short again right
        // after a kubelet restart and our registration with it: two races, not a lost endpoint.
        let mut s = Strikes::default();
        assert!(!s.after_poll(true, 1, 4));
        assert!(!s.after_poll(true, 2, 4));
        assert!(s.after_poll(true, 2, 4));
        let mut s = Strikes::default();
        assert!(!s.after_poll(true, 1, 3));
        assert!(!s.after_poll(true, 1, 4));
        assert!(s.after_poll(true, 1, 4));
    }
}
