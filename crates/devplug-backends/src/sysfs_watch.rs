//! The moving parts shared by the sysfs GPU backends (`amdgpu`, `intel-gpu`): scan once at
//! start, publish, then follow changes with inotify (debounced like `hostdev`), never polling
//! and never exiting when nothing is there yet; keep a GPU that vanished (device gone from
//! sysfs, driver unbound) listed as Unhealthy with the reason until it is back; and keep the
//! CDI spec file in step, written before the devices it names are published.
//!
//! On a real kernel, sysfs folders do not report new entries to inotify, but devtmpfs does:
//! a driver that loads or a GPU that appears makes `/dev/dri/*` (and `/dev/kfd`) nodes, and the
//! watch on `/dev` and `/dev/dri` sees them. The sysfs folders are watched too (it costs
//! nothing, and fake trees in tests do report them).

use crate::inotify_batch::Batches;
use devplug::cdi::{CdiWriter, Spec};
use devplug::dra::DeviceAttributes;
use devplug::{Device, DeviceList, Health};
use inotify::{WatchDescriptor, WatchMask};
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard};
use tokio::sync::watch;
use tokio_util::sync::{CancellationToken, DropGuard};

/// Rescans in a row while new folders keep appearing (a folder made between a scan and its
/// watch would otherwise hide what was made in it).
const MAX_SETTLE_SCANS: usize = 4;

/// One published device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Entry {
    /// Device id.
    pub(crate) id: String,
    /// The physical GPU it belongs to (its PCI address or card name).
    pub(crate) physical: String,
    /// NUMA node.
    pub(crate) numa: Option<i64>,
    /// Why it cannot be used now (then it is Unhealthy).
    pub(crate) problem: Option<String>,
    /// DRA attributes ([`crate::dra_attributes`]).
    pub(crate) attributes: Option<Box<DeviceAttributes>>,
}

/// The result of one scan.
pub(crate) struct Scan<T> {
    /// Devices found, in order.
    pub(crate) entries: Vec<Entry>,
    /// The backend's own view (what allocation needs).
    pub(crate) state: T,
    /// Folders whose changes could change the result.
    pub(crate) watch_dirs: BTreeSet<PathBuf>,
    /// The CDI spec for these devices.
    pub(crate) spec: Option<Spec>,
    /// Physical GPUs that are present but unusable, with the reason (e.g. driver unbound).
    pub(crate) absent: BTreeMap<String, String>,
    /// Physical GPUs that are present and usable, including ones this resource leaves out (a
    /// GPU now in another partition mode, an SR-IOV PF that now has VFs). Ids of theirs that
    /// vanished were reconfigured away, not lost, so they are dropped rather than kept.
    pub(crate) present: BTreeSet<String>,
    /// The node labels these devices describe the node with (none for most backends).
    pub(crate) labels: crate::NodeLabels,
}

/// A scan function.
pub(crate) type ScanFn<T> = Arc<dyn Fn() -> Scan<T> + Send + Sync>;

/// The running machinery: state for allocation, the published list, the follower task.
pub(crate) struct Watched<T> {
    state: Arc<RwLock<T>>,
    devices: Arc<watch::Sender<DeviceList>>,
    labels: Arc<watch::Sender<crate::NodeLabels>>,
    cdi_ready: Arc<AtomicBool>,
    _stop: DropGuard,
}

/// What was seen of each id before: its GPU and NUMA node.
#[derive(Debug, Clone, Default)]
struct Memory {
    seen: BTreeMap<String, (String, Option<i64>)>,
    /// How health reasons speak of a physical device.
    words: Words,
}

/// How health reasons speak of a physical device that is missing.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Words {
    /// What it is called (`GPU`, `PCI device`, `NPU`).
    pub(crate) noun: &'static str,
    /// The reason when the scan gives none (`is gone from sysfs`).
    pub(crate) gone: &'static str,
}

impl Words {
    /// GPUs found in sysfs.
    pub(crate) const GPU: Words = Words {
        noun: "GPU",
        gone: "is gone from sysfs",
    };
}

impl Default for Words {
    fn default() -> Self {
        Words::GPU
    }
}

