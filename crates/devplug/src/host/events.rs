//! What happened to each resource, as events an operator wants to see without reading logs:
//! a device turned unhealthy (with its reason) or recovered, the registration with the kubelet
//! was lost or made again. Derived from what the kubelet is told (the list after the health
//! hold-down) and from the resource's status, one small task per resource, on a host-wide
//! broadcast channel ([`Host::events`](crate::Host::events)). The cluster side turns them into
//! Kubernetes Events on the Node.

use super::status::ResourceStatus;
use crate::device::{DeviceList, Health};
use std::collections::BTreeMap;
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
        let mut health: BTreeMap<String, Health> = BTreeMap::new();
        let mut registered = false;
        let mut ever_registered = false;
        let mut first = true;
        loop {
            // Devices: compare each id's health with the last list.
            let list = devices.borrow_and_update().clone();
            let mut now = BTreeMap::new();
            for d in list.devices() {
                let before = health.get(&d.id);
                match (&d.health, before) {
                    (Health::Unhealthy { reason }, None | Some(Health::Healthy)) => {
                        let _ = tx.send(HostEvent::DeviceUnhealthy {
                            resource: resource.to_string(),
                            device: d.id.clone(),
                            reason: reason.clone(),
                        });
                    }
                    (Health::Healthy, Some(Health::Unhealthy { .. })) if !first => {
                        let _ = tx.send(HostEvent::DeviceRecovered {
                            resource: resource.to_string(),
                            device: d.id.clone(),
                        });
                    }
                    _ => {}
                }
                now.insert(d.id.clone(), d.health.clone());
            }
            health = now;
            first = false;
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
