//! A claim's allocation checked against the backend's newest device list and grouped by
//! request: what to ask the backend for, and what to answer the kubelet.

use super::error::PrepareError;
use crate::checkpoint::PreparedDevice;
use crate::claims::{AllocatedDevice, ClaimRef};
use crate::names::device_name;
use devplug::{DeviceList, Health};
use std::collections::{BTreeMap, HashMap};

/// One request of a claim: the ids of the devices it gets whole, and its shares of shared
/// devices with what each consumed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RequestDevices {
    /// The request's name.
    pub name: String,
    /// Backend ids of the devices given whole, without repeats.
    pub whole: Vec<String>,
    /// Backend ids of shared devices, with what the share consumed of each capacity.
    pub shares: Vec<(String, BTreeMap<String, u64>)>,
}

/// What preparing a claim takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Plan {
    /// The requests, in allocation order.
    pub requests: Vec<RequestDevices>,
    /// The answer to the kubelet, one entry per device (CDI ids filled in later).
    pub devices: Vec<PreparedDevice>,
}

/// Plans a claim's allocation for `driver`'s devices in `pool`: every device must be ours,
/// published now, and healthy unless the claim tolerates the unhealthy taint.
pub(super) fn plan(
    driver: &str,
    pool: &str,
    claim: &ClaimRef,
    allocated: &[AllocatedDevice],
    list: &DeviceList,
) -> Result<Plan, PrepareError> {
    let by_name: HashMap<String, &devplug::Device> = list
        .devices()
        .iter()
        .map(|d| (device_name(&d.id), d))
        .collect();
    let mut requests: Vec<RequestDevices> = Vec::new();
    let mut devices: Vec<PreparedDevice> = Vec::new();
    for result in allocated {
        if result.pool != pool {
            return Err(PrepareError::OtherPool {
                device: result.device.clone(),
                pool: result.pool.clone(),
                ours: pool.to_owned(),
            });
        }
        let device = by_name
            .get(&result.device)
            .ok_or_else(|| PrepareError::UnknownDevice {
                device: result.device.clone(),
                driver: driver.to_owned(),
            })?;
        if let Health::Unhealthy { reason } = &device.health {
            if !result.tolerates_unhealthy {
                return Err(PrepareError::Unhealthy {
                    device: result.device.clone(),
                    reason: reason.clone(),
                });
            }
            tracing::warn!(%driver, %claim, device = %result.device,
                %reason, "preparing an unhealthy device: the claim tolerates its taint");
        }
        let index = match requests.iter().position(|r| r.name == result.request) {
            Some(index) => index,
            None => {
                requests.push(RequestDevices {
                    name: result.request.clone(),
                    whole: Vec::new(),
                    shares: Vec::new(),
                });
                requests.len().saturating_sub(1)
            }
        };
        if let Some(request) = requests.get_mut(index) {
            if result.hold.share_id().is_some() {
                request
                    .shares
                    .push((device.id.clone(), result.consumed.clone()));
            } else if !request.whole.contains(&device.id) {
                request.whole.push(device.id.clone());
            }
        }
        match devices.iter_mut().find(|d| d.device == result.device) {
            Some(known) => known.request_names.push(result.request.clone()),
            None => devices.push(PreparedDevice {
                request_names: vec![result.request.clone()],
                pool: result.pool.clone(),
                device: result.device.clone(),
                id: device.id.clone(),
                cdi_device_ids: Vec::new(),
                hold: result.hold.clone(),
            }),
        }
    }
    Ok(Plan { requests, devices })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hold::Hold;
    use devplug::Device;

    fn allocated(request: &str, device: &str, hold: Hold) -> AllocatedDevice {
        AllocatedDevice {
            request: request.into(),
            pool: "node-a".into(),
            device: device.into(),
            hold,
            consumed: BTreeMap::new(),
            tolerates_unhealthy: false,
            pod_claim_name: None,
        }
    }

    #[test]
    fn requests_group_whole_devices_and_shares_in_allocation_order() {
        let list = DeviceList::new([Device::new("npu-0"), Device::new("npu-1")]);
        let claim = ClaimRef {
            namespace: "ns".into(),
            name: "c".into(),
            uid: "u".into(),
        };
        let share = Hold::Share {
            share_id: "s1".into(),
        };
        let plan = plan(
            "npu.example.com",
            "node-a",
            &claim,
            &[
                allocated("b", "npu-1", Hold::Exclusive),
                allocated("a", "npu-0", share.clone()),
                allocated("b", "npu-1", Hold::Exclusive),
            ],
            &list,
        )
        .unwrap();
        let names: Vec<&str> = plan.requests.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["b", "a"]);
        assert_eq!(plan.requests[0].whole, ["npu-1"], "no repeats");
        assert_eq!(plan.requests[1].shares.len(), 1);
        assert_eq!(plan.devices.len(), 2);
        assert_eq!(plan.devices[1].hold, share);
        let err = super::plan(
            "npu.example.com",
            "node-b",
            &claim,
            &[allocated("a", "npu-0", Hold::Exclusive)],
            &list,
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "device npu-0 is in pool \"node-a\", not this node's pool \"node-b\""
        );
    }
}
