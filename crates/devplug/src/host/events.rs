//! What happened to each resource, as events an operator wants to see without reading logs:
//! a device turned unhealthy (with its reason) or recovered, the registration with the kubelet
//! was lost or made again. Derived from what the kubelet is told (the list after the health
//! hold-down) and from the resource's status, one small task per resource, on a host-wide
//! broadcast channel ([`Host::events`](crate::Host::events)). The cluster side turns them into
//! Kubernetes Events on the Node.

use super::status::ResourceStatus;
use crate::device::{DeviceList, Health};
use std::collections::BTreeSet;
use std::sync::Arc;
use tokio::sync::{broadcast, watch};
use tokio_util::sync::CancellationToken;

/// Something an operator should hear about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostEvent {
    /// A device the kubelet is told about turned unhealthy (or appeared unhealthy).
    DeviceUnhealthy {
        /// The resource.
        resource: String,
        /// The device id.
        device: String,
        /// The backend's reason.
        reason: String,
    },
    /// A device is healthy again (after the hold-down).
    DeviceRecovered {
        /// The resource.
        resource: String,
        /// The device id.
        device: String,
    },
    /// The kubelet no longer has our registration (its stream ended, a restart, a refusal).
    RegistrationLost {
        /// The resource.
        resource: String,
        /// The last error, if one is known.
        error: Option<String>,
    },
    /// Registered with the kubelet; `again` when it had been registered before.
    Registered {
        /// The resource.
        resource: String,
        /// True for a re-registration.
        again: bool,
    },
}

/// Follows one resource until `stop`, sending its events on `tx`.
pub(crate) fn spawn(
    resource: Arc<str>,
    mut devices: watch::Receiver<DeviceList>,
    mut status: watch::Receiver<ResourceStatus>,
    tx: broadcast::Sender<HostEvent>,
    stop: CancellationToken,
) {
    tokio::spawn(async move {
        // Only the ids that are unhealthy now: a node's devices are nearly all healthy, and a
        // map of every id cost about 100 bytes a device (300 KiB with 3 × 1,000 devices).
        let mut unhealthy: BTreeSet<String> = BTreeSet::new();
        let mut registered = false;
        let mut ever_registered = false;
        loop {
            // Devices: compare each id's health with the last list. A device that is new or was
            // healthy and is unhealthy now is reported; one that was unhealthy and is healthy
            // now has recovered (a new healthy device is no news).
            let list = devices.borrow_and_update().clone();
            let mut now = BTreeSet::new();
            for d in list.devices() {
                let was_unhealthy = unhealthy.contains(&d.id);
                match &d.health {
                    Health::Unhealthy { reason } => {
                        if !was_unhealthy {
                            let _ = tx.send(HostEvent::DeviceUnhealthy {
                                resource: resource.to_string(),
                                device: d.id.clone(),
                                reason: reason.clone(),
                            });
                        }
                        now.insert(d.id.clone());
                    }
                    Health::Healthy if was_unhealthy => {
                        let _ = tx.send(HostEvent::DeviceRecovered {
                            resource: resource.to_string(),
                            device: d.id.clone(),
                        });
                    }
                    Health::Healthy => {}
                }
            }
            unhealthy = now;
            // Registration.
            let s = status.borrow_and_update().clone();
            if s.registered != registered {
                registered = s.registered;
                if registered {
                    let _ = tx.send(HostEvent::Registered {
                        resource: resource.to_string(),
                        again: ever_registered,
                    });
                    ever_registered = true;
                } else if !stop.is_cancelled() {
                    let _ = tx.send(HostEvent::RegistrationLost {
                        resource: resource.to_string(),
                        error: s.last_error.clone(),
                    });
                }
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                changed = devices.changed() => if changed.is_err() { return },
                changed = status.changed() => if changed.is_err() { return },
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;
    use std::time::Duration;

    fn list(devices: &[(&str, bool)]) -> DeviceList {
        DeviceList::new(devices.iter().map(|(id, healthy)| {
            let device = Device::new(*id);
            if *healthy {
                device
            } else {
                device.with_health(Health::unhealthy("broken"))
            }
        }))
    }

    async fn next(rx: &mut broadcast::Receiver<HostEvent>) -> Option<HostEvent> {
        tokio::time::timeout(Duration::from_millis(200), rx.recv())
            .await
            .ok()
            .and_then(Result::ok)
    }

    fn unhealthy(device: &str) -> HostEvent {
        HostEvent::DeviceUnhealthy {
            resource: "r".into(),
            device: device.into(),
            reason: "broken".into(),
        }
    }

    fn recovered(device: &str) -> HostEvent {
        HostEvent::DeviceRecovered {
            resource: "r".into(),
            device: device.into(),
        }
    }

    #[tokio::test]
    async fn health_changes_become_events_once_each() {
        let (devices, devices_rx) = watch::channel(list(&[("a", true), ("b", false)]));
        let (_status, status_rx) = watch::channel(ResourceStatus::default());
        let (tx, mut rx) = broadcast::channel(16);
        let stop = CancellationToken::new();
        spawn("r".into(), devices_rx, status_rx, tx, stop.clone());
        // A device unhealthy from the start is news; healthy ones are not.
        assert_eq!(next(&mut rx).await, Some(unhealthy("b")));
        // Still unhealthy, a new healthy device: nothing.
        devices.send_replace(list(&[("a", true), ("b", false), ("c", true)]));
        assert_eq!(next(&mut rx).await, None);
        // b recovers, a breaks.
        devices.send_replace(list(&[("a", false), ("b", true), ("c", true)]));
        let mut got = vec![next(&mut rx).await, next(&mut rx).await];
        got.sort_by_key(|e| format!("{e:?}"));
        assert_eq!(got, [Some(recovered("b")), Some(unhealthy("a"))]);
        // a vanishes while unhealthy and comes back unhealthy: news again; c vanishes: nothing.
        devices.send_replace(list(&[("b", true)]));
        assert_eq!(next(&mut rx).await, None);
        devices.send_replace(list(&[("a", false), ("b", true)]));
        assert_eq!(next(&mut rx).await, Some(unhealthy("a")));
        // A device that comes back healthy after vanishing unhealthy did not "recover".
        devices.send_replace(list(&[("b", true)]));
        // (Let the task see that list: a watch channel keeps only the latest.)
        assert_eq!(next(&mut rx).await, None);
        devices.send_replace(list(&[("a", true), ("b", true)]));
        assert_eq!(next(&mut rx).await, None);
        stop.cancel();
    }
}
