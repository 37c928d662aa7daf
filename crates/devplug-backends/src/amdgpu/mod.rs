//! The `amdgpu` backend: AMD GPUs and their compute partitions from sysfs, no vendor library.
//!
//! - `settings`: which partition type to serve, CDI output, the roots.
//! - `discover`: GPUs bound to `amdgpu`, `amdgpu_xcp_*` partitions, KFD links.
//! - [`labels`]: the node labels of the GPUs, as AMD's node labeller names them.
//!
//! Ids are PCI addresses (as ROCm's plugin uses) and `amdgpu_xcp_<k>` for partitions beyond
//! the first. A container gets `/dev/kfd` once plus each device's `/dev/dri/card<N>` and
//! `/dev/dri/renderD<M>`, as device specs and as CDI names (`amd.com/gpu=<id>`). Preferred
//! allocation is the exact search of [`crate::placement`] over pair weights from KFD's topology
//! (same GPU > XGMI > PCIe > none), NUMA as the tie-break. Discovery follows changes with inotify
//! (a driver that loads late, a GPU that appears, a repartition): never a poll, never an exit.

mod discover;
pub mod labels;
pub mod settings;

pub use discover::{WEIGHT_NONE, WEIGHT_PCIE, WEIGHT_SAME_GPU, WEIGHT_XGMI};
pub use settings::AmdgpuSettings;

use crate::settings::SettingsError;
use crate::sysfs::dev_node;
use crate::sysfs_watch::{ScanFn, Watched, Words};
use devplug::cdi::{qualified_name, CdiWriter};
use devplug::{AllocateError, Backend, ContainerEdits, DeviceList, Options, PreferenceRequest};
use discover::{AmdState, KfdCache, CDI_KIND};
use std::collections::HashSet;
use std::path::Path;
use std::sync::{Arc, Mutex};
use tokio::sync::watch;

/// AMD GPUs and partitions as devices.
pub struct AmdgpuBackend {
    settings: Arc<AmdgpuSettings>,
    watched: Watched<AmdState>,
}

impl AmdgpuBackend {
    /// Scans once, writes the CDI spec and starts following changes. Zero GPUs (no driver yet)
    /// is not an error: they are picked up when they appear. Must be called inside a tokio
    /// runtime.
    pub fn start(settings: &AmdgpuSettings) -> Result<Self, SettingsError> {
        settings.validate()?;
        let settings = Arc::new(settings.clone());
        let for_scan = settings.clone();
        let cache = Mutex::new(KfdCache::default());
        let scan: ScanFn<AmdState> = Arc::new(move || {
            let mut cache = cache.lock().unwrap_or_else(|e| e.into_inner());
            discover::scan(&for_scan, &mut cache)
        });
        let cdi = settings.cdi.then(|| {
            let stem = match &settings.partition_type {
                Some(t) => format!("devplug-{CDI_KIND}-{t}"),
                None => format!("devplug-{CDI_KIND}"),
            };
            CdiWriter::new(&settings.cdi_dir, &stem)
        });
        let watched = Watched::start(scan, cdi, "amdgpu", Words::GPU);
        Ok(AmdgpuBackend { settings, watched })
    }
}

impl Backend for AmdgpuBackend {
    fn devices(&self) -> watch::Receiver<DeviceList> {
        self.watched.devices()
    }

    fn allocate(&self, ids: &[String]) -> Result<ContainerEdits, AllocateError> {
        let state = self.watched.state();
        let dev_root = &self.settings.dev_root;
        let mut edits = ContainerEdits::default();
        edits.devices.push(dev_node(dev_root, Path::new("kfd")));
        let mut seen = HashSet::new();
        for id in ids {
            let device = state
                .index
                .get(id)
                .and_then(|&i| state.devices.get(i))
                .ok_or_else(|| {
                    AllocateError::InvalidRequest(format!("device {id:?} is no longer present"))
                })?;
            for node in &device.nodes {
                if seen.insert(node.clone()) {
                    edits.devices.push(dev_node(dev_root, node));
                }
            }
        }
        if self.watched.cdi_ready() {
            edits.cdi_devices = ids.iter().map(|id| qualified_name(CDI_KIND, id)).collect();
        }
        Ok(edits)
    }

    fn preferred(&self, request: &PreferenceRequest<'_>) -> Vec<String> {
        let state = self.watched.state();
        let index = |ids: &[String]| -> Vec<usize> {
            ids.iter()
                .filter_map(|id| state.index.get(id).copied())
                .collect()
        };
        let selection = state.matrix.best(
            &index(request.available),
            &index(request.must_include),
            request.size,
        );
        let out: Vec<String> = selection
            .devices
            .iter()
            .filter_map(|&i| state.devices.get(i).map(|d| d.id.clone()))
            .collect();
        // The host puts every must-include id first (ones this backend no longer knows too)
        // and trims the answer to the size.
        out
    }

    fn options(&self) -> Options {
        Options {
            preferred_allocation: true,
            pre_start_required: false,
        }
    }
}

impl crate::NodeLabelSource for AmdgpuBackend {
    fn node_labels(&self) -> watch::Receiver<crate::NodeLabels> {
        self.watched.labels()
    }
}
