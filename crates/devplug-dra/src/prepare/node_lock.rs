//! The node-wide lock on a driver's checkpoint, for two instances of the driver serving at once.
//!
//! A rolling update with surge runs the new devplug beside the old one for a moment: both are
//! registered (each under its own socket names), the kubelet calls the newer one, and a call
//! it made before the newer one registered still finishes in the older one. Both prepare into
//! the same checkpoint and CDI folder. Each change (a prepare's or unprepare's backend calls,
//! specs and checkpoint write) therefore holds an exclusive `flock(2)` on
//! `<checkpoint>.lock`, and starts by reading the checkpoint again when another instance
//! wrote it since this one last read or wrote it ([`super::super::checkpoint::FileStamp`]). So
//! neither instance answers from claims the other one changed, and neither writes the other's
//! changes away. In one process the driver's own mutex orders the calls first; the file lock
//! is contended only across processes.
//!
//! `flock` is released by the kernel when the holder's file is closed or the process dies, so
//! a killed instance never leaves the lock held.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

/// The lock file beside `checkpoint`: `<checkpoint>.lock`.
pub fn lock_path(checkpoint: &Path) -> PathBuf {
    let mut name = checkpoint.as_os_str().to_owned();
    name.push(".lock");
    PathBuf::from(name)
}

/// Opens (creating it, owner-only) the lock file of `checkpoint`.
fn open(checkpoint: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    if let Some(dir) = checkpoint.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
    }
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(lock_path(checkpoint))
}

/// Takes the lock of `checkpoint`, waiting (on the blocking pool) while another instance holds
/// it. Held until the returned file is dropped.
pub async fn lock(checkpoint: &Path) -> std::io::Result<File> {
    let checkpoint = checkpoint.to_owned();
    tokio::task::spawn_blocking(move || {
        let file = open(&checkpoint)?;
        file.lock()?;
        Ok(file)
    })
    .await
    .unwrap_or_else(|join| Err(std::io::Error::other(join.to_string())))
}

/// Takes the lock of `checkpoint` only if no other instance holds it (for the start's clean-up,
/// which must not wait on another instance's call): `Ok(None)` when it is held.
pub fn try_lock(checkpoint: &Path) -> std::io::Result<Option<File>> {
    let file = open(checkpoint)?;
    match file.try_lock() {
        Ok(()) => Ok(Some(file)),
        Err(std::fs::TryLockError::WouldBlock) => Ok(None),
        Err(std::fs::TryLockError::Error(err)) => Err(err),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn one_holder_at_a_time_and_released_when_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let checkpoint = dir.path().join("drv").join("checkpoint.json");
        let held = lock(&checkpoint).await.unwrap();
        assert!(lock_path(&checkpoint).exists());
        // flock is per open file: a second open of the file (another instance) is refused.
        assert!(try_lock(&checkpoint).unwrap().is_none());
        drop(held);
        let again = try_lock(&checkpoint).unwrap();
        assert!(again.is_some());
    }
}
