//! The backend shared by the accelerators whose devices are device nodes plus environment
//! variables: `vfio` (and `qat`, which is `vfio` with Intel's selection and names), `ascend`
//! and `fpga`. Each of those modules only scans sysfs and /dev into a list of `Found`
//! devices; the rest is here, once: following changes with inotify and keeping a vanished
//! device Unhealthy with the reason (`sysfs_watch`), the CDI spec, allocation, and NUMA-first
//! preferred allocation ([`crate::replicas`]).
//!
//! Allocation gives each device's nodes, the nodes every device needs (`/dev/vfio/vfio`,
//! `/dev/davinci_manager`) once, and the environment in the backend's `EnvNaming`: one list
//! (`PCI_RESOURCE_INTEL_COM_QAT=0000:3d:01.0,0000:3d:01.1`, `ASCEND_VISIBLE_DEVICES=0,1`) or
//! one numbered variable per value (`QAT0`, `QAT1`). With CDI on, the devices' CDI names are
//! sent as well (kind = the resource name).

use crate::replicas::{prefer, ReplicaPolicy, ShareInfo};
use crate::settings::SettingsError;
use crate::sysfs::{dev_node, node_edits};
use crate::sysfs_watch::{Entry, Scan, ScanFn, Watched, Words};
use devplug::cdi::{qualified_name, validate_kind, CdiWriter, Spec};
use devplug::dra::DeviceAttributes;
use devplug::{AllocateError, Backend, ContainerEdits, DeviceList, Options, PreferenceRequest};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use tokio::sync::watch;

/// How allocated devices are named in the container's environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum EnvNaming {
    /// One variable, the values comma-separated.
    List(String),
    /// One variable per value: `<prefix>0`, `<prefix>1`, … in the order of the request.
    Numbered(String),
    /// No variable.
    Nothing,
}

/// One device a scan found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Found {
    /// Its id (a PCI address, `davinci0`, `dfl-port.0`), also its CDI device name.
    pub(crate) id: String,
    /// The physical device it lives on: itself, or an SR-IOV VF's physical function.
    pub(crate) physical: String,
    /// Its own device nodes, relative to the dev root (`vfio/12`).
    pub(crate) nodes: Vec<PathBuf>,
    /// What the environment says for it (PCI addresses of its functions, an index).
    pub(crate) env_values: Vec<String>,
    /// NUMA node.
    pub(crate) numa: Option<i64>,
    /// Why it cannot be used now (then it is Unhealthy).
    pub(crate) problem: Option<String>,
    /// DRA attributes.
    pub(crate) attributes: Option<Box<DeviceAttributes>>,
}

/// What a scan module returns; [`scan_result`] turns it into what `sysfs_watch` follows.
#[derive(Debug, Default)]
pub(crate) struct Inventory {
    /// Devices, in order.
    pub(crate) found: Vec<Found>,
    /// Nodes every device needs, given once (relative to the dev root).
    pub(crate) shared_nodes: Vec<PathBuf>,
    /// Folders whose changes could change the result.
    pub(crate) watch_dirs: BTreeSet<PathBuf>,
    /// Devices present but unusable, with the reason (bound to another driver): one seen
    /// before stays listed, Unhealthy, with it.
    pub(crate) absent: BTreeMap<String, String>,
    /// Physical devices present whose vanished devices were reconfigured away (an SR-IOV PF
    /// whose `sriov_numvfs` went down), so those are dropped rather than kept Unhealthy.
    pub(crate) present: BTreeSet<String>,
}

/// What allocation needs from the latest scan.
#[derive(Debug, Default)]
pub(crate) struct NodeDevices {
    devices: HashMap<String, Found>,
    shares: HashMap<String, ShareInfo>,
    shared_nodes: Vec<PathBuf>,
}

/// Turns an inventory into a scan: entries, state, and the CDI spec (`kind` when CDI is on),
/// with the shared nodes as the spec's common edits.
pub(crate) fn scan_result(
    inventory: Inventory,
    dev_root: &std::path::Path,
    kind: Option<&str>,
) -> Scan<NodeDevices> {
    let Inventory {
        found,
        shared_nodes,
        watch_dirs,
        absent,
        present,
    } = inventory;
    let spec = kind.map(|kind| {
        let mut spec = Spec::new(kind).common(&node_edits(dev_root, &shared_nodes));
        for f in &found {
            spec = spec.device(f.id.clone(), &node_edits(dev_root, &f.nodes));
        }
        spec
    });
    let entries = found
        .iter()
        .map(|f| Entry {
            id: f.id.clone(),
            physical: f.physical.clone(),
            numa: f.numa,
            problem: f.problem.clone(),
            attributes: f.attributes.clone(),
        })
        .collect();
    let shares = found
        .iter()
        .enumerate()
        .map(|(physical, f)| {
            let share = ShareInfo {
                physical,
                numa: f.numa,
            };
            (f.id.clone(), share)
        })
        .collect();
    let devices = found.into_iter().map(|f| (f.id.clone(), f)).collect();
    Scan {
        entries,
        state: NodeDevices {
            devices,
            shares,
            shared_nodes,
        },
        watch_dirs,
        spec,
        absent,
        present,
        labels: crate::NodeLabels::new(),
    }
}

