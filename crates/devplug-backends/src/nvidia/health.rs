//! Health of physical GPUs: one state per GPU (by UUID), fanned out by the backend to every
//! replica and every MIG device of it, and one state per GPU instance (by parent UUID and GI
//! id) for an XID that NVML attributes to a GPU instance: that marks only the MIG devices of
//! that instance (and a unit that is the whole GPU, or a partition without an instance id).
//! A fatal XID or a double-bit ECC error makes the GPU Unhealthy with the reason; it
//! comes back only on a positive signal: NVML's GPU recovery action reads NONE (for XIDs and
//! ECC), or the GPU answers again with its UUID (for a lost GPU). The kubelet then sees it
//! Healthy after the resource's hold-down (`health_hold_down`, devplug's `HealthGate`). When
//! NVML's events cannot be watched, every GPU reads "health unknown" (Unhealthy), never a
//! silent Healthy.

use super::seam::RecoveryAction;
use devplug::Health;
use std::collections::{BTreeMap, BTreeSet};

/// What NVIDIA's XID catalog calls the common XIDs (for reasons people can act on).
pub fn xid_description(xid: u64) -> &'static str {
    match xid {
        13 => "graphics engine exception",
        31 => "GPU memory page fault",
        32 => "invalid or corrupted push buffer stream",
        38 => "driver firmware error",
        43 => "GPU stopped processing",
        45 => "preemptive cleanup, due to previous errors",
        48 => "double-bit ECC error",
        61 => "internal micro-controller breakpoint/warning",
        62 => "internal micro-controller halt",
        63 => "ECC page retirement or row remapping recording event",
        64 => "ECC page retirement or row remapper recording failure",
        68 => "video processor exception",
        69 => "graphics engine class error",
        74 => "NVLink error",
        79 => "GPU has fallen off the bus",
        92 => "high single-bit ECC error rate",
        94 => "contained ECC error",
        95 => "uncontained ECC error",
        109 => "context switch timeout",
        119 => "GSP RPC timeout",
        120 => "GSP error",
        121 => "C2C link error",
        140 => "unrecovered ECC error",
        154 => "GPU recovery action changed",
        _ => "see NVIDIA's XID catalog",
    }
}

/// One GPU's state.
#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Faulted(String),
    Lost(String),
}

/// What a change did, for the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// The GPU became unhealthy for this reason.
    Unhealthy(String),
    /// An XID the policy ignores (the application failed, the GPU is fine).
    Ignored(String),
    /// The GPU is back.
    Recovered(String),
    /// Nothing changed.
    None,
}

/// The health of every GPU of one NVML session.
#[derive(Debug, Clone, Default)]
pub struct HealthBook {
    states: BTreeMap<String, State>,
    /// Faults of single GPU instances: (parent UUID, GI id).
    instances: BTreeMap<(String, u32), String>,
    ignored: BTreeSet<u64>,
    /// Set while NVML's events cannot be watched: every GPU reads Unhealthy with this.
    unknown: Option<String>,
}

impl HealthBook {
    /// A book where every GPU is healthy, with this XID policy.
    pub fn new(ignored: &[u64]) -> Self {
        HealthBook {
            states: BTreeMap::new(),
            instances: BTreeMap::new(),
            ignored: ignored.iter().copied().collect(),
            unknown: None,
        }
    }

    /// The health of the whole GPU (as a unit without a GI id reads it).
    #[cfg(test)]
    pub fn health(&self, uuid: &str) -> Health {
        self.unit_health(uuid, None)
    }

    /// The health to publish for a unit of GPU `uuid`: a MIG device of GPU instance `gi`
    /// reads the GPU's state, then its instance's; a unit without a GI id (the whole GPU, a
    /// partition) reads the GPU's state, then any of its instances' faults.
    pub fn unit_health(&self, uuid: &str, gi: Option<u32>) -> Health {
        if let Some(State::Faulted(r) | State::Lost(r)) = self.states.get(uuid) {
            return Health::unhealthy(r.clone());
        }
        let instance = match gi {
            Some(gi) => self.instances.get(&(uuid.to_owned(), gi)),
            None => self
                .instances
                .iter()
                .find(|((u, _), _)| u == uuid)
                .map(|(_, r)| r),
        };
        if let Some(r) = instance {
            return Health::unhealthy(r.clone());
        }
        match &self.unknown {
            Some(reason) => Health::unhealthy(reason.clone()),
            None => Health::Healthy,
        }
    }

    /// Marks (or clears, with `None`) "health unknown" for every GPU.
    pub fn set_unknown(&mut self, reason: Option<String>) {
        self.unknown = reason;
    }

