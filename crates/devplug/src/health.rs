//! Health that recovers: a device that breaks is reported unhealthy at once; a device that comes
//! back is reported healthy only after it has stayed healthy for a hold-down period, so that a
//! flapping device does not churn the kubelet. The gate is a pure state machine (time is passed
//! in), used by the host for every backend.

use crate::device::{Device, DeviceList, Health};
use std::collections::HashMap;
use std::time::Duration;
use tokio::time::Instant;

/// One device's health changed as the kubelet sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transition {
    /// The device.
    pub id: String,
    /// Health before (None: the device is new).
    pub from: Option<Health>,
    /// Health now (None: the device is gone).
    pub to: Option<Health>,
}

#[derive(Debug, Clone)]
struct Tracked {
    /// What the kubelet was last told.
    published: Health,
    /// Since when the backend has reported the device healthy again, while still published
    /// unhealthy.
    recovering_since: Option<Instant>,
}

/// Applies the hold-down to successive device lists from a backend.
#[derive(Debug, Clone)]
pub struct HealthGate {
    hold_down: Duration,
    devices: HashMap<String, Tracked>,
}

/// What the gate decided for one input.
#[derive(Debug, Clone)]
pub struct Gated {
    /// The list to publish.
    pub list: DeviceList,
    /// When to apply the gate again to release a pending recovery, if any is pending.
    pub next_check: Option<Instant>,
    /// Changes of published health since the last call.
    pub transitions: Vec<Transition>,
}

impl HealthGate {
    /// A gate that holds recoveries back for `hold_down` (zero passes them at once).
    pub fn new(hold_down: Duration) -> Self {
        HealthGate {
            hold_down,
            devices: HashMap::new(),
        }
    }

    /// Changes the hold-down; pending recoveries use the new value from now on.
    pub fn set_hold_down(&mut self, hold_down: Duration) {
        self.hold_down = hold_down;
    }

    /// The list to publish for the backend's `raw` list at time `now`.
    pub fn apply(&mut self, raw: &DeviceList, now: Instant) -> Gated {
        let mut transitions = Vec::new();
        let mut next_check: Option<Instant> = None;
        let mut seen = HashMap::with_capacity(raw.len());
        let mut out = Vec::with_capacity(raw.len());
        for device in raw.devices() {
            let previous = self.devices.remove(&device.id);
            let tracked = match previous {
                None => {
                    transitions.push(Transition {
                        id: device.id.clone(),
                        from: None,
                        to: Some(device.health.clone()),
                    });
                    Tracked {
                        published: device.health.clone(),
                        recovering_since: None,
                    }
                }
                Some(prev) => match (&prev.published, &device.health) {
                    (Health::Unhealthy { .. }, Health::Healthy) => {
                        let since = prev.recovering_since.unwrap_or(now);
                        let due = since + self.hold_down;
                        if due <= now {
                            transitions.push(Transition {
                                id: device.id.clone(),
                                from: Some(prev.published.clone()),
                                to: Some(Health::Healthy),
                            });
                            Tracked {
                                published: Health::Healthy,
                                recovering_since: None,
                            }
                        } else {
                            next_check = Some(next_check.map_or(due, |n| n.min(due)));
                            Tracked {
                                published: prev.published.clone(),
                                recovering_since: Some(since),
                            }
                        }
                    }
                    (published, reported) => {
                        if published != reported {
                            transitions.push(Transition {
                                id: device.id.clone(),
                                from: Some(published.clone()),
                                to: Some(reported.clone()),
                            });
                        }
                        Tracked {
                            published: reported.clone(),
                            recovering_since: None,
                        }
                    }
                },
            };
            out.push(Device {
                health: tracked.published.clone(),
                ..device.clone()
            });
            seen.insert(device.id.clone(), tracked);
        }
        for (id, gone) in self.devices.drain() {
            transitions.push(Transition {
                id,
                from: Some(gone.published),
                to: None,
            });
        }
        self.devices = seen;
        Gated {
            list: DeviceList::new(out),
            next_check,
            transitions,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(health: Health) -> DeviceList {
        DeviceList::new([Device::new("a").with_health(health), Device::new("b")])
    }

    #[test]
    fn breaks_at_once_recovers_after_hold_down() {
        let t0 = Instant::now();
        let hold = Duration::from_secs(10);
        let mut gate = HealthGate::new(hold);
        let first = gate.apply(&list(Health::Healthy), t0);
        assert_eq!(first.transitions.len(), 2, "new devices are transitions");

        let broken = gate.apply(&list(Health::unhealthy("xid 79")), t0);
        assert_eq!(broken.list.healthy_count(), 1);
        assert_eq!(broken.transitions[0].to, Some(Health::unhealthy("xid 79")));

        // Back, but held down: still unhealthy with its reason, and a check is scheduled.
        let back = gate.apply(&list(Health::Healthy), t0 + Duration::from_secs(1));
        assert_eq!(
            back.list.get("a").unwrap().health,
            Health::unhealthy("xid 79")
        );
        assert_eq!(back.next_check, Some(t0 + Duration::from_secs(11)));
        assert!(back.transitions.is_empty());

        let early = gate.apply(&list(Health::Healthy), t0 + Duration::from_secs(5));
        assert!(!early.list.get("a").unwrap().health.is_healthy());
        let later = gate.apply(&list(Health::Healthy), t0 + Duration::from_secs(11));
        assert!(later.list.get("a").unwrap().health.is_healthy());
        assert_eq!(later.transitions.len(), 1);
        assert_eq!(later.next_check, None);
    }

    #[test]
    fn a_flap_during_hold_down_restarts_it() {
        let t0 = Instant::now();
        let mut gate = HealthGate::new(Duration::from_secs(10));
        gate.apply(&list(Health::unhealthy("x")), t0);
        gate.apply(&list(Health::Healthy), t0 + Duration::from_secs(1));
        gate.apply(&list(Health::unhealthy("y")), t0 + Duration::from_secs(2));
        let back = gate.apply(&list(Health::Healthy), t0 + Duration::from_secs(3));
        assert_eq!(back.next_check, Some(t0 + Duration::from_secs(13)));
        let at_11 = gate.apply(&list(Health::Healthy), t0 + Duration::from_secs(11));
        assert!(!at_11.list.get("a").unwrap().health.is_healthy());
    }

    #[test]
    fn zero_hold_down_passes_through_and_removals_are_transitions() {
        let t0 = Instant::now();
        let mut gate = HealthGate::new(Duration::ZERO);
        gate.apply(&list(Health::unhealthy("x")), t0);
        let back = gate.apply(&list(Health::Healthy), t0);
        assert_eq!(back.list.healthy_count(), 2);
        let gone = gate.apply(&DeviceList::new([Device::new("a")]), t0);
        assert_eq!(
            gone.transitions,
            vec![Transition {
                id: "b".into(),
                from: Some(Health::Healthy),
                to: None
            }]
        );
    }
}
