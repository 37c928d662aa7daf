//! The per-resource feed between a backend and the kubelet: it follows the backend's device list,
//! applies the health hold-down, logs every health transition once, and publishes the result on
//! the channel that ListAndWatch and Allocate read. The backend can be swapped without touching
//! the socket or the streams (config reload). A timer runs only while a recovery is pending.

use crate::device::{DeviceList, Health};
use crate::health::{HealthGate, Transition};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::time::{sleep_until, Instant};
use tokio_util::sync::CancellationToken;

/// Changes sent to a running feed.
pub(crate) enum FeedControl {
    /// Follow another backend's list.
    Source(watch::Receiver<DeviceList>),
    /// Use another hold-down.
    HoldDown(Duration),
}

/// Starts the feed; returns its control channel and the published list.
pub(crate) fn spawn(
    resource: Arc<str>,
    mut source: watch::Receiver<DeviceList>,
    hold_down: Duration,
    stop: CancellationToken,
) -> (
    mpsc::UnboundedSender<FeedControl>,
    watch::Receiver<DeviceList>,
) {
    let mut gate = HealthGate::new(hold_down);
    let first = gate.apply(&source.borrow_and_update(), Instant::now());
    log_transitions(&resource, &first.transitions, true);
    let (out, published) = watch::channel(first.list);
    let (control, mut commands) = mpsc::unbounded_channel();
    let mut next_check = first.next_check;
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = sleep_until(next_check.unwrap_or_else(Instant::now)), if next_check.is_some() => {}
                changed = source.changed() => if changed.is_err() {
                    // The backend is gone; keep the last list until stopped or given a new source.
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        command = commands.recv() => match command {
                            Some(command) => apply(command, &mut source, &mut gate),
                            None => return,
                        },
                    }
                },
                command = commands.recv() => match command {
                    Some(command) => apply(command, &mut source, &mut gate),
                    None => return,
                },
            }
            let gated = gate.apply(&source.borrow_and_update(), Instant::now());
            log_transitions(&resource, &gated.transitions, false);
            next_check = gated.next_check;
            out.send_if_modified(|current| {
                let modified = *current != gated.list;
                if modified {
                    *current = gated.list;
                }
                modified
            });
        }
    });
    (control, published)
}

fn apply(command: FeedControl, source: &mut watch::Receiver<DeviceList>, gate: &mut HealthGate) {
    match command {
        FeedControl::Source(new) => *source = new,
        FeedControl::HoldDown(d) => gate.set_hold_down(d),
    }
}

/// One log line per transition: new devices and removals at debug (a rescan can add hundreds),
/// health changes at info/warn with the reason.
fn log_transitions(resource: &str, transitions: &[Transition], initial: bool) {
    for t in transitions {
        match (&t.from, &t.to) {
            (Some(Health::Healthy), Some(Health::Unhealthy { reason })) => {
                tracing::warn!(resource, device = %t.id, %reason, "device unhealthy");
            }
            (Some(Health::Unhealthy { reason }), Some(Health::Healthy)) => {
                tracing::info!(resource, device = %t.id, was = %reason, "device healthy again");
            }
            (Some(Health::Unhealthy { .. }), Some(Health::Unhealthy { reason })) => {
                tracing::info!(resource, device = %t.id, %reason, "device still unhealthy, new reason");
            }
            (None, Some(Health::Unhealthy { reason })) if !initial => {
                tracing::warn!(resource, device = %t.id, %reason, "device appeared unhealthy");
            }
            (None, Some(_)) => tracing::debug!(resource, device = %t.id, "device appeared"),
            (Some(_), None) => tracing::info!(resource, device = %t.id, "device removed"),
            _ => {}
        }
    }
}