/// What a backend built on this module is: its names, its roots, its scan.
pub(crate) struct Flavor {
    /// The backend in logs (`vfio`).
    pub(crate) what: &'static str,
    /// How health reasons speak of a missing device (`PCI device` … `is gone from sysfs`).
    pub(crate) words: Words,
    /// How the environment names allocated devices.
    pub(crate) env: EnvNaming,
    /// The host's /dev (a fake tree in tests).
    pub(crate) dev_root: PathBuf,
    /// Write a CDI spec into this folder (kind = the resource name), or none.
    pub(crate) cdi_dir: Option<PathBuf>,
}

/// Devices that are device nodes plus environment variables, found by a scan and followed by
/// events. Built by `vfio::start`, `qat::start`, `ascend::start` and `fpga::start`.
pub struct NodeBackend {
    dev_root: PathBuf,
    env: EnvNaming,
    kind: String,
    watched: Watched<NodeDevices>,
}

impl NodeBackend {
    /// Scans once, writes the CDI spec, and follows changes. `scan` gets the CDI kind when CDI
    /// is on. Must be called inside a tokio runtime.
    pub(crate) fn start(
        resource: &str,
        flavor: Flavor,
        scan: impl Fn(Option<&str>) -> Scan<NodeDevices> + Send + Sync + 'static,
    ) -> Result<Self, SettingsError> {
        let kind = resource.to_owned();
        let cdi = match &flavor.cdi_dir {
            Some(dir) => {
                validate_kind(&kind).map_err(|e| {
                    SettingsError::new(
                        "cdi",
                        format!("the resource name is the CDI kind, and {e}; set cdi: false"),
                    )
                })?;
                Some(CdiWriter::new(dir, &format!("devplug-{kind}")))
            }
            None => None,
        };
        let cdi_kind = cdi.as_ref().map(|_| kind.clone());
        let what = flavor.what;
        let not_served = std::sync::Mutex::new(BTreeMap::new());
        let scan: ScanFn<NodeDevices> = Arc::new(move || {
            let found = scan(cdi_kind.as_deref());
            let mut before = not_served.lock().unwrap_or_else(|e| e.into_inner());
            log_not_served(what, &before, &found.absent);
            before.clone_from(&found.absent);
            found
        });
        let watched = Watched::start(scan, cdi, flavor.what, flavor.words);
        Ok(NodeBackend {
            dev_root: flavor.dev_root,
            env: flavor.env,
            kind,
            watched,
        })
    }
}

impl Backend for NodeBackend {
    fn devices(&self) -> watch::Receiver<DeviceList> {
        self.watched.devices()
    }

    fn allocate(&self, ids: &[String]) -> Result<ContainerEdits, AllocateError> {
        let state = self.watched.state();
        let mut edits = ContainerEdits::default();
        let mut nodes_given = HashSet::new();
        let mut values = Vec::new();
        for id in ids {
            let device = state.devices.get(id).ok_or_else(|| {
                AllocateError::InvalidRequest(format!("device {id:?} is no longer present"))
            })?;
            for node in state.shared_nodes.iter().chain(&device.nodes) {
                if nodes_given.insert(node.clone()) {
                    edits.devices.push(dev_node(&self.dev_root, node));
                }
            }
            values.extend(device.env_values.iter().cloned());
            if self.watched.cdi_ready() {
                edits.cdi_devices.push(qualified_name(&self.kind, id));
            }
        }
        match &self.env {
            EnvNaming::List(name) => {
                edits.envs.insert(name.clone(), values.join(","));
            }
            EnvNaming::Numbered(prefix) => {
                for (n, value) in values.into_iter().enumerate() {
                    edits.envs.insert(format!("{prefix}{n}"), value);
                }
            }
            EnvNaming::Nothing => {}
        }
        Ok(edits)
    }

    fn preferred(&self, request: &PreferenceRequest<'_>) -> Vec<String> {
        let state = self.watched.state();
        prefer(request, &state.shares, ReplicaPolicy::Spread)
    }

    fn options(&self) -> Options {
        Options {
            preferred_allocation: true,
            pre_start_required: false,
        }
    }
}

/// Logs the devices newly left out (bound to another driver) at WARN, and those served again
/// at INFO: the operator binds devices, and a wrong binding is the usual reason a device is
/// missing.
fn log_not_served(
    what: &'static str,
    before: &BTreeMap<String, String>,
    now: &BTreeMap<String, String>,
) {
    for (device, reason) in now.iter().filter(|(d, _)| !before.contains_key(*d)) {
        tracing::warn!(backend = what, %device, "{reason}: not served");
    }
    for device in before.keys().filter(|d| !now.contains_key(*d)) {
        tracing::info!(backend = what, %device, "no longer left out");
    }
}

/// `PCI_RESOURCE_<NAME>` exactly as KubeVirt's virt-launcher looks it up: the resource name
/// upper-cased with `.` and `/` as `_` (`intel.com/qat` → `PCI_RESOURCE_INTEL_COM_QAT`; a `-`
/// stays).
pub(crate) fn pci_resource_env(resource: &str) -> String {
    let name: String = resource
        .chars()
        .map(|c| match c {
            '.' | '/' => '_',
            c => c.to_ascii_uppercase(),
        })
        .collect();
    format!("PCI_RESOURCE_{name}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubevirt_env_names() {
        assert_eq!(
            pci_resource_env("intel.com/qat"),
            "PCI_RESOURCE_INTEL_COM_QAT"
        );
        assert_eq!(
            pci_resource_env("nvidia.com/GA102GL_A10"),
            "PCI_RESOURCE_NVIDIA_COM_GA102GL_A10"
        );
        assert_eq!(
            pci_resource_env("example.com/my-nic"),
            "PCI_RESOURCE_EXAMPLE_COM_MY-NIC"
        );
    }
}
