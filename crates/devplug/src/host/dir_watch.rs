//! Follows the kubelet's device-plugins folder with inotify and tells every resource what
//! appeared and vanished there: `kubelet.sock` created (a kubelet started) or a plugin socket
//! deleted (a kubelet restart wipes them all). No polling.
//!
//! The folder itself may be missing (a wrong `--kubelet-dir`, a kubelet not installed yet) or be
//! removed and created again (a node re-image, a careless script). While it is missing, the
//! nearest existing ancestor is watched for the next path component; when the folder is back,
//! it is watched again and every resource is told to check its socket and registration. The
//! folder's state is published so that health checks can say when following it failed.

use inotify::{EventMask, Inotify, WatchDescriptor, WatchMask, Watches};
use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::sync::{broadcast, watch};
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;

/// Something changed in the kubelet folder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum DirEvent {
    /// A file appeared (created or moved in).
    Created(OsString),
    /// A file vanished (deleted or moved out).
    Removed(OsString),
    /// Events were lost, or the folder itself came or went: check everything again.
    Rescan,
}

/// Whether the kubelet folder can be followed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum FolderState {
    /// The folder exists and is watched.
    Present,
    /// The folder does not exist; `watching` (its nearest existing ancestor) is watched for it.
    Missing {
        /// The ancestor being watched.
        watching: PathBuf,
    },
    /// Neither the folder nor an ancestor can be watched: kubelet restarts will not be seen
    /// until this clears. The reason says why.
    Broken(String),
}

/// The folder follower's outputs.
pub(crate) struct FolderWatch {
    /// Changes inside the folder, for every resource.
    pub(crate) events: broadcast::Sender<DirEvent>,
    /// The folder's state, for resources (bind only when present) and health checks.
    pub(crate) state: watch::Receiver<FolderState>,
}

/// What a folder follower said next, to a loop that only needs to wake up on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FolderNews {
    /// The folder's state changed (it came back, or went).
    State,
    /// Something changed inside the folder, or events were lost: check again.
    Inside,
    /// The follower ended: only at shutdown.
    Ended,
}

/// Waits for the next news of a folder follower. Cancel-safe, like the receivers it reads.
pub(crate) async fn next_news(
    folder: &mut watch::Receiver<FolderState>,
    events: &mut broadcast::Receiver<DirEvent>,
) -> FolderNews {
    tokio::select! {
        changed = folder.changed() => match changed {
            Ok(()) => FolderNews::State,
            Err(_) => FolderNews::Ended,
        },
        event = events.recv() => match event {
            Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => FolderNews::Inside,
            Err(broadcast::error::RecvError::Closed) => FolderNews::Ended,
        },
    }
}

/// The events of interest on the folder itself.
fn folder_mask() -> WatchMask {
    WatchMask::CREATE
        | WatchMask::DELETE
        | WatchMask::MOVED_FROM
        | WatchMask::MOVED_TO
        | WatchMask::DELETE_SELF
        | WatchMask::MOVE_SELF
        | WatchMask::ONLYDIR
}

/// The events of interest on an ancestor while the folder is missing.
fn ancestor_mask() -> WatchMask {
    WatchMask::CREATE
        | WatchMask::MOVED_TO
        | WatchMask::DELETE_SELF
        | WatchMask::MOVE_SELF
        | WatchMask::ONLYDIR
}

/// What is watched right now.
enum Armed {
    Folder(WatchDescriptor),
    Ancestor {
        wd: WatchDescriptor,
        /// The path component whose creation brings the folder closer.
        next: OsString,
    },
    Nothing,
}

