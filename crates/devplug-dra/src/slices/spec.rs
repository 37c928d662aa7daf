//! What the slices of a device list are: one pool named after the node, each device named by
//! [`names::device_name`], an unhealthy one tainted `NoSchedule` (or left out where the API
//! server keeps no taints), [`MAX_DEVICES_PER_SLICE`] a slice ([`MAX_TAINTED_PER_SLICE`] in a
//! slice with a taint). Pure functions: the publisher uses them, tests and tools can too.

use super::api_device::api_device;
use crate::names;
use devplug::{Device, DeviceList, Health};
use k8s_openapi::api::resource::v1 as api;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use std::collections::BTreeMap;

/// The most devices one ResourceSlice may hold in `resource.k8s.io/v1` (`ResourceSliceSpec.
/// devices`: "Must not have more than 128 entries").
pub const MAX_DEVICES_PER_SLICE: usize = 128;

/// The most devices a slice may hold when one of them has a taint (the same field: "If any
/// device uses taints or consumes counters the limit is 64").
pub const MAX_TAINTED_PER_SLICE: usize = 64;

/// The taint key of an unhealthy device: `<driver>/unhealthy`; its value says why.
pub fn unhealthy_taint_key(driver: &str) -> String {
    format!("{driver}/unhealthy")
}

/// How unhealthy devices are published.
#[derive(Debug, Clone, Copy)]
pub(super) enum Unhealthy<'a> {
    /// Kept, with a `NoSchedule` taint `key` whose value is the reason, added at the time in
    /// `since` (none: the API server sets it); a device in `no_execute` has a `NoExecute` taint
    /// instead, added at the time given there.
    Taint {
        key: &'a str,
        since: &'a BTreeMap<String, Time>,
        no_execute: &'a BTreeMap<String, Time>,
    },
    /// Left out of the pool (an API server that keeps no taints: the `DRADeviceTaints`
    /// feature off, as before Kubernetes 1.36).
    LeaveOut,
}

/// A reason as a label value (a taint's value): letters, digits, `-`, `_`, `.`, at most 63,
/// alphanumeric at both ends; `None` when nothing is left.
fn label_value(reason: &str) -> Option<String> {
    let mut out = String::new();
    for c in reason.chars() {
        let c = if c.is_ascii_alphanumeric() || "-_.".contains(c) {
            c
        } else {
            '-'
        };
        if !(c == '-' && out.ends_with('-')) {
            out.push(c);
        }
    }
    let trimmed: String = out
        .trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .chars()
        .take(63)
        .collect();
    let trimmed = trimmed.trim_end_matches(|c: char| !c.is_ascii_alphanumeric());
    (!trimmed.is_empty()).then(|| trimmed.to_owned())
}

/// The taint an unhealthy device carries: `NoSchedule` since it was first seen unhealthy, or
/// `NoExecute` once it is in `no_execute` (since then).
fn taint(
    device: &Device,
    key: &str,
    since: &BTreeMap<String, Time>,
    no_execute: &BTreeMap<String, Time>,
) -> Option<api::DeviceTaint> {
    let Health::Unhealthy { reason } = &device.health else {
        return None;
    };
    let (effect, time_added) = match no_execute.get(&device.id) {
        Some(at) => ("NoExecute", Some(at.clone())),
        None => ("NoSchedule", since.get(&device.id).cloned()),
    };
    Some(api::DeviceTaint {
        key: key.to_owned(),
        value: label_value(reason),
        effect: effect.to_owned(),
        time_added,
    })
}

/// A device or attribute left out of the pool, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    /// The backend id of the device.
    pub device: String,
    /// The attribute or capacity left out; `None` when the whole device was.
    pub attribute: Option<String>,
    /// Why.
    pub reason: String,
}

/// The slices one device list becomes (see [`slice_specs`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SliceSpecs {
    /// The specs, in order; at least one (an empty pool is one slice with no devices).
    pub specs: Vec<api::ResourceSliceSpec>,
    /// What was left out, for one WARN each.
    pub skipped: Vec<Skipped>,
}