    /// Why every GPU reads Unhealthy (NVML's events cannot be watched), if they do.
    pub fn unknown(&self) -> Option<&str> {
        self.unknown.as_deref()
    }

    /// An XID on a GPU, with its recovery action as read right after (`None`: the driver
    /// has no recovery action). A recovery action other than NONE makes any XID count; else
    /// the policy's ignore list decides.
    pub fn xid(&mut self, uuid: &str, xid: u64, action: Option<RecoveryAction>) -> Change {
        self.xid_in(uuid, None, xid, action)
    }

    /// An XID that NVML attributes to GPU instance `gi` of GPU `uuid` (`None`: to the whole
    /// GPU). The policy is [`HealthBook::xid`]'s; an attributed fault marks only that
    /// instance, and clears as the GPU's faults do (its recovery action reads NONE).
    pub fn xid_in(
        &mut self,
        uuid: &str,
        gi: Option<u32>,
        xid: u64,
        action: Option<RecoveryAction>,
    ) -> Change {
        let what = format!("xid {xid}: {}", xid_description(xid));
        let needs_action = action.is_some_and(|a| a != RecoveryAction::None);
        if self.ignored.contains(&xid) && !needs_action {
            return Change::Ignored(what);
        }
        let reason = match action {
            Some(a) if a != RecoveryAction::None => {
                format!("{what} (recovery action {})", a.name())
            }
            _ => what,
        };
        let Some(gi) = gi else {
            return self.fault(uuid, State::Faulted(reason));
        };
        // A GPU already down has all its instances down with it.
        if self.states.contains_key(uuid) {
            return Change::None;
        }
        let reason = format!("{reason} on GPU instance {gi}");
        let key = (uuid.to_owned(), gi);
        if self.instances.get(&key) == Some(&reason) {
            return Change::None;
        }
        self.instances.insert(key, reason.clone());
        Change::Unhealthy(reason)
    }

    /// A double-bit ECC error.
    pub fn ecc(&mut self, uuid: &str) -> Change {
        self.fault(uuid, State::Faulted("double-bit ECC error".into()))
    }

    /// The GPU no longer answers.
    pub fn lost(&mut self, uuid: &str) -> Change {
        self.fault(uuid, State::Lost("GPU is lost (fallen off the bus)".into()))
    }

    fn fault(&mut self, uuid: &str, state: State) -> Change {
        let reason = match &state {
            State::Faulted(r) | State::Lost(r) => r.clone(),
        };
        // A lost GPU stays lost until it answers, whatever else arrives.
        if matches!(self.states.get(uuid), Some(State::Lost(_))) {
            return Change::None;
        }
        if self.states.get(uuid) == Some(&state) {
            return Change::None;
        }
        self.states.insert(uuid.to_owned(), state);
        Change::Unhealthy(reason)
    }

    /// GPUs that wait for a recovery signal, themselves or one of their GPU instances:
    /// (uuid, true if lost).
    pub fn pending(&self) -> Vec<(String, bool)> {
        let mut out: Vec<(String, bool)> = self
            .states
            .iter()
            .map(|(u, s)| (u.clone(), matches!(s, State::Lost(_))))
            .collect();
        for (uuid, _) in self.instances.keys() {
            if !out.iter().any(|(u, _)| u == uuid) {
                out.push((uuid.clone(), false));
            }
        }
        out
    }