/// Starts following `dir`. Events go to the returned sender's subscribers until `stop` fires.
/// Fails only if inotify itself is unavailable; a missing folder is followed until it exists.
pub(crate) fn watch(dir: &Path, stop: CancellationToken) -> io::Result<FolderWatch> {
    let inotify = Inotify::init()?;
    let mut watches = inotify.watches();
    let mut stream = inotify.into_event_stream([0u8; 4096])?;
    let (armed, first) = arm(&mut watches, dir);
    let (state_tx, state) = watch::channel(first);
    let (tx, _) = broadcast::channel(256);
    let events = tx.clone();
    let dir = dir.to_owned();
    tokio::spawn(async move {
        let mut armed = armed;
        let mut retry = RetryDelay::default();
        loop {
            let broken = matches!(*state_tx.borrow(), FolderState::Broken(_));
            let event = tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(retry.current()), if broken => None,
                event = stream.next() => match event {
                    Some(event) => Some(event),
                    None => return,
                },
            };
            let rearm = match event {
                // Broken: try again after the delay.
                None => true,
                Some(Err(err)) => {
                    tracing::warn!(dir = %dir.display(), %err, "reading inotify events failed; checking the folder again");
                    true
                }
                Some(Ok(ev)) if ev.mask.contains(EventMask::Q_OVERFLOW) => true,
                Some(Ok(ev)) => match &armed {
                    Armed::Folder(wd) if ev.wd == *wd => {
                        if ev.mask.intersects(
                            EventMask::DELETE_SELF | EventMask::MOVE_SELF | EventMask::IGNORED,
                        ) {
                            tracing::warn!(dir = %dir.display(), "the kubelet folder was removed or moved; waiting for it to come back");
                            true
                        } else {
                            if let Some(name) = ev.name {
                                let out = if ev
                                    .mask
                                    .intersects(EventMask::CREATE | EventMask::MOVED_TO)
                                {
                                    DirEvent::Created(name)
                                } else {
                                    DirEvent::Removed(name)
                                };
                                // No receivers is fine: no resource runs right now.
                                let _ = tx.send(out);
                            }
                            false
                        }
                    }
                    Armed::Ancestor { wd, next } if ev.wd == *wd => {
                        ev.mask.intersects(
                            EventMask::DELETE_SELF | EventMask::MOVE_SELF | EventMask::IGNORED,
                        ) || ev.name.as_ref() == Some(next)
                    }
                    // An event of a watch we already replaced.
                    _ => false,
                },
            };
            if !rearm {
                continue;
            }
            if let Armed::Folder(wd) | Armed::Ancestor { wd, .. } =
                std::mem::replace(&mut armed, Armed::Nothing)
            {
                // Fails harmlessly when the kernel already dropped the watch.
                let _ = watches.remove(wd);
            }
            let (now, state) = arm(&mut watches, &dir);
            armed = now;
            match &state {
                FolderState::Present => {
                    retry = RetryDelay::default();
                    if !matches!(*state_tx.borrow(), FolderState::Present) {
                        tracing::info!(dir = %dir.display(), "the kubelet folder is there; watching it");
                    }
                }
                FolderState::Missing { watching } => {
                    retry = RetryDelay::default();
                    tracing::debug!(dir = %dir.display(), watching = %watching.display(), "the kubelet folder is missing; watching its nearest ancestor");
                }
                FolderState::Broken(reason) => {
                    tracing::error!(dir = %dir.display(), %reason, retry_in = ?retry.current(), "cannot follow the kubelet folder; kubelet restarts will not be noticed until this is fixed");
                    retry.grow();
                }
            }
            state_tx.send_replace(state);
            let _ = tx.send(DirEvent::Rescan);
        }
    });
    Ok(FolderWatch { events, state })
}

/// Watches `dir` if it exists, or its nearest existing ancestor if not. Re-checks after adding
/// a watch, so a folder created in between is not missed.
fn arm(watches: &mut Watches, dir: &Path) -> (Armed, FolderState) {
    // Each round either finds the folder or moves one level; a path that keeps changing under
    // us gives up after a few rounds (and is retried later).
    for _ in 0..64 {
        if dir.exists() && !dir.is_dir() {
            return (Armed::Nothing, not_a_folder(dir));
        }
        match watches.add(dir, folder_mask()) {
            Ok(wd) => return (Armed::Folder(wd), FolderState::Present),
            Err(err) if is_missing(&err) => {}
            Err(err) => return (Armed::Nothing, broken(dir, &err)),
        }
        let Some((ancestor, next)) = nearest_ancestor(dir) else {
            return (
                Armed::Nothing,
                FolderState::Broken(format!("no ancestor of {} exists to watch", dir.display())),
            );
        };
        match watches.add(&ancestor, ancestor_mask()) {
            Ok(wd) => {
                // Created between our look and the watch? Then go round again. A file made
                // there meanwhile sent its event before the watch: say so now, or the folder
                // would be waited for forever.
                let below = ancestor.join(&next);
                if below.is_dir() {
                    let _ = watches.remove(wd);
                    continue;
                }
                if below.symlink_metadata().is_ok() {
                    let _ = watches.remove(wd);
                    return (Armed::Nothing, not_a_folder(&below));
                }
                return (
                    Armed::Ancestor { wd, next },
                    FolderState::Missing { watching: ancestor },
                );
            }
            Err(err) if is_missing(&err) => continue,
            Err(err) => return (Armed::Nothing, broken(&ancestor, &err)),
        }
    }
    (
        Armed::Nothing,
        FolderState::Broken(format!("{} keeps changing; cannot watch it", dir.display())),
    )
}