impl Memory {
    /// The list to publish: the scan's devices, plus every device seen before whose GPU is now
    /// missing, as Unhealthy with the reason. Ids whose GPU is still there but which the scan
    /// no longer has (a GPU repartitioned) are forgotten.
    fn merge<T>(&mut self, scan: &Scan<T>) -> DeviceList {
        let (entries, absent) = (&scan.entries, &scan.absent);
        let present: HashSet<&str> = entries
            .iter()
            .map(|e| e.physical.as_str())
            .chain(scan.present.iter().map(String::as_str))
            .collect();
        let ids: HashSet<&str> = entries.iter().map(|e| e.id.as_str()).collect();
        let mut devices: Vec<Device> = entries
            .iter()
            .map(|e| {
                let health = match &e.problem {
                    Some(p) => Health::unhealthy(p.clone()),
                    None => Health::Healthy,
                };
                let mut device = Device::new(e.id.clone())
                    .with_health(health)
                    .with_numa_nodes(e.numa);
                device.attributes.clone_from(&e.attributes);
                device
            })
            .collect();
        self.seen.retain(|id, (physical, _)| {
            ids.contains(id.as_str()) || !present.contains(physical.as_str())
        });
        for (id, (physical, numa)) in &self.seen {
            if ids.contains(id.as_str()) {
                continue;
            }
            let reason = absent
                .get(physical)
                .cloned()
                .unwrap_or_else(|| self.words.gone.to_owned());
            devices.push(
                Device::new(id.clone())
                    .with_health(Health::unhealthy(format!(
                        "{} {physical} {reason}",
                        self.words.noun
                    )))
                    .with_numa_nodes(*numa),
            );
        }
        for e in entries {
            self.seen.insert(e.id.clone(), (e.physical.clone(), e.numa));
        }
        DeviceList::new(devices)
    }
}

impl<T: Send + Sync + 'static> Watched<T> {
    /// Scans once, writes the CDI spec, publishes, and starts following changes. `what` names
    /// the backend in logs, `words` how health reasons speak of a missing device. Must be
    /// called inside a tokio runtime.
    pub(crate) fn start(
        scan: ScanFn<T>,
        cdi: Option<CdiWriter>,
        what: &'static str,
        words: Words,
    ) -> Self {
        let first = scan();
        let mut memory = Memory {
            words,
            ..Memory::default()
        };
        let cdi_ready = Arc::new(AtomicBool::new(false));
        let mut cdi = cdi;
        write_spec(&mut cdi, first.spec.as_ref(), &cdi_ready, what);
        let list = memory.merge(&first);
        let labels = Arc::new(watch::Sender::new(first.labels));
        let state = Arc::new(RwLock::new(first.state));
        let devices = Arc::new(watch::Sender::new(list));
        let stop = CancellationToken::new();
        let follower = Follower {
            scan,
            state: state.clone(),
            devices: devices.clone(),
            labels: labels.clone(),
            cdi,
            cdi_ready: cdi_ready.clone(),
            memory,
            watched: HashSet::new(),
            what,
        };
        tokio::spawn(follower.run(first.watch_dirs, stop.clone()));
        Watched {
            state,
            devices,
            labels,
            cdi_ready,
            _stop: stop.drop_guard(),
        }
    }

    /// A new receiver of the published list.
    pub(crate) fn devices(&self) -> watch::Receiver<DeviceList> {
        self.devices.subscribe()
    }

    /// A new receiver of the node labels of the latest scan.
    pub(crate) fn labels(&self) -> watch::Receiver<crate::NodeLabels> {
        self.labels.subscribe()
    }

    /// The latest state.
    pub(crate) fn state(&self) -> RwLockReadGuard<'_, T> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    /// True when the CDI spec for the published devices is on disk.
    pub(crate) fn cdi_ready(&self) -> bool {
        self.cdi_ready.load(Ordering::Acquire)
    }
}

fn write_spec(
    cdi: &mut Option<CdiWriter>,
    spec: Option<&Spec>,
    ready: &AtomicBool,
    what: &'static str,
) {
    let (Some(writer), Some(spec)) = (cdi.as_mut(), spec) else {
        ready.store(false, Ordering::Release);
        return;
    };
    match writer.write(spec) {
        Ok(changed) => {
            if changed {
                tracing::debug!(backend = what, path = %writer.path().display(), "CDI spec written");
            }
            ready.store(true, Ordering::Release);
        }
        Err(err) => {
            tracing::error!(
                backend = what, path = %writer.path().display(), %err,
                "cannot write the CDI spec; allocations carry device nodes only"
            );
            ready.store(false, Ordering::Release);
        }
    }
}

struct Follower<T> {
    scan: ScanFn<T>,
    state: Arc<RwLock<T>>,
    devices: Arc<watch::Sender<DeviceList>>,
    labels: Arc<watch::Sender<crate::NodeLabels>>,
    cdi: Option<CdiWriter>,
    cdi_ready: Arc<AtomicBool>,
    memory: Memory,
    watched: HashSet<WatchDescriptor>,
    what: &'static str,
}

