//! Health that recovers: a device that breaks is reported unhealthy at once; a device that comes
//! back is reported healthy only after it has stayed healthy for a hold-down period, so that a
//! flapping device does not churn the kubelet. The gate is a pure state machine (time is passed
//! in), used by the host for every backend.

use crate::device::{DeviceList, Health};
use std::collections::HashMap;
use std::time::Duration;
use tokio::time::Instant;

/// When a hold-down ends beyond what the clock can represent, the next look comes this much later.
const FAR_CHECK: Duration = Duration::from_secs(86_400);

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

/// Applies the hold-down to successive device lists from a backend.
///
/// It keeps the list it last published (shared with the backend's list when no device is held
/// down, so it costs no copy) and the devices that are recovering.
#[derive(Debug, Clone)]
pub struct HealthGate {
    hold_down: Duration,
    published: DeviceList,
    /// Devices published unhealthy that the backend reports healthy, since when.
    recovering: HashMap<String, Instant>,
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
            published: DeviceList::default(),
            recovering: HashMap::new(),
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
        // Devices whose published health differs from what the backend reports.
        let mut held: HashMap<&str, Health> = HashMap::new();
        let mut still_recovering = HashMap::new();
        for device in raw.devices() {
            let change = |from: Option<&Health>, to: &Health| Transition {
                id: device.id.clone(),
                from: from.cloned(),
                to: Some(to.clone()),
            };
            let Some(previous) = self.published.get(&device.id) else {
                transitions.push(change(None, &device.health));
                continue;
            };
            match (&previous.health, &device.health) {
                (Health::Unhealthy { .. }, Health::Healthy) => {
                    let since = self.recovering.get(&device.id).copied().unwrap_or(now);
                    // A hold-down past the clock's range never ends: look again in a day.
                    let due = since.checked_add(self.hold_down);
                    if due.is_some_and(|due| due <= now) {
                        transitions.push(change(Some(&previous.health), &Health::Healthy));
                    } else {
                        let check = due.or_else(|| now.checked_add(FAR_CHECK));
                        next_check = match (next_check, check) {
                            (Some(n), Some(c)) => Some(n.min(c)),
                            (n, c) => n.or(c),
                        };
                        held.insert(device.id.as_str(), previous.health.clone());
                        still_recovering.insert(device.id.clone(), since);
                    }
                }
                (published, reported) if published != reported => {
                    transitions.push(change(Some(published), reported));
                }
                _ => {}
            }
        }
        for gone in self.published.devices() {
            if raw.get(&gone.id).is_none() {
                transitions.push(Transition {
                    id: gone.id.clone(),
                    from: Some(gone.health.clone()),
                    to: None,
                });
            }
        }
        let list = if held.is_empty() {
            raw.clone()
        } else {
            DeviceList::new(raw.devices().iter().map(|d| match held.get(d.id.as_str()) {
                Some(health) => d.clone().with_health(health.clone()),
                None => d.clone(),
            }))
        };
        self.recovering = still_recovering;
        self.published = list.clone();
        Gated {
            list,
            next_check,
            transitions,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;

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
    fn a_hold_down_past_the_clocks_range_holds_without_panicking() {
        let t0 = Instant::now();
        for hold in [
            Duration::MAX,
            Duration::from_secs(u64::MAX),
            Duration::from_secs(u64::MAX / 2),
        ] {
            let mut gate = HealthGate::new(hold);
            gate.apply(&list(Health::unhealthy("x")), t0);
            let back = gate.apply(&list(Health::Healthy), t0 + Duration::from_secs(1));
            assert!(!back.list.get("a").unwrap().health.is_healthy());
            let next = back.next_check.expect("a check stays scheduled");
            assert!(next > t0 + Duration::from_secs(1));
            let later = gate.apply(&list(Health::Healthy), next);
            assert!(!later.list.get("a").unwrap().health.is_healthy());
        }
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
