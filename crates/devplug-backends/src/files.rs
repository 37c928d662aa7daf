//! The `files` backend: each regular file in a folder is one device, named by its file name.
//!
//! A file's first line is its health: empty or `Healthy` is healthy, anything else is unhealthy
//! with that line as the reason. inotify, not polling: a file created, removed, renamed or
//! rewritten changes the device list at once (CLOSE_WRITE rather than MODIFY, so a rewrite is
//! read once it is complete). Allocation sets an env var to the ids and can mount each file into
//! the container. A missing folder is created or waited for, as configured.
//!
//! Each device carries its file name as the DRA attribute `file`.
//!
//! Hidden files (starting with `.`) are not devices, nor are names the kubelet would refuse as
//! device ids ([`devplug::device::check_id`]: over 63 bytes, or with `,`, spaces or control
//! characters); those are logged with the reason, since one bad id would make the kubelet drop
//! the whole list.

use crate::dra_attributes::Attributes;
use crate::inotify_batch::{Batches, OwnedEvent};
use crate::settings::{check_env_name, SettingsError};
use devplug::{AllocateError, Backend, ContainerEdits, Device, DeviceList, Health, Mount};
use inotify::{EventMask, WatchMask};
use serde::Deserialize;

/// The word that marks a healthy device, as the kubelet spells it.
const HEALTHY: &str = "Healthy";
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::sync::watch;
use tokio_util::sync::{CancellationToken, DropGuard};

/// What to do when the folder does not exist.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MissingFolder {
    /// Wait for it to appear (no devices until then).
    #[default]
    Wait,
    /// Create it (and its parents).
    Create,
}

/// Settings of the `files` backend.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilesSettings {
    /// The folder whose files are the devices. In a container, mount it at the same path as on
    /// the host: mounts handed to the kubelet are host paths.
    pub dir: PathBuf,
    /// The env var that receives the allocated ids, comma-separated.
    #[serde(default = "default_env")]
    pub env: String,
    /// If set, each allocated file is mounted into the container at `<mount>/<id>`.
    #[serde(default)]
    pub mount: Option<PathBuf>,
    /// Mount files read-only (the default).
    #[serde(default = "yes")]
    pub read_only: bool,
    /// What to do when `dir` does not exist.
    #[serde(default)]
    pub missing: MissingFolder,
}

fn default_env() -> String {
    "FILES_DEVICES".to_owned()
}

fn yes() -> bool {
    true
}