/// The pool content of a device list: the devices of each slice, and what was left out.
#[derive(Debug, Clone, PartialEq, Default)]
pub(super) struct PoolContent {
    /// The pool's counter sets (partitionable devices), in a slice of their own ahead of the
    /// devices' slices; empty for most pools.
    pub(super) counters: Vec<api::CounterSet>,
    pub(super) slices: Vec<Vec<api::Device>>,
    pub(super) skipped: Vec<Skipped>,
}

impl PoolContent {
    /// How many slices the pool has.
    pub(super) fn slice_count(&self) -> usize {
        self.slices
            .len()
            .saturating_add(usize::from(!self.counters.is_empty()))
    }

    /// The specs of the pool at `generation`: the counter sets' slice first (when there are
    /// any), then the devices'.
    pub(super) fn specs(
        &self,
        driver: &str,
        node: &str,
        generation: i64,
    ) -> Vec<api::ResourceSliceSpec> {
        let count = self.slice_count();
        let counters = (!self.counters.is_empty()).then(|| api::ResourceSliceSpec {
            shared_counters: Some(self.counters.clone()),
            ..spec(driver, node, generation, count, &[])
        });
        counters
            .into_iter()
            .chain(
                self.slices
                    .iter()
                    .map(|devices| spec(driver, node, generation, count, devices)),
            )
            .collect()
    }
}

/// The ResourceSlice specs for `list`, published by `driver` on `node` at pool `generation`:
/// every device in the backend's order, an unhealthy one with a `NoSchedule` taint
/// [`unhealthy_taint_key`] (its time left to the API server), [`MAX_DEVICES_PER_SLICE`] a
/// slice ([`MAX_TAINTED_PER_SLICE`] in a slice with a taint). A pure function: the publisher
/// uses it, tests and tools can too.
pub fn slice_specs(driver: &str, node: &str, generation: i64, list: &DeviceList) -> SliceSpecs {
    let key = unhealthy_taint_key(driver);
    let since = BTreeMap::new();
    let content = pool_content(
        driver,
        list,
        Unhealthy::Taint {
            key: &key,
            since: &since,
            no_execute: &since,
        },
    );
    SliceSpecs {
        specs: content.specs(driver, node, generation),
        skipped: content.skipped,
    }
}

pub(super) fn spec(
    driver: &str,
    node: &str,
    generation: i64,
    count: usize,
    devices: &[api::Device],
) -> api::ResourceSliceSpec {
    api::ResourceSliceSpec {
        driver: driver.to_owned(),
        node_name: Some(node.to_owned()),
        pool: api::ResourcePool {
            name: node.to_owned(),
            generation,
            resource_slice_count: i64::try_from(count).unwrap_or(i64::MAX),
        },
        // The API server leaves an empty list out; so do we, or every comparison would differ.
        devices: (!devices.is_empty()).then(|| devices.to_vec()),
        ..Default::default()
    }
}

