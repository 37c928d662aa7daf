//! Slices read from the API server made comparable with the ones we write: which of two copies
//! of a slice is newer (its resource version), and a spec read back in the form
//! [`slice_specs`](super::slice_specs) makes, so a slice that already says what we would write
//! is adopted as it is.

use super::quantity::{parse_quantity, quantity};
use k8s_openapi::api::resource::v1 as api;
use k8s_openapi::api::resource::v1::ResourceSlice;
use std::collections::BTreeMap;

/// True when `a` has a newer resource version than `b`. Kubernetes 1.35 made resource versions
/// of one resource comparable (KEP-5504): positive integers without leading zeros, compared as
/// numbers of any length. Anything else compares as not newer.
pub(super) fn is_newer(a: &ResourceSlice, b: &ResourceSlice) -> bool {
    fn valid(rv: &str) -> bool {
        !rv.is_empty() && rv.bytes().all(|c| c.is_ascii_digit()) && !rv.starts_with('0')
    }
    match (&a.metadata.resource_version, &b.metadata.resource_version) {
        (Some(a), Some(b)) if valid(a) && valid(b) => (a.len(), a.as_str()) > (b.len(), b.as_str()),
        _ => false,
    }
}

/// A spec read from the API server, in the form [`slice_specs`](super::slice_specs) makes:
/// capacities in canonical form, empty lists and maps left out.
pub fn normalized(spec: &api::ResourceSliceSpec) -> api::ResourceSliceSpec {
    let mut spec = spec.clone();
    if spec.devices.as_ref().is_some_and(Vec::is_empty) {
        spec.devices = None;
    }
    for device in spec.devices.iter_mut().flatten() {
        if device.attributes.as_ref().is_some_and(BTreeMap::is_empty) {
            device.attributes = None;
        }
        if device.capacity.as_ref().is_some_and(BTreeMap::is_empty) {
            device.capacity = None;
        }
        for capacity in device.capacity.iter_mut().flat_map(BTreeMap::values_mut) {
            if let Some(value) = parse_quantity(&capacity.value.0) {
                capacity.value = quantity(value);
            }
        }
        for consumption in device.consumes_counters.iter_mut().flatten() {
            canonical_counters(&mut consumption.counters);
        }
    }
    if spec.shared_counters.as_ref().is_some_and(Vec::is_empty) {
        spec.shared_counters = None;
    }
    for set in spec.shared_counters.iter_mut().flatten() {
        canonical_counters(&mut set.counters);
    }
    spec
}

/// Counter values in canonical form.
fn canonical_counters(counters: &mut BTreeMap<String, api::Counter>) {
    for counter in counters.values_mut() {
        if let Some(value) = parse_quantity(&counter.value.0) {
            counter.value = quantity(value);
        }
    }
}