impl FilesSettings {
    /// Settings for `dir` with every default.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        FilesSettings {
            dir: dir.into(),
            env: default_env(),
            mount: None,
            read_only: true,
            missing: MissingFolder::Wait,
        }
    }

    /// Checks every field.
    pub fn validate(&self) -> Result<(), SettingsError> {
        if !self.dir.is_absolute() {
            return Err(SettingsError::new(
                "dir",
                format!("{} must be an absolute path", self.dir.display()),
            ));
        }
        check_env_name("env", &self.env)?;
        if let Some(mount) = &self.mount {
            if !mount.is_absolute() {
                return Err(SettingsError::new(
                    "mount",
                    format!(
                        "{} must be an absolute path in the container",
                        mount.display()
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Devices that are files in a watched folder.
pub struct FilesBackend {
    settings: FilesSettings,
    devices: Arc<watch::Sender<DeviceList>>,
    _stop: DropGuard,
}

impl FilesBackend {
    /// Starts watching the folder. Must be called inside a tokio runtime.
    pub fn start(settings: &FilesSettings) -> Result<Self, SettingsError> {
        settings.validate()?;
        let devices = Arc::new(watch::Sender::new(DeviceList::default()));
        let stop = CancellationToken::new();
        if settings.missing == MissingFolder::Create {
            std::fs::create_dir_all(&settings.dir).map_err(|err| {
                SettingsError::new(
                    "dir",
                    format!("cannot create {}: {err}", settings.dir.display()),
                )
            })?;
        }
        // Scan once now, so the first list is complete before anyone reads it.
        if settings.dir.is_dir() {
            devices.send_replace(DeviceList::new(scan(&settings.dir).into_values()));
        }
        let watcher = Watcher {
            dir: settings.dir.clone(),
            devices: devices.clone(),
            files: BTreeMap::new(),
        };
        tokio::spawn(watcher.run(stop.clone()));
        Ok(FilesBackend {
            settings: settings.clone(),
            devices,
            _stop: stop.drop_guard(),
        })
    }
}

impl Backend for FilesBackend {
    fn devices(&self) -> watch::Receiver<DeviceList> {
        self.devices.subscribe()
    }

    fn allocate(&self, ids: &[String]) -> Result<ContainerEdits, AllocateError> {
        let mut edits = ContainerEdits::default().env(&self.settings.env, ids.join(","));
        if let Some(mount) = &self.settings.mount {
            edits.mounts = ids
                .iter()
                .map(|id| Mount {
                    host_path: self.settings.dir.join(id).display().to_string(),
                    container_path: mount.join(id).display().to_string(),
                    read_only: self.settings.read_only,
                })
                .collect();
        }
        Ok(edits)
    }
}

/// The watching task's state: the folder's devices by file name.
struct Watcher {
    dir: PathBuf,
    devices: Arc<watch::Sender<DeviceList>>,
    files: BTreeMap<String, Device>,
}

impl Watcher {
    async fn run(mut self, stop: CancellationToken) {
        tokio::select! {
            _ = stop.cancelled() => {}
            result = self.watch_forever() => if let Err(err) = result {
                tracing::error!(dir = %self.dir.display(), %err, "cannot watch the devices folder; its device list is frozen");
            },
        }
    }

    async fn watch_forever(&mut self) -> std::io::Result<()> {
        loop {
            self.wait_for_folder().await?;
            self.follow_folder().await?;
            tracing::warn!(dir = %self.dir.display(), "the devices folder is gone; waiting for it");
        }
    }

    /// Returns once the folder exists, watching the nearest existing ancestor meanwhile.
    async fn wait_for_folder(&mut self) -> std::io::Result<()> {
        let mut logged = false;
        loop {
            if self.dir.is_dir() {
                return Ok(());
            }
            self.publish(BTreeMap::new());
            let ancestor = self
                .dir
                .ancestors()
                .skip(1)
                .find(|p| p.is_dir())
                .unwrap_or_else(|| Path::new("/"))
                .to_owned();
            if !logged {
                logged = true;
                tracing::info!(dir = %self.dir.display(), watching = %ancestor.display(), "waiting for the devices folder to appear");
            }
            let mut events = Batches::new()?;
            events.watch(
                &ancestor,
                WatchMask::CREATE | WatchMask::MOVED_TO | WatchMask::ONLYDIR,
            )?;
            // It may have appeared between the check and the watch.
            if !self.dir.is_dir() {
                events.next().await?;
            }
        }
    }

    /// Follows the folder's files until the folder itself goes away.
    async fn follow_folder(&mut self) -> std::io::Result<()> {
        let mut events = Batches::new()?;
        events.watch(
            &self.dir,
            WatchMask::CREATE
                | WatchMask::DELETE
                | WatchMask::MOVED_FROM
                | WatchMask::MOVED_TO
                | WatchMask::CLOSE_WRITE
                | WatchMask::DELETE_SELF
                | WatchMask::MOVE_SELF
                | WatchMask::ONLYDIR,
        )?;
        // Scan after the watch is in place: nothing can slip between the two.
        self.files = scan(&self.dir);
        self.publish(self.files.clone());
        loop {
            let batch = events.next().await?;
            if !self.apply(&batch) {
                return Ok(());
            }
            self.publish(self.files.clone());
        }
    }

    /// Applies a batch of events; returns false if the folder went away.
    fn apply(&mut self, batch: &[OwnedEvent]) -> bool {
        for event in batch {
            if event
                .mask
                .intersects(EventMask::DELETE_SELF | EventMask::MOVE_SELF | EventMask::IGNORED)
            {
                return false;
            }
            if event.mask.contains(EventMask::Q_OVERFLOW) {
                self.files = scan(&self.dir);
                continue;
            }
            let Some(name) = event.name.as_ref().and_then(|n| n.to_str()) else {
                continue;
            };
            match read_device(&self.dir, name) {
                Some(device) => {
                    self.files.insert(name.to_owned(), device);
                }
                None => {
                    self.files.remove(name);
                }
            }
        }
        true
    }

    fn publish(&self, files: BTreeMap<String, Device>) {
        let list = DeviceList::new(files.into_values());
        self.devices.send_if_modified(|current| {
            let modified = *current != list;
            if modified {
                *current = list;
            }
            modified
        });
    }
}

/// Every device in `dir`, by file name.
fn scan(dir: &Path) -> BTreeMap<String, Device> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return BTreeMap::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let device = read_device(dir, &name)?;
            Some((name, device))
        })
        .collect()
}

/// The device for file `name`, or None if it is not a device (gone, not a regular file,
/// hidden, or an unusable name).
fn read_device(dir: &Path, name: &str) -> Option<Device> {
    if name.starts_with('.') || name.is_empty() {
        return None;
    }
    // The same rules as every device id: the kubelet would refuse the whole list otherwise.
    if let Err(problem) = devplug::device::check_id(name) {
        tracing::warn!(
            dir = %dir.display(),
            file = name,
            %problem,
            "this file is not a device; rename it"
        );
        return None;
    }
    let path = dir.join(name);
    let meta = std::fs::metadata(&path).ok()?;
    if !meta.is_file() {
        return None;
    }
    let mut device = Device::new(name).with_health(read_health(&path));
    // For DRA selectors: a file name that is not a DNS label gets a hashed slice name.
    device.attributes = Attributes::default().string("file", name).build();
    Some(device)
}

/// The health a file declares on its first line.
fn read_health(path: &Path) -> Health {
    let mut head = [0u8; 512];
    let read = std::fs::File::open(path).and_then(|mut f| f.read(&mut head));
    let n = match read {
        Ok(n) => n,
        Err(err) => return Health::unhealthy(format!("cannot read the device file: {err}")),
    };
    let text = String::from_utf8_lossy(&head[..n]);
    let first = text.lines().next().unwrap_or("").trim();
    if first.is_empty() || first == HEALTHY {
        Health::Healthy
    } else {
        Health::unhealthy(first.chars().take(200).collect::<String>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_comes_from_the_first_line() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| std::fs::write(dir.path().join(name), text).unwrap();
        write("a", "");
        write("b", "Healthy\nanything");
        write("c", "  fan failure  \nmore");
        write(".hidden", "");
        write("x,y", "");
        write("with space", "");
        write(&"long".repeat(16), "");
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        let found = scan(dir.path());
        assert_eq!(found.keys().collect::<Vec<_>>(), ["a", "b", "c"]);
        assert!(found["a"].health.is_healthy());
        assert!(found["b"].health.is_healthy());
        assert_eq!(found["c"].health, Health::unhealthy("fan failure"));
    }

    #[test]
    fn settings_errors_name_the_field() {
        assert_eq!(
            FilesSettings::new("relative").validate().unwrap_err().field,
            "dir"
        );
        let bad_mount = FilesSettings {
            mount: Some("colas".into()),
            ..FilesSettings::new("/etc/colas")
        };
        assert_eq!(bad_mount.validate().unwrap_err().field, "mount");
    }
}
