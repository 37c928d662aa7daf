//! The `hostdev` backend: host device nodes (serial and USB adapters, /dev/fuse, /dev/net/tun,
//! video and render nodes, PCI devices) handed to containers as device specs.
//!
//! - `settings`: the config (groups by glob, USB id or PCI id; sharing; permissions).
//! - `discover`: scanning /dev and sysfs.
//!
//! Hotplug is event-driven: inotify on the dev root and the folders the patterns and nodes live
//! in; a burst of events is debounced (quiet for 10 ms, at most 100 ms) into one rescan and one
//! published list. A node named exactly (no glob) that vanishes turns its device unhealthy; a
//! globbed or USB/PCI device that vanishes is removed.

mod discover;
pub mod settings;

pub use settings::{
    GroupSettings, HostdevSettings, MountSettings, PciMatch, ReplicaPolicy, UsbMatch,
};

use crate::inotify_batch::Batches;
use crate::replicas::ShareInfo;
use crate::settings::SettingsError;
use devplug::{
    AllocateError, Backend, BackendWarning, ContainerEdits, Device, DeviceList, DeviceNode, Health,
    Mount, Options, PreferenceRequest,
};
use discover::{discover, Discovery, Physical};
use inotify::WatchMask;
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, RwLock};
use tokio::sync::watch;
use tokio_util::sync::{CancellationToken, DropGuard};

/// Host device nodes as devices.
pub struct HostdevBackend {
    settings: Arc<HostdevSettings>,
    inventory: Arc<RwLock<Inventory>>,
    devices: Arc<watch::Sender<DeviceList>>,
    _stop: DropGuard,
}

/// The physical devices found, and where each share id points.
#[derive(Debug, Default)]
struct Inventory {
    physicals: Vec<Physical>,
    shares: HashMap<String, ShareInfo>,
    /// Groups that matched no device, described by their patterns or ids.
    unmatched: Vec<String>,
}

/// A group in words, for logs and metrics: `groups[1]: usb 0403:6001`.
fn describe_group(index: usize, group: &GroupSettings) -> String {
    let what = if !group.paths.is_empty() {
        format!("paths {}", group.paths.join(" "))
    } else if !group.usb.is_empty() {
        let ids: Vec<String> = group
            .usb
            .iter()
            .map(|u| match &u.product {
                Some(product) => format!("{}:{product}", u.vendor),
                None => u.vendor.clone(),
            })
            .collect();
        format!("usb {}", ids.join(" "))
    } else {
        let ids: Vec<String> = group
            .pci
            .iter()
            .map(|p| {
                let part =
                    |name: &str, v: &Option<String>| v.as_ref().map(|v| format!("{name}={v}"));
                [
                    part("vendor", &p.vendor),
                    part("device", &p.device),
                    part("class", &p.class),
                ]
                .into_iter()
                .flatten()
                .collect::<Vec<_>>()
                .join(",")
            })
            .collect();
        format!("pci {}", ids.join(" "))
    };
    format!("groups[{index}]: {what}")
}

/// Logs the groups that newly match nothing (a typo in a glob or id is the usual cause) at WARN,
/// and those that match again at INFO.
fn log_unmatched(before: &[String], now: &[String]) {
    for group in now.iter().filter(|g| !before.contains(g)) {
        tracing::warn!(%group, "hostdev group matches no device; check its pattern or ids (a typo matches nothing)");
    }
    for group in before.iter().filter(|g| !now.contains(g)) {
        tracing::info!(%group, "hostdev group matches a device again");
    }
}

impl Inventory {
    fn new(settings: &HostdevSettings, physicals: Vec<Physical>) -> (Inventory, DeviceList) {
        let mut shares = HashMap::new();
        let mut devices = Vec::new();
        for (index, physical) in physicals.iter().enumerate() {
            let health = match &physical.problem {
                Some(problem) => Health::unhealthy(problem.clone()),
                None => Health::Healthy,
            };
            for k in 0..settings.count {
                let id = if settings.count == 1 {
                    physical.id.clone()
                } else {
                    format!("{}-{k}", physical.id)
                };
                let mut device = Device::new(id.clone())
                    .with_health(health.clone())
                    .with_numa_nodes(physical.numa);
                device.attributes.clone_from(&physical.attributes);
                devices.push(device);
                shares.insert(
                    id,
                    ShareInfo {
                        physical: index,
                        numa: physical.numa,
                    },
                );
            }
        }
        let unmatched = settings
            .groups
            .iter()
            .enumerate()
            .filter(|(index, _)| !physicals.iter().any(|p| p.group == *index))
            .map(|(index, group)| describe_group(index, group))
            .collect();
        (
            Inventory {
                physicals,
                shares,
                unmatched,
            },
            DeviceList::new(devices),
        )
    }
}

