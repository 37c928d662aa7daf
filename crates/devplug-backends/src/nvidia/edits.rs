//! What a container is given for its units, whatever they are (whole GPUs, MIG devices, MIG
//! partitions made for it), by the resource's `device_list_strategy`:
//! - `envvar`: `NVIDIA_VISIBLE_DEVICES` with the units' UUIDs;
//! - `cdi-cri`: the units' CDI names, once the resource's spec is written;
//! - `device-specs`: the control nodes that exist, the units' nodes (each once) and the driver's
//!   files, the same as the CDI spec's edits.
//!
//! A unit that has no device in the CDI spec (a MIG partition, whose MIG device is made at
//! allocation, after the spec was written) is given by its nodes whatever the strategy.

use super::seam::{GpuInfo, MigInfo};
use super::settings::{ListStrategy, NvidiaSettings};
use super::view::{ServedGpu, View, CDI_KIND};
use super::VISIBLE_DEVICES_ENV;
use crate::sysfs::dev_node;
use devplug::cdi::qualified_name;
use devplug::{AllocateError, ContainerEdits};
use std::collections::HashSet;
use std::path::PathBuf;

/// One unit as a container is given it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Given {
    /// The UUID it goes by: the GPU's or the MIG device's.
    pub(super) uuid: String,
    /// Its nodes relative to /dev: its GPU's, then a MIG device's caps nodes.
    pub(super) nodes: Vec<PathBuf>,
    /// Whether the resource's CDI spec has a device for it.
    pub(super) in_spec: bool,
}

impl Given {
    /// A MIG partition just made: its MIG device, on `gpu`, with its caps nodes.
    pub(super) fn partition(gpu: &GpuInfo, mig: &MigInfo, caps: Vec<PathBuf>) -> Given {
        let mut nodes = vec![View::gpu_node(gpu)];
        nodes.extend(caps);
        Given {
            uuid: mig.uuid.clone(),
            nodes,
            in_spec: false,
        }
    }

    fn served(unit: &ServedGpu) -> Given {
        Given {
            uuid: unit.uuid().to_owned(),
            nodes: unit.nodes(),
            in_spec: true,
        }
    }
}

/// The served units (whole GPUs or MIG devices) of `ids`, each once (replicas of one GPU are
/// one unit).
pub(super) fn served(view: &View, ids: &[String]) -> Result<Vec<Given>, AllocateError> {
    let mut units = Vec::new();
    let mut seen = HashSet::new();
    for id in ids {
        let unit = view.served(id)?;
        if seen.insert(unit.uuid()) {
            units.push(Given::served(unit));
        }
    }
    Ok(units)
}

