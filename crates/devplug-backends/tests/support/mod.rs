//! Helpers shared by the backend integration tests: a kubelet simulator with backends served to
//! it, and waiting until the kubelet lists exactly some devices.
// Each test binary includes this module and uses part of it.
#![allow(dead_code)]

use devplug::{Backend, Host, ResourceSettings};
use kubelet_sim::Kubelet;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// How long a test waits for the kubelet to see something.
pub const WAIT: Duration = Duration::from_secs(10);

/// A simulated kubelet in `plugins` and a host serving each (resource, backend), with no health
/// hold-down (tests flip health back and forth).
pub async fn serve(plugins: &Path, backends: Vec<(&str, Arc<dyn Backend>)>) -> (Kubelet, Host) {
    let kubelet = Kubelet::start(plugins).await.unwrap();
    let host = Host::new(plugins).unwrap();
    for (name, backend) in backends {
        let settings = ResourceSettings {
            health_hold_down: Duration::ZERO,
            ..Default::default()
        };
        host.add_with(name, backend, settings).unwrap();
    }
    (kubelet, host)
}

/// Waits until the kubelet lists exactly these (id, healthy, NUMA nodes) for `resource`.
pub async fn devices(kubelet: &Kubelet, resource: &str, want: &[(&str, bool, &[i64])]) {
    let want: Vec<(String, bool, Vec<i64>)> = want
        .iter()
        .map(|(id, h, n)| (id.to_string(), *h, n.to_vec()))
        .collect();
    let got = kubelet
        .wait_for(WAIT, |n| {
            let now: Vec<(String, bool, Vec<i64>)> = n
                .resource(resource)?
                .devices()
                .iter()
                .map(|(id, d)| (id.clone(), d.healthy, d.numa_nodes.clone()))
                .collect();
            (now == want).then_some(())
        })
        .await;
    if got.is_err() {
        let now = kubelet.read(|n| n.resource(resource).map(|r| r.devices().clone()));
        panic!("{resource}: wanted {want:?}, the kubelet has {now:?}");
    }
}

/// Waits until the kubelet has `healthy` healthy devices out of `total` for `resource`; on
/// failure says what it has, device by device.
pub async fn counts(kubelet: &Kubelet, resource: &str, total: usize, healthy: usize) {
    let got = kubelet
        .wait_for(WAIT, |n| {
            (n.resource(resource).is_some() && n.capacity(resource) == (total, healthy))
                .then_some(())
        })
        .await;
    if got.is_err() {
        let now = kubelet.read(|n| n.capacity(resource));
        let devices: Vec<String> = kubelet.read(|n| {
            n.resource(resource)
                .map(|r| r.devices().values().map(|d| format!("{d:?}")).collect())
                .unwrap_or_default()
        });
        panic!("{resource}: wanted ({total}, {healthy}), the kubelet has {now:?}: {devices:?}");
    }
}

/// A device's DRA attributes and capacities as text (`"index" → "3"`, capacities as
/// `"capacity memory" → "85899345920"`), after checking them against the API server's rules.
pub fn dra(list: &devplug::DeviceList, id: &str) -> std::collections::BTreeMap<String, String> {
    use devplug::dra::AttributeValue;
    let device = list
        .get(id)
        .unwrap_or_else(|| panic!("no device {id} in {list:?}"));
    let attrs = device.dra_attributes();
    if let Err(err) = attrs.check() {
        panic!("{id}: {err}");
    }
    let mut out: std::collections::BTreeMap<String, String> = attrs
        .attributes
        .iter()
        .map(|(k, v)| {
            let text = match v {
                AttributeValue::Int(i) => i.to_string(),
                AttributeValue::Bool(b) => b.to_string(),
                AttributeValue::String(s) | AttributeValue::Version(s) => s.clone(),
            };
            (k.clone(), text)
        })
        .collect();
    for (k, v) in &attrs.capacity {
        out.insert(format!("capacity {k}"), v.to_string());
    }
    out
}

/// `pairs` as the map [`dra`] returns.
pub fn map(pairs: &[(&str, &str)]) -> std::collections::BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The container paths of the device nodes an allocation gives, in order.
pub fn container_paths(alloc: &kubelet_sim::Allocation) -> Vec<String> {
    alloc
        .response
        .devices
        .iter()
        .map(|d| d.container_path.clone())
        .collect()
}
