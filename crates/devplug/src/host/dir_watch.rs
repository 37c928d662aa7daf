//! Watches the kubelet's device-plugins folder with inotify and tells every resource what
//! appeared and vanished there: `kubelet.sock` created (a kubelet started) or a plugin socket
//! deleted (a kubelet restart wipes them all). No polling.

use inotify::{EventMask, Inotify, WatchMask};
use std::ffi::OsString;
use std::io;
use std::path::Path;
use tokio::sync::broadcast;
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;

/// Something changed in the kubelet folder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum DirEvent {
    /// A file appeared (created or moved in).
    Created(OsString),
    /// A file vanished (deleted or moved out).
    Removed(OsString),
    /// Events were lost (queue overflow, or the watch ended): check everything again.
    Rescan,
}

/// Starts watching `dir`. Events go to the returned sender's subscribers until `stop` fires.
pub(crate) fn watch(
    dir: &Path,
    stop: CancellationToken,
) -> io::Result<broadcast::Sender<DirEvent>> {
    let inotify = Inotify::init()?;
    inotify.watches().add(
        dir,
        WatchMask::CREATE | WatchMask::DELETE | WatchMask::MOVED_FROM | WatchMask::MOVED_TO,
    )?;
    let mut events = inotify.into_event_stream([0u8; 4096])?;
    let (tx, _) = broadcast::channel(256);
    let sender = tx.clone();
    let dir = dir.display().to_string();
    tokio::spawn(async move {
        loop {
            let event = tokio::select! {
                _ = stop.cancelled() => return,
                event = events.next() => event,
            };
            let out = match event {
                Some(Ok(ev)) if ev.mask.contains(EventMask::Q_OVERFLOW) => DirEvent::Rescan,
                Some(Ok(ev)) if ev.mask.contains(EventMask::IGNORED) => {
                    tracing::warn!(%dir, "the kubelet folder is gone; restart watching stopped");
                    let _ = tx.send(DirEvent::Rescan);
                    return;
                }
                Some(Ok(ev)) => match ev.name {
                    Some(name) if ev.mask.intersects(EventMask::CREATE | EventMask::MOVED_TO) => {
                        DirEvent::Created(name)
                    }
                    Some(name) => DirEvent::Removed(name),
                    None => continue,
                },
                Some(Err(err)) => {
                    tracing::warn!(%dir, %err, "reading inotify events failed; rescanning");
                    DirEvent::Rescan
                }
                None => return,
            };
            // No receivers is fine: no resource runs right now.
            let _ = tx.send(out);
        }
    });
    Ok(sender)
}
