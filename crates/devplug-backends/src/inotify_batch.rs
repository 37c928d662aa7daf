//! inotify for backends: watch several folders and receive events in batches (everything that
//! is ready at once), or in bursts (batches until things are quiet), so that a burst of changes
//! becomes one rescan and one published list.

use inotify::{Event, EventStream, Inotify, WatchDescriptor, WatchMask};
use std::ffi::OsString;
use std::io;
use std::path::Path;
use std::time::Duration;
use tokio::time::{sleep, sleep_until, Instant};
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;

/// A burst ends after this long without events...
const QUIET: Duration = Duration::from_millis(10);
/// ...or this long after it began, whichever comes first.
const MAX_BURST: Duration = Duration::from_millis(100);

/// An inotify instance with its event stream.
pub(crate) struct Batches {
    stream: EventStream<[u8; 8192]>,
}

/// One inotify event, owned.
pub(crate) type OwnedEvent = Event<OsString>;

impl Batches {
    /// A new inotify instance with no watches.
    pub(crate) fn new() -> io::Result<Batches> {
        let stream = Inotify::init()?.into_event_stream([0u8; 8192])?;
        Ok(Batches { stream })
    }

    /// Adds (or updates) a watch on `path`.
    pub(crate) fn watch(&mut self, path: &Path, mask: WatchMask) -> io::Result<WatchDescriptor> {
        self.stream.watches().add(path, mask)
    }

    /// Waits for at least one event, then takes every event that is ready without waiting.
    pub(crate) async fn next(&mut self) -> io::Result<Vec<OwnedEvent>> {
        let first = match self.stream.next().await {
            Some(event) => event?,
            None => return Err(io::Error::other("inotify stream ended")),
        };
        let mut batch = vec![first];
        loop {
            tokio::select! {
                biased;
                event = self.stream.next() => match event {
                    Some(event) => batch.push(event?),
                    None => break,
                },
                () = std::future::ready(()) => break,
            }
        }
        Ok(batch)
    }

    /// Waits for events, then until they have been quiet for 10 ms (at most 100 ms after the
    /// first): a driver loading or a hub plugged in becomes one wake-up. `Ok(false)` when
    /// `stop` fires; an error when inotify failed.
    pub(crate) async fn next_burst(&mut self, stop: &CancellationToken) -> io::Result<bool> {
        tokio::select! {
            _ = stop.cancelled() => return Ok(false),
            batch = self.next() => { batch?; }
        }
        let deadline = Instant::now() + MAX_BURST;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return Ok(false),
                _ = sleep(QUIET) => return Ok(true),
                _ = sleep_until(deadline) => return Ok(true),
                more = self.next() => if more.is_err() { return Ok(true) },
            }
        }
    }
}