impl<T: Send + Sync + 'static> Follower<T> {
    async fn run(mut self, first_dirs: BTreeSet<PathBuf>, stop: CancellationToken) {
        let mut events = match Batches::new() {
            Ok(events) => events,
            Err(err) => {
                tracing::error!(backend = self.what, %err, "cannot start inotify; changes are not followed");
                return;
            }
        };
        if self.watch_dirs(&mut events, &first_dirs) {
            // Something may have appeared between the first scan and its watches.
            self.rescan(&mut events);
        }
        loop {
            match events.next_burst(&stop).await {
                Ok(true) => self.rescan(&mut events),
                Ok(false) => return,
                Err(err) => {
                    tracing::error!(backend = self.what, %err, "inotify failed; changes are not followed");
                    return;
                }
            }
        }
    }

    /// Scans (again while new folders appear), then publishes.
    fn rescan(&mut self, events: &mut Batches) {
        let mut found = (self.scan)();
        for _ in 1..MAX_SETTLE_SCANS {
            if !self.watch_dirs(events, &found.watch_dirs) {
                break;
            }
            found = (self.scan)();
        }
        write_spec(
            &mut self.cdi,
            found.spec.as_ref(),
            &self.cdi_ready,
            self.what,
        );
        let list = self.memory.merge(&found);
        let labels = found.labels;
        self.labels.send_if_modified(|current| {
            let modified = *current != labels;
            if modified {
                *current = labels;
            }
            modified
        });
        *self.state.write().unwrap_or_else(|e| e.into_inner()) = found.state;
        self.devices.send_if_modified(|current| {
            let modified = *current != list;
            if modified {
                *current = list;
            }
            modified
        });
    }

    /// Watches every existing folder; true if a watch is new (a new or re-made folder).
    fn watch_dirs(&mut self, events: &mut Batches, dirs: &BTreeSet<PathBuf>) -> bool {
        let mask = WatchMask::CREATE
            | WatchMask::DELETE
            | WatchMask::MOVED_FROM
            | WatchMask::MOVED_TO
            | WatchMask::ONLYDIR;
        let mut added = false;
        for dir in dirs.iter().filter(|d| d.is_dir()) {
            match events.watch(dir, mask) {
                Ok(wd) => added |= self.watched.insert(wd),
                Err(err) => tracing::debug!(dir = %dir.display(), %err, "cannot watch"),
            }
        }
        added
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: &str, physical: &str) -> Entry {
        Entry {
            id: id.into(),
            physical: physical.into(),
            numa: Some(0),
            problem: None,
            attributes: None,
        }
    }

    fn scan(entries: &[Entry], absent: &[(&str, &str)], present: &[&str]) -> Scan<()> {
        Scan {
            entries: entries.to_vec(),
            state: (),
            watch_dirs: BTreeSet::new(),
            spec: None,
            absent: absent
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect(),
            present: present.iter().map(|p| p.to_string()).collect(),
            labels: crate::NodeLabels::new(),
        }
    }

    fn health(list: &DeviceList) -> Vec<(String, String)> {
        list.devices()
            .iter()
            .map(|d| (d.id.clone(), d.health.to_string()))
            .collect()
    }

    #[test]
    fn vanished_gpus_stay_unhealthy_and_repartitioned_ids_are_forgotten() {
        let mut memory = Memory::default();
        let both = [entry("a", "A"), entry("a1", "A"), entry("b", "B")];
        assert_eq!(memory.merge(&scan(&both, &[], &[])).healthy_count(), 3);
        // GPU B gone: its id stays, Unhealthy, with the reason.
        let list = memory.merge(&scan(&both[..2], &[], &[]));
        assert_eq!(
            health(&list)[2],
            ("b".into(), "Unhealthy (GPU B is gone from sysfs)".into())
        );
        // A reason from the scan wins.
        let list = memory.merge(&scan(&both[..2], &[("B", "is not bound to amdgpu")], &[]));
        assert_eq!(
            health(&list)[2].1,
            "Unhealthy (GPU B is not bound to amdgpu)"
        );
        // Back: healthy again.
        assert_eq!(memory.merge(&scan(&both, &[], &[])).healthy_count(), 3);
        // GPU A repartitioned (a1 gone, A still there): a1 is dropped, not kept Unhealthy.
        let list = memory.merge(&scan(&[entry("a", "A"), entry("b", "B")], &[], &[]));
        assert_eq!(list.len(), 2);
        assert_eq!(list.healthy_count(), 2);
        // GPU B present but left out by this resource (another partition mode): dropped too.
        let list = memory.merge(&scan(&[entry("a", "A")], &[], &["B"]));
        assert_eq!(health(&list), [("a".to_owned(), "Healthy".to_owned())]);
    }
}