/// The container's edits for `units`; `cdi_ready` says whether the CDI spec is on disk.
pub(super) fn container_edits(
    settings: &NvidiaSettings,
    view: &View,
    cdi_ready: bool,
    units: &[Given],
) -> ContainerEdits {
    let mut edits = ContainerEdits::default();
    if settings.sends(ListStrategy::Envvar) {
        let uuids: Vec<&str> = units.iter().map(|u| u.uuid.as_str()).collect();
        edits
            .envs
            .insert(VISIBLE_DEVICES_ENV.into(), uuids.join(","));
    }
    let specs = settings.sends(ListStrategy::DeviceSpecs);
    if specs || units.iter().any(|u| !u.in_spec) {
        let dev_root = &settings.dev_root;
        for node in View::control_nodes(dev_root) {
            edits.devices.push(dev_node(dev_root, &node));
        }
        let mut given = HashSet::new();
        for unit in units.iter().filter(|u| specs || !u.in_spec) {
            // Two MIG devices of one GPU share its node: given once.
            for node in &unit.nodes {
                if given.insert(node) {
                    edits.devices.push(dev_node(dev_root, node));
                }
            }
        }
        edits.mounts = view.driver_mounts();
    }
    if settings.sends(ListStrategy::CdiCri) && cdi_ready {
        edits.cdi_devices = units
            .iter()
            .filter(|u| u.in_spec)
            .map(|u| qualified_name(CDI_KIND, &u.uuid))
            .collect();
    }
    edits
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvidia::seam::Snapshot;

    fn settings(dev_root: &std::path::Path, strategies: &[ListStrategy]) -> NvidiaSettings {
        NvidiaSettings {
            device_list_strategy: strategies.to_vec(),
            dev_root: dev_root.to_owned(),
            ..Default::default()
        }
    }

    fn whole(uuid: &str, minor: u32) -> Given {
        Given {
            uuid: uuid.into(),
            nodes: vec![PathBuf::from(format!("nvidia{minor}"))],
            in_spec: true,
        }
    }

    fn partition(uuid: &str, caps: &[&str]) -> Given {
        let mut nodes = vec![PathBuf::from("nvidia0")];
        nodes.extend(caps.iter().map(PathBuf::from));
        Given {
            uuid: uuid.into(),
            nodes,
            in_spec: false,
        }
    }

    fn paths(edits: &ContainerEdits) -> Vec<String> {
        edits.devices.iter().map(|d| d.host_path.clone()).collect()
    }

    #[test]
    fn each_strategy_gives_its_part_and_a_partition_always_its_nodes() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("nvidiactl"), "").unwrap();
        let view = View::build(&NvidiaSettings::default(), &Snapshot::default());
        let gpus = [whole("GPU-0", 0), whole("GPU-1", 1)];
        let parts = [
            partition(
                "MIG-a",
                &["nvidia-caps/nvidia-cap3", "nvidia-caps/nvidia-cap4"],
            ),
            partition(
                "MIG-b",
                &["nvidia-caps/nvidia-cap12", "nvidia-caps/nvidia-cap13"],
            ),
        ];
        let ctl = tmp.path().join("nvidiactl").display().to_string();
        let node = |n: &str| tmp.path().join(n).display().to_string();

        // envvar and cdi-cri (the default).
        let both = settings(tmp.path(), &[ListStrategy::Envvar, ListStrategy::CdiCri]);
        let edits = container_edits(&both, &view, true, &gpus);
        assert_eq!(edits.envs[VISIBLE_DEVICES_ENV], "GPU-0,GPU-1");
        assert_eq!(
            edits.cdi_devices,
            ["nvidia.com/gpu=GPU-0", "nvidia.com/gpu=GPU-1"]
        );
        assert!(edits.devices.is_empty());
        let edits = container_edits(&both, &view, false, &gpus);
        assert!(
            edits.cdi_devices.is_empty(),
            "no spec on disk: no CDI names"
        );
        // A partition: its UUID, the control nodes, its GPU's node once and its caps nodes.
        let edits = container_edits(&both, &view, true, &parts);
        assert_eq!(edits.envs[VISIBLE_DEVICES_ENV], "MIG-a,MIG-b");
        assert!(
            edits.cdi_devices.is_empty(),
            "partitions are not in the spec"
        );
        assert_eq!(
            paths(&edits),
            [
                ctl.clone(),
                node("nvidia0"),
                node("nvidia-caps/nvidia-cap3"),
                node("nvidia-caps/nvidia-cap4"),
                node("nvidia-caps/nvidia-cap12"),
                node("nvidia-caps/nvidia-cap13"),
            ]
        );

        // device-specs only: nodes, no env var.
        let specs = settings(tmp.path(), &[ListStrategy::DeviceSpecs]);
        let edits = container_edits(&specs, &view, true, &gpus);
        assert!(edits.envs.is_empty() && edits.cdi_devices.is_empty());
        assert_eq!(
            paths(&edits),
            [ctl.clone(), node("nvidia0"), node("nvidia1")]
        );
        let edits = container_edits(&specs, &view, true, &parts[..1]);
        assert!(edits.envs.is_empty());
        assert_eq!(paths(&edits).len(), 4);

        // cdi-cri only: a whole GPU by its CDI name, a partition by its nodes.
        let cdi = settings(tmp.path(), &[ListStrategy::CdiCri]);
        let edits = container_edits(&cdi, &view, true, &gpus[..1]);
        assert!(edits.envs.is_empty() && edits.devices.is_empty());
        assert_eq!(edits.cdi_devices, ["nvidia.com/gpu=GPU-0"]);
        let edits = container_edits(&cdi, &view, true, &parts[1..]);
        assert!(edits.envs.is_empty() && edits.cdi_devices.is_empty());
        assert_eq!(paths(&edits).len(), 4);
    }
}
