//! One backend device as the API's `Device`: the attributes and capacities that pass the API
//! server's rules (the others are reported as [`Skipped`]), then [`NUMA_ATTRIBUTE`] from its
//! first NUMA node when the backend gave none and there is room, and the standard
//! [`NUMA_NODE_ATTRIBUTE`] (Kubernetes 1.37's `resource.kubernetes.io/numaNode`, which CEL and
//! `matchAttribute` compare across drivers) likewise.

use super::quantity::quantity;
use super::spec::Skipped;
use super::validate::{check_attribute, check_capacity};
use devplug::dra::{AttributeValue, CapacityRequestPolicy, MAX_PER_DEVICE};
use devplug::Device;
use k8s_openapi::api::resource::v1 as api;
use std::collections::BTreeMap;

/// The attribute added from a device's first NUMA node when the backend gives none.
pub const NUMA_ATTRIBUTE: &str = "numa";

/// The standard attribute of a device's NUMA node (KEP-6072, GA in Kubernetes 1.37 with no
/// feature gate): the same name from every driver, so a claim can align a GPU and a NIC of two
/// drivers with `matchAttribute: resource.kubernetes.io/numaNode`.
pub const NUMA_NODE_ATTRIBUTE: &str = "resource.kubernetes.io/numaNode";

/// One device of `driver` as the API has it: attributes and capacities that pass the API
/// server's rules, then `numa` when the backend gave none and there is room. A name qualified
/// by the driver's own domain (`npu.example.com/model` of driver `npu.example.com`) is published
/// unqualified (`model`): the API takes an unqualified name as the driver's, CEL reads both as
/// `device.attributes["npu.example.com"].model`, and Kubernetes 1.38's validation refuses the
/// qualified form. Where the device has both, the unqualified one stays.
pub(super) fn api_device(
    driver: &str,
    device: &Device,
    name: String,
    skipped: &mut Vec<Skipped>,
) -> api::Device {
    use std::collections::btree_map::Entry;
    let given = device.dra_attributes();
    let mut attributes = BTreeMap::new();
    let mut capacity = BTreeMap::new();
    let mut room = MAX_PER_DEVICE;
    let own = format!("{driver}/");
    // The name to publish, and whether it was given so (not qualified by the driver's domain).
    let published = |key: &str| match key.strip_prefix(own.as_str()) {
        Some(bare) => (bare.to_owned(), false),
        None => (key.to_owned(), true),
    };
    let mut skip = |attribute: &str, reason: String| {
        skipped.push(Skipped {
            device: device.id.clone(),
            attribute: Some(attribute.to_owned()),
            reason,
        });
    };
    for (key, value) in &given.attributes {
        if let Err(reason) = check_attribute(key, value) {
            skip(key, reason);
            continue;
        }
        let (name, as_given) = published(key);
        match attributes.entry(name) {
            Entry::Occupied(mut kept) if as_given => {
                kept.insert(api_attribute(value));
            }
            Entry::Occupied(_) => {}
            Entry::Vacant(_) if room == 0 => skip(key, too_many()),
            Entry::Vacant(new) => {
                room = room.saturating_sub(1);
                new.insert(api_attribute(value));
            }
        }
    }
    for (key, &value) in &given.capacity {
        if let Err(reason) = check_capacity(key, value) {
            skip(key, reason);
            continue;
        }
        let one = api::DeviceCapacity {
            value: quantity(value),
            request_policy: given.shared.get(key).map(request_policy),
        };
        let (name, as_given) = published(key);
        match capacity.entry(name) {
            Entry::Occupied(mut kept) if as_given => {
                kept.insert(one);
            }
            Entry::Occupied(_) => {}
            Entry::Vacant(_) if room == 0 => skip(key, too_many()),
            Entry::Vacant(new) => {
                room = room.saturating_sub(1);
                new.insert(one);
            }
        }
    }
    let numa = device.numa_nodes.first().copied();
    for name in [NUMA_ATTRIBUTE, NUMA_NODE_ATTRIBUTE] {
        if let (Some(numa), false, true) = (numa, attributes.contains_key(name), room > 0) {
            room = room.saturating_sub(1);
            attributes.insert(
                name.to_owned(),
                api::DeviceAttribute {
                    int: Some(numa),
                    ..Default::default()
                },
            );
        }
    }
    api::Device {
        name,
        attributes: (!attributes.is_empty()).then_some(attributes),
        capacity: (!capacity.is_empty()).then_some(capacity),
        allow_multiple_allocations: given.is_shared().then_some(true),
        consumes_counters: (!given.consumes.is_empty()).then(|| {
            given
                .consumes
                .iter()
                .map(|c| api::DeviceCounterConsumption {
                    counter_set: c.set.clone(),
                    counters: counters(&c.counters),
                    ..Default::default()
                })
                .collect()
        }),
        ..Default::default()
    }
}

