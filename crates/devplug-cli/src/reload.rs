//! Watching the config file for changes: inotify on its folder, so that an in-place write, an
//! editor's rename and a Kubernetes ConfigMap update (a `..data` symlink swap) are all seen.
//! Events are debounced briefly, and the file is re-read only when its text changed.

use inotify::{Inotify, WatchMask};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio_stream::StreamExt;

/// Quiet time after an event before reading the file: editors and ConfigMaps write in steps.
const SETTLE: Duration = Duration::from_millis(50);

/// A watch on the config file's folder.
pub struct ConfigWatch {
    events: inotify::EventStream<[u8; 4096]>,
    path: PathBuf,
}

impl ConfigWatch {
    /// Watches the folder holding `path`.
    pub fn new(path: &Path) -> std::io::Result<ConfigWatch> {
        let folder = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
            _ => PathBuf::from("."),
        };
        let inotify = Inotify::init()?;
        inotify.watches().add(
            &folder,
            WatchMask::CREATE
                | WatchMask::CLOSE_WRITE
                | WatchMask::MOVED_TO
                | WatchMask::MOVED_FROM
                | WatchMask::DELETE
                | WatchMask::ONLYDIR,
        )?;
        Ok(ConfigWatch {
            events: inotify.into_event_stream([0u8; 4096])?,
            path: path.to_owned(),
        })
    }

    /// Waits until something changed in the folder and settled; returns the file's text now
    /// (or why it cannot be read).
    pub async fn changed(&mut self) -> std::io::Result<String> {
        match self.events.next().await {
            Some(event) => {
                event?;
            }
            None => return Err(std::io::Error::other("the config folder watch ended")),
        }
        loop {
            tokio::select! {
                more = self.events.next() => if more.is_none() { break },
                () = tokio::time::sleep(SETTLE) => break,
            }
        }
        std::fs::read_to_string(&self.path)
    }
}
