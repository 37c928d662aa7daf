//! Two live claims holding one device that goes to one claim at a time: refused, unless the
//! first holder is gone from the API server (the kubelet has yet to unprepare it).

use super::error::PrepareError;
use crate::checkpoint::{Checkpoint, PreparedClaim, PreparedDevice};
use crate::claims::{AllocatedDevice, ClaimRef};
use std::collections::{BTreeMap, HashSet};

/// The prepared claims that exclusively hold a device one of `wanted` wants exclusively: the
/// claims to ask the API server about before refusing.
pub(super) fn holders_of(
    claims: &BTreeMap<String, PreparedClaim>,
    wanted: &[&AllocatedDevice],
) -> Vec<ClaimRef> {
    claims
        .iter()
        .filter(|(_, prepared)| {
            prepared.devices.iter().any(|held| {
                held.hold.is_exclusive()
                    && wanted
                        .iter()
                        .any(|w| w.hold.is_exclusive() && holds(held, w))
            })
        })
        .map(|(uid, prepared)| ClaimRef {
            namespace: prepared.namespace.clone(),
            name: prepared.name.clone(),
            uid: uid.clone(),
        })
        .collect()
}

/// Refuses an allocation that gives a claim a device another prepared claim has, unless one of
/// the two has it as a share (consumable capacity) or with admin access: a device that is not
/// shareable goes to one claim at a time, and two live claims holding it means the scheduler
/// worked from a stale view (another driver publishing our devices, an allocation made by
/// hand). The first claim keeps it; the second gets this error. A holder the API server no
/// longer has (`released`) is not in the way: the scheduler gave its device away when it went,
/// and the kubelet has yet to unprepare it; that is logged.
pub(super) fn refuse_taken_devices(
    driver: &str,
    claim: &ClaimRef,
    state: &Checkpoint,
    allocated: &[AllocatedDevice],
    released: &HashSet<String>,
) -> Result<(), PrepareError> {
    for wanted in allocated.iter().filter(|d| d.hold.is_exclusive()) {
        let holders = state.claims.iter().filter(|(_, prepared)| {
            prepared
                .devices
                .iter()
                .any(|held| held.hold.is_exclusive() && holds(held, wanted))
        });
        for (uid, holder) in holders {
            let name = format!("{}/{}", holder.namespace, holder.name);
            if released.contains(uid) {
                tracing::warn!(%driver, %claim, device = %wanted.device, holder = %name, "the device is still prepared for a claim the API server no longer has (the kubelet unprepares it within a minute); preparing the new claim");
                continue;
            }
            return Err(PrepareError::Taken {
                device: wanted.device.clone(),
                holder: name,
            });
        }
    }
    Ok(())
}

/// The ids of the devices a claim was given whole by the backend, which it releases when the
/// claim is done: not shares, not admin access (which only looks at a device another claim
/// has).
pub(super) fn whole_ids(devices: &[PreparedDevice]) -> Vec<String> {
    let mut ids: Vec<String> = Vec::new();
    for device in devices {
        if device.hold.is_exclusive() && !ids.contains(&device.id) {
            ids.push(device.id.clone());
        }
    }
    ids
}

/// Whether `held` is the device `wanted` names.
fn holds(held: &PreparedDevice, wanted: &AllocatedDevice) -> bool {
    held.pool == wanted.pool && held.device == wanted.device
}