impl HostdevBackend {
    /// Scans once and starts following hotplug. Must be called inside a tokio runtime.
    pub fn start(settings: &HostdevSettings) -> Result<Self, SettingsError> {
        settings.validate()?;
        let settings = Arc::new(settings.clone());
        let found = discover(&settings);
        let (inventory, list) = Inventory::new(&settings, found.devices.clone());
        log_unmatched(&[], &inventory.unmatched);
        let inventory = Arc::new(RwLock::new(inventory));
        let devices = Arc::new(watch::Sender::new(list));
        let stop = CancellationToken::new();
        let follower = Follower {
            settings: settings.clone(),
            inventory: inventory.clone(),
            devices: devices.clone(),
        };
        // In the caller's span: its logs name the resource the way the start's do.
        tokio::spawn(tracing::Instrument::in_current_span(
            follower.run(found, stop.clone()),
        ));
        Ok(HostdevBackend {
            settings,
            inventory,
            devices,
            _stop: stop.drop_guard(),
        })
    }
}

impl Backend for HostdevBackend {
    fn devices(&self) -> watch::Receiver<DeviceList> {
        self.devices.subscribe()
    }

    fn allocate(&self, ids: &[String]) -> Result<ContainerEdits, AllocateError> {
        let inventory = self.inventory.read().unwrap_or_else(|e| e.into_inner());
        let mut edits = ContainerEdits::default();
        let mut nodes_seen = HashSet::new();
        let mut mounts_seen = HashSet::new();
        for id in ids {
            let physical = inventory
                .shares
                .get(id)
                .and_then(|s| inventory.physicals.get(s.physical))
                .ok_or_else(|| {
                    AllocateError::InvalidRequest(format!("device {id:?} is no longer present"))
                })?;
            let group = &self.settings.groups[physical.group];
            for node in &physical.nodes {
                if nodes_seen.insert(node.clone()) {
                    edits.devices.push(DeviceNode {
                        host_path: self.settings.dev_root.join(node).display().to_string(),
                        container_path: Path::new("/dev").join(node).display().to_string(),
                        permissions: group.permissions.clone(),
                    });
                }
            }
            for mount in &group.mounts {
                if mounts_seen.insert(mount.container_path.clone()) {
                    edits.mounts.push(Mount {
                        host_path: mount.host_path.display().to_string(),
                        container_path: mount.container_path.display().to_string(),
                        read_only: mount.read_only,
                    });
                }
            }
        }
        if let Some(env) = &self.settings.env {
            edits.envs.insert(env.clone(), ids.join(","));
        }
        Ok(edits)
    }

    fn preferred(&self, request: &PreferenceRequest<'_>) -> Vec<String> {
        let inventory = self.inventory.read().unwrap_or_else(|e| e.into_inner());
        crate::replicas::prefer(request, &inventory.shares, self.settings.policy)
    }

    fn options(&self) -> Options {
        Options {
            preferred_allocation: true,
            pre_start_required: false,
        }
    }

    fn warnings(&self) -> Vec<BackendWarning> {
        let inventory = self.inventory.read().unwrap_or_else(|e| e.into_inner());
        inventory
            .unmatched
            .iter()
            .map(|group| BackendWarning {
                kind: "group_matches_nothing",
                detail: group.clone(),
            })
            .collect()
    }
}

/// The hotplug task.
struct Follower {
    settings: Arc<HostdevSettings>,
    inventory: Arc<RwLock<Inventory>>,
    devices: Arc<watch::Sender<DeviceList>>,
}

impl Follower {
    async fn run(self, first: Discovery, stop: CancellationToken) {
        let mut events = match Batches::new() {
            Ok(events) => events,
            Err(err) => {
                tracing::error!(%err, "cannot start inotify; hotplug is not followed");
                return;
            }
        };
        self.watch_dirs(&mut events, &first);
        // A device that appeared between the first scan and the watches is seen by one more
        // scan now that they are in place.
        let mut scan_now = true;
        loop {
            if !std::mem::take(&mut scan_now) {
                match events.next_burst(&stop).await {
                    Ok(true) => {}
                    Ok(false) => return,
                    Err(err) => {
                        tracing::error!(%err, "inotify failed; hotplug is not followed");
                        return;
                    }
                }
            }
            let found = discover(&self.settings);
            self.watch_dirs(&mut events, &found);
            let (inventory, list) = Inventory::new(&self.settings, found.devices);
            {
                let mut current = self.inventory.write().unwrap_or_else(|e| e.into_inner());
                log_unmatched(&current.unmatched, &inventory.unmatched);
                *current = inventory;
            }
            self.devices.send_if_modified(|current| {
                let modified = *current != list;
                if modified {
                    *current = list;
                }
                modified
            });
        }
    }

    /// Watches every folder that exists among those a change could come from. Adding a watch
    /// that exists is a no-op, and a folder that was deleted and made again is a new inode, so
    /// every folder is (re)added after each scan; inotify drops the watches of deleted folders.
    fn watch_dirs(&self, events: &mut Batches, found: &Discovery) {
        let mask = WatchMask::CREATE
            | WatchMask::DELETE
            | WatchMask::MOVED_FROM
            | WatchMask::MOVED_TO
            | WatchMask::ONLYDIR;
        for dir in found.watch_dirs.iter().filter(|d| d.is_dir()) {
            if let Err(err) = events.watch(dir, mask) {
                tracing::debug!(dir = %dir.display(), %err, "cannot watch");
            }
        }
    }
}