/// The attributes of `device` exactly as its ResourceSlice publishes them (device metadata
/// hands a container the same).
pub(crate) fn published_attributes(
    driver: &str,
    device: &Device,
) -> BTreeMap<String, api::DeviceAttribute> {
    let mut skipped = Vec::new();
    api_device(driver, device, String::new(), &mut skipped)
        .attributes
        .unwrap_or_default()
}

/// Counters as the API has them.
pub(super) fn counters(values: &BTreeMap<String, u64>) -> BTreeMap<String, api::Counter> {
    values
        .iter()
        .map(|(name, &value)| {
            (
                name.clone(),
                api::Counter {
                    value: quantity(value),
                },
            )
        })
        .collect()
}

/// A share policy as the API's request policy: a range from `min` in `step`s, and the default.
fn request_policy(policy: &CapacityRequestPolicy) -> api::CapacityRequestPolicy {
    api::CapacityRequestPolicy {
        default: Some(quantity(policy.default)),
        valid_range: Some(api::CapacityRequestPolicyRange {
            min: quantity(policy.min),
            step: Some(quantity(policy.step)),
            max: None,
        }),
        valid_values: None,
    }
}

fn too_many() -> String {
    format!("more than {MAX_PER_DEVICE} attributes and capacities")
}

fn api_attribute(value: &AttributeValue) -> api::DeviceAttribute {
    let mut out = api::DeviceAttribute::default();
    match value {
        AttributeValue::Int(v) => out.int = Some(*v),
        AttributeValue::Bool(v) => out.bool = Some(*v),
        AttributeValue::String(v) => out.string = Some(v.clone()),
        AttributeValue::Version(v) => out.version = Some(v.clone()),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::slices::slice_specs;
    use devplug::DeviceList;

    #[test]
    fn too_many_attributes_keep_the_first_32() {
        let mut device = Device::new("d").with_numa_nodes([0]);
        for i in 0..40 {
            device = device.with_attribute(format!("a{i:02}"), AttributeValue::Bool(true));
        }
        let out = slice_specs("d.example.com", "n", 1, &DeviceList::new([device]));
        let attrs = out.specs[0].devices.as_ref().unwrap()[0]
            .attributes
            .as_ref()
            .unwrap();
        assert_eq!(attrs.len(), MAX_PER_DEVICE);
        assert!(!attrs.contains_key("numa"), "no room left");
        assert_eq!(out.skipped.len(), 8);
    }

    #[test]
    fn a_shared_device_allows_multiple_allocations_with_its_policies() {
        let device = Device::new("gpu")
            .with_shared_capacity("cores", 100, CapacityRequestPolicy::steps_of(1))
            .with_shared_capacity(
                "memory",
                16 << 30,
                CapacityRequestPolicy::steps_of(256 << 20),
            );
        let out = slice_specs("d.example.com", "n", 1, &DeviceList::new([device]));
        let published = &out.specs[0].devices.as_ref().unwrap()[0];
        assert_eq!(published.allow_multiple_allocations, Some(true));
        let memory = &published.capacity.as_ref().unwrap()["memory"];
        let policy = memory.request_policy.as_ref().unwrap();
        assert_eq!(policy.default.as_ref().unwrap().0, "268435456");
        let range = policy.valid_range.as_ref().unwrap();
        assert_eq!(
            (
                range.min.0.as_str(),
                range.step.as_ref().unwrap().0.as_str()
            ),
            ("268435456", "268435456")
        );
        let whole = slice_specs("d.example.com", "n", 1, &DeviceList::new([npu()]));
        let published = &whole.specs[0].devices.as_ref().unwrap()[0];
        assert_eq!(published.allow_multiple_allocations, None);
        assert!(published.capacity.as_ref().unwrap()["memory"]
            .request_policy
            .is_none());
    }

    fn npu() -> Device {
        Device::new("npu").with_capacity("memory", 1 << 30)
    }
}