    /// A positive signal for a faulted GPU: its recovery action read `action` (`None`: the
    /// driver has none, so no signal), or, for a lost GPU, whether it answered.
    /// Faulted GPU instances of the GPU recover on the same signal as a faulted GPU.
    pub fn check(&mut self, uuid: &str, action: Option<RecoveryAction>, answers: bool) -> Change {
        let at_none = answers && action == Some(RecoveryAction::None);
        let recovered = match self.states.get(uuid) {
            Some(State::Faulted(_)) => at_none,
            Some(State::Lost(_)) => answers,
            None => false,
        };
        let mut change = Change::None;
        if recovered {
            if let Some(State::Faulted(r) | State::Lost(r)) = self.states.remove(uuid) {
                change = Change::Recovered(r);
            }
        }
        if at_none && !self.states.contains_key(uuid) {
            let faulted: Vec<(String, u32)> = self
                .instances
                .keys()
                .filter(|(u, _)| u == uuid)
                .cloned()
                .collect();
            for key in faulted {
                if let Some(r) = self.instances.remove(&key) {
                    if change == Change::None {
                        change = Change::Recovered(r);
                    }
                }
            }
        }
        change
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvidia::settings::DEFAULT_IGNORED_XIDS;

    #[test]
    fn fatal_xid_then_recovery_only_at_none() {
        let mut book = HealthBook::new(&DEFAULT_IGNORED_XIDS);
        let change = book.xid("GPU-a", 79, Some(RecoveryAction::GpuReset));
        assert_eq!(
            change,
            Change::Unhealthy(
                "xid 79: GPU has fallen off the bus (recovery action GPU_RESET)".into()
            )
        );
        assert!(!book.health("GPU-a").is_healthy());
        assert!(book.health("GPU-b").is_healthy());
        // Still GPU_RESET, or the driver has no recovery action: stays down.
        assert_eq!(
            book.check("GPU-a", Some(RecoveryAction::GpuReset), true),
            Change::None
        );
        assert_eq!(book.check("GPU-a", None, true), Change::None);
        assert!(matches!(
            book.check("GPU-a", Some(RecoveryAction::None), true),
            Change::Recovered(_)
        ));
        assert!(book.health("GPU-a").is_healthy());
    }

    #[test]
    fn application_xids_are_ignored_unless_the_driver_wants_action() {
        let mut book = HealthBook::new(&DEFAULT_IGNORED_XIDS);
        assert!(matches!(
            book.xid("GPU-a", 13, Some(RecoveryAction::None)),
            Change::Ignored(_)
        ));
        assert!(matches!(book.xid("GPU-a", 94, None), Change::Ignored(_)));
        // 109 is not ignored (NVIDIA ignores it; its XID catalog says reset).
        assert!(matches!(book.xid("GPU-a", 109, None), Change::Unhealthy(_)));
        // An ignored XID with a recovery action that is not NONE counts.
        assert!(matches!(
            book.xid("GPU-b", 13, Some(RecoveryAction::NodeReboot)),
            Change::Unhealthy(_)
        ));
    }

    #[test]
    fn an_attributed_xid_marks_only_its_gpu_instance_until_the_gpu_recovers() {
        let mut book = HealthBook::new(&DEFAULT_IGNORED_XIDS);
        assert_eq!(
            book.xid_in("GPU-a", Some(9), 79, Some(RecoveryAction::GpuReset)),
            Change::Unhealthy(
                "xid 79: GPU has fallen off the bus (recovery action GPU_RESET) on GPU instance 9"
                    .into()
            )
        );
        assert!(!book.unit_health("GPU-a", Some(9)).is_healthy());
        assert!(book.unit_health("GPU-a", Some(10)).is_healthy());
        assert!(book.unit_health("GPU-b", Some(9)).is_healthy());
        // The whole GPU (served whole, or a partition) reads any instance's fault.
        assert!(!book.unit_health("GPU-a", None).is_healthy());
        // An ignored XID on an instance is ignored as on a GPU.
        assert!(matches!(
            book.xid_in("GPU-a", Some(10), 13, Some(RecoveryAction::None)),
            Change::Ignored(_)
        ));
        assert_eq!(book.pending(), vec![("GPU-a".to_owned(), false)]);
        assert_eq!(
            book.check("GPU-a", Some(RecoveryAction::GpuReset), true),
            Change::None
        );
        assert!(matches!(
            book.check("GPU-a", Some(RecoveryAction::None), true),
            Change::Recovered(_)
        ));
        assert!(book.unit_health("GPU-a", Some(9)).is_healthy());
        assert!(book.pending().is_empty());
        // A GPU-wide fault covers every instance.
        assert!(matches!(book.xid("GPU-a", 48, None), Change::Unhealthy(_)));
        assert!(!book.unit_health("GPU-a", Some(10)).is_healthy());
    }

    #[test]
    fn lost_gpus_recover_when_they_answer_and_unknown_is_never_healthy() {
        let mut book = HealthBook::new(&[]);
        assert!(matches!(book.lost("GPU-a"), Change::Unhealthy(_)));
        // An XID on a lost GPU does not replace the state.
        assert_eq!(book.xid("GPU-a", 79, None), Change::None);
        assert_eq!(
            book.check("GPU-a", Some(RecoveryAction::None), false),
            Change::None
        );
        assert!(matches!(
            book.check("GPU-a", None, true),
            Change::Recovered(_)
        ));
        book.set_unknown(Some("health unknown: event set failed".into()));
        assert_eq!(
            book.health("GPU-a").to_string(),
            "Unhealthy (health unknown: event set failed)"
        );
        book.set_unknown(None);
        assert!(book.health("GPU-a").is_healthy());
    }
}
