//! The `intel-gpu` backend (config key `intel_gpu`): Intel GPUs from sysfs, no vendor library.
//!
//! - `settings`: driver, sharing, by-path mounts, CDI output, the roots.
//! - [`labels`]: the node labels of the GPUs, as the labeller of Intel's GPU plugin names them.
//! - `discover`: `class/drm` cards of vendor 0x8086 on the configured driver; SR-IOV PFs with
//!   VFs enabled skipped, VFs served.
//!
//! Ids are card names (`card0`), or `card0-0 … card0-(N-1)` with `count: N`: N containers
//! share one GPU (they are not N GPUs). A container gets each GPU's `/dev/dri/card<N>` and
//! `/dev/dri/renderD<M>` once however many shares it has, the read-only
//! `/dev/dri/by-path/pci-<bdf>-{card,render}` links when that folder exists, and CDI names
//! `gpu.intel.com/<driver>=card<N>`. Preferred allocation is NUMA-first, then the share policy
//! (`spread`/`pack`), as in `hostdev`. Discovery follows changes with inotify: no 5 s poll.

mod discover;
pub mod labels;
pub mod settings;

pub use settings::{IntelDriver, IntelGpuSettings};

use crate::settings::SettingsError;
use crate::sysfs::dev_node;
use crate::sysfs_watch::{ScanFn, Watched, Words};
use devplug::cdi::{qualified_name, CdiWriter};
use devplug::{AllocateError, Backend, ContainerEdits, DeviceList, Options, PreferenceRequest};
use discover::{cdi_kind, IntelState};
use std::collections::HashSet;
use std::sync::Arc;
use tokio::sync::watch;

/// Intel GPUs (or shares of them) as devices.
pub struct IntelGpuBackend {
    settings: Arc<IntelGpuSettings>,
    kind: String,
    watched: Watched<IntelState>,
}

impl IntelGpuBackend {
    /// Scans once, writes the CDI spec and starts following changes. Zero GPUs is not an
    /// error: they are picked up when they appear. Must be called inside a tokio runtime.
    pub fn start(settings: &IntelGpuSettings) -> Result<Self, SettingsError> {
        settings.validate()?;
        let settings = Arc::new(settings.clone());
        let kind = cdi_kind(&settings);
        let for_scan = settings.clone();
        let scan: ScanFn<IntelState> = Arc::new(move || discover::scan(&for_scan));
        let cdi = settings
            .cdi
            .then(|| CdiWriter::new(&settings.cdi_dir, &format!("devplug-{kind}")));
        let watched = Watched::start(scan, cdi, "intel-gpu", Words::GPU);
        Ok(IntelGpuBackend {
            settings,
            kind,
            watched,
        })
    }
}

impl Backend for IntelGpuBackend {
    fn devices(&self) -> watch::Receiver<DeviceList> {
        self.watched.devices()
    }

    fn allocate(&self, ids: &[String]) -> Result<ContainerEdits, AllocateError> {
        let state = self.watched.state();
        let dev_root = &self.settings.dev_root;
        let mut edits = ContainerEdits::default();
        let mut gpus_seen = HashSet::new();
        for id in ids {
            let gpu = state
                .shares
                .get(id)
                .and_then(|s| state.gpus.get(s.physical))
                .ok_or_else(|| {
                    AllocateError::InvalidRequest(format!("device {id:?} is no longer present"))
                })?;
            if !gpus_seen.insert(gpu.card.as_str()) {
                continue; // another share of a GPU already given
            }
            edits
                .devices
                .extend(gpu.nodes.iter().map(|n| dev_node(dev_root, n)));
            edits.mounts.extend(gpu.mounts.iter().cloned());
            if self.watched.cdi_ready() {
                edits
                    .cdi_devices
                    .push(qualified_name(&self.kind, &gpu.card));
            }
        }
        Ok(edits)
    }

    fn preferred(&self, request: &PreferenceRequest<'_>) -> Vec<String> {
        let state = self.watched.state();
        crate::replicas::prefer(request, &state.shares, self.settings.policy)
    }

    fn options(&self) -> Options {
        Options {
            preferred_allocation: true,
            pre_start_required: false,
        }
    }
}

impl crate::NodeLabelSource for IntelGpuBackend {
    fn node_labels(&self) -> watch::Receiver<crate::NodeLabels> {
        self.watched.labels()
    }
}