pub(super) fn pool_content(
    driver: &str,
    list: &DeviceList,
    unhealthy: Unhealthy<'_>,
) -> PoolContent {
    let mut skipped = Vec::new();
    let mut names_taken: BTreeMap<String, &str> = BTreeMap::new();
    let mut devices = Vec::with_capacity(list.len());
    for device in list.devices() {
        let taint = match unhealthy {
            _ if device.health.is_healthy() => None,
            Unhealthy::LeaveOut => continue,
            Unhealthy::Taint {
                key,
                since,
                no_execute,
            } => taint(device, key, since, no_execute),
        };
        let name = names::device_name(&device.id);
        if let Some(first) = names_taken.get(&name) {
            skipped.push(Skipped {
                device: device.id.clone(),
                attribute: None,
                reason: format!("its slice name {name:?} is also the name of device {first:?}"),
            });
            continue;
        }
        names_taken.insert(name.clone(), &device.id);
        let mut api = api_device(driver, device, name, &mut skipped);
        api.taints = taint.map(|t| vec![t]);
        devices.push(api);
    }
    let mut slices: Vec<Vec<api::Device>> = Vec::new();
    for device in devices {
        let full = slices.last().is_none_or(|slice| {
            // The API server's limit is lower for a slice with a taint or a device that
            // consumes counters.
            let special = |d: &api::Device| d.taints.is_some() || d.consumes_counters.is_some();
            let tainted = special(&device) || slice.iter().any(special);
            let limit = if tainted {
                MAX_TAINTED_PER_SLICE
            } else {
                MAX_DEVICES_PER_SLICE
            };
            slice.len() >= limit
        });
        if full {
            slices.push(Vec::new());
        }
        if let Some(slice) = slices.last_mut() {
            slice.push(device);
        }
    }
    if slices.is_empty() {
        slices.push(Vec::new());
    }
    let counters = list
        .counter_sets()
        .iter()
        .map(|set| api::CounterSet {
            name: set.name.clone(),
            counters: super::api_device::counters(&set.counters),
        })
        .collect();
    PoolContent {
        counters,
        slices,
        skipped,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use devplug::dra::AttributeValue;
    use devplug::{Device, Health};

    fn attr<'a>(
        spec: &'a api::ResourceSliceSpec,
        device: usize,
        name: &str,
    ) -> &'a api::DeviceAttribute {
        &spec.devices.as_ref().unwrap()[device]
            .attributes
            .as_ref()
            .unwrap()[name]
    }

    #[test]
    fn names_in_the_drivers_own_domain_are_published_unqualified() {
        let device = Device::new("npu-0")
            .with_attribute("npu.example.com/model", AttributeValue::String("x1".into()))
            .with_attribute("npu.example.com/cores", AttributeValue::Int(8))
            .with_attribute("cores", AttributeValue::Int(4))
            .with_attribute(
                "other.example.com/model",
                AttributeValue::String("y".into()),
            )
            .with_attribute("a.example.com/b/c", AttributeValue::Int(1));
        let list = DeviceList::new(vec![device]);
        let made = slice_specs("npu.example.com", "node-a", 1, &list);
        // A name with two '/' is left out, and said.
        assert!(
            made.skipped
                .iter()
                .any(|s| s.attribute.as_deref() == Some("a.example.com/b/c")),
            "{:?}",
            made.skipped
        );
        let specs = made.specs;
        let devices = specs[0].devices.as_ref().unwrap();
        let names: Vec<&str> = devices[0]
            .attributes
            .as_ref()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        // No name in the driver's own domain; the unqualified `cores` kept over the qualified.
        assert_eq!(names, ["cores", "model", "other.example.com/model"]);
        let cores = &devices[0].attributes.as_ref().unwrap()["cores"];
        assert_eq!(cores.int, Some(4));
        // Every qualified name has one '/' at most (the API server refuses more).
        for spec in &specs {
            for device in spec.devices.iter().flatten() {
                for name in device.attributes.iter().flatten().map(|(k, _)| k) {
                    assert!(name.matches('/').count() <= 1, "{name}");
                }
            }
        }
    }

    #[test]
    fn specs_split_name_and_describe_devices() {
        let mut devices: Vec<Device> = (0..300)
            .map(|i| Device::new(format!("npu-{i}")).with_numa_nodes([i64::from(i % 2)]))
            .collect();
        devices[0] = Device::new("GPU-a")
            .with_numa_nodes([1])
            .with_attribute("model", AttributeValue::String("x1".into()))
            .with_attribute("bad-name", AttributeValue::Int(1))
            .with_attribute(
                "driverVersion",
                AttributeValue::Version("1.2.3-rc.1".into()),
            )
            .with_attribute("firmware", AttributeValue::Version("1.02.3".into()))
            .with_attribute("long", AttributeValue::String("x".repeat(65)))
            .with_capacity("memory", 16 << 30)
            .with_capacity("huge", u64::MAX);
        devices[1] = Device::new("npu-1")
            .with_numa_nodes([0])
            .with_attribute("numa", AttributeValue::Int(7));
        devices[2] = devices[2].clone().with_health(Health::unhealthy("gone"));
        let list = DeviceList::new(devices);
        let out = slice_specs("npu.example.com", "node-a", 4, &list);

        // 300 devices, npu-2 tainted: 64 in its slice, then 128 + 108, each slice knowing the
        // count.
        let sizes: Vec<usize> = out
            .specs
            .iter()
            .map(|s| s.devices.as_ref().unwrap().len())
            .collect();
        assert_eq!(sizes, [64, 128, 108]);
        for spec in &out.specs {
            assert_eq!(spec.driver, "npu.example.com");
            assert_eq!(spec.node_name.as_deref(), Some("node-a"));
            assert_eq!(spec.pool.name, "node-a");
            assert_eq!(spec.pool.generation, 4);
            assert_eq!(spec.pool.resource_slice_count, 3);
        }
        let first = &out.specs[0];
        let names: Vec<&str> = first
            .devices
            .as_ref()
            .unwrap()
            .iter()
            .map(|d| d.name.as_str())
            .collect();
        assert_eq!(names[..3], ["gpu-a-a414910b", "npu-1", "npu-2"]);
        let tainted = &first.devices.as_ref().unwrap()[2];
        let taints = tainted.taints.as_ref().unwrap();
        assert_eq!(taints.len(), 1);
        assert_eq!(taints[0].key, "npu.example.com/unhealthy");
        assert_eq!(taints[0].value.as_deref(), Some("gone"));
        assert_eq!(taints[0].effect, "NoSchedule");
        assert!(first.devices.as_ref().unwrap()[3].taints.is_none());
        assert_eq!(attr(first, 0, "model").string.as_deref(), Some("x1"));
        assert_eq!(
            attr(first, 0, "driverVersion").version.as_deref(),
            Some("1.2.3-rc.1")
        );
        assert_eq!(
            attr(first, 0, "numa").int,
            Some(1),
            "numa from the first NUMA node"
        );
        assert_eq!(
            attr(first, 1, "numa").int,
            Some(7),
            "the backend's numa wins"
        );
        assert_eq!(attr(first, 3, "numa").int, Some(1));
        // The standard attribute from the device's NUMA node, beside devplug's own.
        assert_eq!(
            attr(first, 0, "resource.kubernetes.io/numaNode").int,
            Some(1)
        );
        assert_eq!(
            attr(first, 1, "resource.kubernetes.io/numaNode").int,
            Some(0)
        );
        let d0 = &first.devices.as_ref().unwrap()[0];
        assert_eq!(
            d0.capacity.as_ref().unwrap()["memory"].value.0,
            "17179869184"
        );
        assert!(!d0.capacity.as_ref().unwrap().contains_key("huge"));
        let attrs = d0.attributes.as_ref().unwrap();
        for bad in ["bad-name", "firmware", "long"] {
            assert!(!attrs.contains_key(bad), "{bad}");
        }
        let mut skipped: Vec<&str> = out
            .skipped
            .iter()
            .map(|s| s.attribute.as_deref().unwrap())
            .collect();
        skipped.sort_unstable();
        assert_eq!(skipped, ["bad-name", "firmware", "huge", "long"]);
        assert!(out.skipped.iter().all(|s| s.device == "GPU-a"));
    }

    #[test]
    fn an_empty_pool_is_one_empty_slice_and_clashing_names_keep_the_first() {
        let out = slice_specs("d.example.com", "n", 1, &DeviceList::default());
        assert_eq!(out.specs.len(), 1);
        assert!(out.specs[0].devices.is_none());
        assert_eq!(out.specs[0].pool.resource_slice_count, 1);

        // "gpu-a-a414910b" is already a label, and the name of "GPU-a" too.
        let list = DeviceList::new([Device::new("gpu-a-a414910b"), Device::new("GPU-a")]);
        let out = slice_specs("d.example.com", "n", 1, &list);
        assert_eq!(out.specs[0].devices.as_ref().unwrap().len(), 1);
        assert_eq!(out.skipped.len(), 1);
        assert_eq!(out.skipped[0].device, "GPU-a");
        assert!(out.skipped[0].attribute.is_none());
    }

    #[test]
    fn unhealthy_devices_are_left_out_where_taints_are_not_kept_and_reasons_become_values() {
        let list = DeviceList::new([
            Device::new("a"),
            Device::new("b").with_health(Health::unhealthy("XID 79: fallen off the bus")),
        ]);
        let content = pool_content("npu.example.com", &list, Unhealthy::LeaveOut);
        assert_eq!(content.slices[0].len(), 1);
        assert_eq!(
            label_value("XID 79: fallen off the bus").as_deref(),
            Some("XID-79-fallen-off-the-bus")
        );
        assert_eq!(label_value("  ::  "), None);
        let long = label_value(&"ab ".repeat(40)).unwrap();
        assert!(long.len() <= 63 && long.ends_with('b'), "{long}");
    }
}