fn not_a_folder(path: &Path) -> FolderState {
    FolderState::Broken(format!(
        "{} is not a folder; the kubelet's device-plugins folder is meant",
        path.display()
    ))
}

fn is_missing(err: &io::Error) -> bool {
    err.kind() == io::ErrorKind::NotFound || err.raw_os_error() == Some(20) // ENOTDIR
}

fn broken(path: &Path, err: &io::Error) -> FolderState {
    let hint = match err.raw_os_error() {
        Some(28) => " (the inotify watch limit is reached: raise fs.inotify.max_user_watches)",
        Some(13) => " (permission denied: run devplug as root, as the kubelet folder is root's)",
        _ => "",
    };
    FolderState::Broken(format!("cannot watch {}: {err}{hint}", path.display()))
}

/// The deepest existing ancestor of `dir` that is a folder, and the component below it.
fn nearest_ancestor(dir: &Path) -> Option<(PathBuf, OsString)> {
    let mut child = dir;
    while let Some(parent) = child.parent() {
        let parent = if parent.as_os_str().is_empty() {
            Path::new(".")
        } else {
            parent
        };
        if parent.is_dir() {
            return Some((parent.to_owned(), child.file_name()?.to_owned()));
        }
        child = parent;
    }
    None
}

/// The delay between attempts to re-arm a broken watch: 1 s doubling to a minute. Only runs
/// while the watch is broken.
struct RetryDelay(Duration);

impl Default for RetryDelay {
    fn default() -> Self {
        RetryDelay(Duration::from_secs(1))
    }
}

impl RetryDelay {
    fn current(&self) -> Duration {
        self.0
    }

    fn grow(&mut self) {
        self.0 = self.0.saturating_mul(2).min(Duration::from_secs(60));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn next_state(state: &mut watch::Receiver<FolderState>) -> FolderState {
        tokio::time::timeout(Duration::from_secs(5), state.changed())
            .await
            .expect("a state change in time")
            .expect("the watch runs");
        state.borrow_and_update().clone()
    }

    #[tokio::test]
    async fn follows_a_folder_that_is_removed_and_created_again() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("kubelet/device-plugins");
        let stop = CancellationToken::new();
        let mut folder = watch(&dir, stop.clone()).unwrap();
        assert_eq!(
            *folder.state.borrow_and_update(),
            FolderState::Missing {
                watching: root.path().to_owned()
            }
        );
        // Created one level at a time: the watch walks down.
        std::fs::create_dir(root.path().join("kubelet")).unwrap();
        assert!(matches!(
            next_state(&mut folder.state).await,
            FolderState::Missing { watching } if watching == root.path().join("kubelet")
        ));
        std::fs::create_dir(&dir).unwrap();
        assert_eq!(next_state(&mut folder.state).await, FolderState::Present);

        let mut events = folder.events.subscribe();
        std::fs::remove_dir_all(root.path().join("kubelet")).unwrap();
        assert!(matches!(
            next_state(&mut folder.state).await,
            FolderState::Missing { .. }
        ));
        std::fs::create_dir_all(&dir).unwrap();
        // Possibly via an intermediate Missing state, then Present.
        let mut state = next_state(&mut folder.state).await;
        while state != FolderState::Present {
            state = next_state(&mut folder.state).await;
        }
        // Files in the new folder are reported.
        std::fs::write(dir.join("kubelet.sock"), b"").unwrap();
        loop {
            let event = tokio::time::timeout(Duration::from_secs(5), events.recv())
                .await
                .unwrap()
                .unwrap();
            if event == DirEvent::Created("kubelet.sock".into()) {
                break;
            }
        }
        stop.cancel();
    }

    #[test]
    fn the_nearest_ancestor_is_the_deepest_existing_folder() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("a/b/c");
        std::fs::create_dir(root.path().join("a")).unwrap();
        assert_eq!(
            nearest_ancestor(&dir),
            Some((root.path().join("a"), OsString::from("b")))
        );
    }
}
