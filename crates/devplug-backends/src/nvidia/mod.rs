//! The `nvidia` backend: NVIDIA GPUs through NVML, a drop-in for NVIDIA's device plugin.
//!
//! - `seam`: a small trait over owned data between the backend and NVML ([`GpuDriver`],
//!   [`GpuSession`]).
//! - `nvml`: its real implementation with `nvml-wrapper`, loaded at run time.
//! - `view`: one resource's GPUs, replica ids, CDI spec and pair matrix.
//! - `edits`: what a container is given for its units, by the list strategy.
//! - `health`: one state per physical GPU, recovering on a positive signal.
//! - `worker`: the dedicated thread that owns NVML.
//! - [`labels`]: the node labels of what it serves, as GPU Feature Discovery names them.
//! - `settings`: the config keys.
//! - [`mps`]: GPUs shared by capacity (DRA): an MPS control daemon per shared GPU, and each
//!   share's limits.
//!
//! - `partitions`: MIG partitions made at a DRA claim's prepare and destroyed at its unprepare
//!   (`mig_strategy: dynamic`).
//! - `claims`: the backend as a DRA claim backend (feature `dra`): MPS shares, MIG partitions.
//!
//! - `mig_ids` and `mig_instances`: the two modules with `unsafe`: a MIG device's GPU- and
//!   compute-instance ids and the event wait that keeps an event's instance ids, and MIG
//!   profiles, placements and instances made and destroyed.
//!
//! Ids are GPU UUIDs, MIG device UUIDs (`mig_strategy` `single` or `mixed`),
//! `gpu-<index>-mig-<profile>-<start>` for MIG partitions (`dynamic`), or `<uuid>::<n>` for
//! time-slicing replicas. `Allocate` sends
//! `NVIDIA_VISIBLE_DEVICES` (deduplicated UUIDs), CDI names `nvidia.com/gpu=<uuid>` backed by a
//! spec file written atomically, and/or the device nodes, as configured. Preferred allocation
//! is the exact search of [`crate::placement`] over NVLink and PCIe scores for whole GPUs, and
//! [`crate::replicas`] (`spread`/`pack`) over replicas. NVML missing or failing never ends the
//! process: the resource serves nothing (or Unhealthy devices) and retries.

mod claims;
mod driver_files;
mod edits;
mod health;
pub mod labels;
mod mig_ids;
mod mig_instances;
pub mod mps;
mod nvml;
mod partitions;
pub mod seam;
pub mod settings;
mod view;
mod worker;

pub use driver_files::{DriverFile, DriverFiles, CONTAINER_BIN_DIR, CONTAINER_LIB_DIR};
pub use health::xid_description;
pub use nvml::{sysfs_bus_id, NvmlDriver, NvmlPartitioner};
pub use seam::{
    mig_profile, DriverInfo, GiProfile, GpuDriver, GpuInfo, GpuSession, MigInfo, MigPartitioner,
    PcieLevel, Snapshot,
};
pub use settings::{ListStrategy, MigStrategy, MpsShare, NvidiaSettings, DEFAULT_IGNORED_XIDS};
pub use view::{parse_mig_minors, CDI_KIND, MIG_MINORS, NVLINK_SCORE};

use crate::inotify_batch::Batches;
use crate::settings::SettingsError;
use devplug::cdi::CdiWriter;
use devplug::{AllocateError, Backend, ContainerEdits, DeviceList, Options, PreferenceRequest};
use inotify::WatchMask;
use mps::MpsDaemons;
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, RwLock};
use tokio::sync::watch;
use tokio_util::sync::{CancellationToken, DropGuard};
use view::{UnitKind, View};
use worker::Shared;

/// The env var NVIDIA's container runtime reads.
pub const VISIBLE_DEVICES_ENV: &str = "NVIDIA_VISIBLE_DEVICES";

/// NVIDIA GPUs as devices of one resource.
pub struct NvidiaBackend {
    settings: Arc<NvidiaSettings>,
    shared: Arc<Shared>,
    mps: Option<MpsDaemons>,
    partitioner: Option<Arc<dyn MigPartitioner>>,
    wake: Sender<()>,
    _watch: DropGuard,
}

impl NvidiaBackend {
    /// Starts the backend with the real NVML. `resource` names the CDI spec file. Never fails
    /// for a missing driver: it is retried. Must be called inside a tokio runtime.
    pub fn start(resource: &str, settings: &NvidiaSettings) -> Result<Self, SettingsError> {
        if let Some(why) = static_build() {
            // Nothing to retry: this binary cannot load any library, now or later.
            settings.validate()?;
            tracing::error!(resource, "{why}");
            let settings = Arc::new(settings.clone());
            let shared = Self::shared(resource, &settings);
            shared.set_not_ready(Some(why));
            shared.set_discovered();
            return Ok(NvidiaBackend {
                mps: Self::mps_daemons(&settings),
                partitioner: None,
                settings,
                shared,
                wake: std::sync::mpsc::channel().0,
                _watch: CancellationToken::new().drop_guard(),
            });
        }
        let for_candidates = settings.clone();
        let driver = NvmlDriver::new(move || for_candidates.library_candidates())
            .with_mig_profiles(settings.mig_strategy == MigStrategy::Dynamic);
        let mut backend = Self::start_with(resource, settings, Box::new(driver))?;
        if settings.mig_strategy == MigStrategy::Dynamic {
            let for_candidates = settings.clone();
            backend.partitioner = Some(Arc::new(NvmlPartitioner::new(move || {
                for_candidates.library_candidates()
            })));
        }
        Ok(backend)
    }

    /// The same backend making MIG partitions with `partitioner` (`mig_strategy: dynamic`).
    pub fn with_partitioner(mut self, partitioner: Arc<dyn MigPartitioner>) -> Self {
        self.partitioner = Some(partitioner);
        self
    }

    /// The partitioner, or the error a request for a partition gets without one.
    fn partitioner(&self) -> Result<&dyn MigPartitioner, String> {
        self.partitioner
            .as_deref()
            .ok_or_else(|| "this resource cannot make MIG partitions (no NVML)".to_owned())
    }

    /// Starts the backend on any [`GpuDriver`].
    pub fn start_with(
        resource: &str,
        settings: &NvidiaSettings,
        driver: Box<dyn GpuDriver>,
    ) -> Result<Self, SettingsError> {
        settings.validate()?;
        let settings = Arc::new(settings.clone());
        let shared = Self::shared(resource, &settings);
        let (wake, wake_rx) = std::sync::mpsc::channel();
        let stop = CancellationToken::new();
        tokio::spawn(watch_driver(
            settings.clone(),
            shared.clone(),
            wake.clone(),
            stop.clone(),
        ));
        let for_thread = (settings.clone(), shared.clone());
        std::thread::Builder::new()
            .name("nvml".into())
            .spawn(move || worker::run(driver, for_thread.0, for_thread.1, wake_rx))
            .map_err(|e| SettingsError::new("", format!("cannot start the NVML thread: {e}")))?;
        Ok(NvidiaBackend {
            mps: Self::mps_daemons(&settings),
            partitioner: None,
            settings,
            shared,
            wake,
            _watch: stop.drop_guard(),
        })
    }

    /// The MPS daemons of a resource whose GPUs are shared by capacity.
    fn mps_daemons(settings: &NvidiaSettings) -> Option<MpsDaemons> {
        settings
            .share
            .as_ref()
            .map(|s| MpsDaemons::new(&s.dir, s.host_dir.as_deref().unwrap_or(&s.dir)))
    }

    /// What the NVML thread and the backend share, before anything is found.
    fn shared(resource: &str, settings: &Arc<NvidiaSettings>) -> Arc<Shared> {
        let cdi = settings
            .sends(ListStrategy::CdiCri)
            .then(|| CdiWriter::new(&settings.cdi_dir, &format!("devplug-{resource}")));
        let empty = View::build(settings, &Snapshot::default());
        Arc::new(Shared {
            view: RwLock::new(Arc::new(empty)),
            devices: watch::Sender::new(DeviceList::default()),
            not_ready: RwLock::new(Some("NVML not loaded yet".into())),
            health_unknown: RwLock::new(None),
            cdi_ready: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            cdi: Mutex::new(cdi),
            discovered: watch::Sender::new(false),
            labels: watch::Sender::new(crate::NodeLabels::new()),
            settings: settings.clone(),
        })
    }

    fn view(&self) -> Arc<View> {
        self.shared
            .view
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl Drop for NvidiaBackend {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        let _ = self.wake.send(());
    }
}

/// Why this binary can never load NVML, if so: a static (musl) build has no dynamic loader.
fn static_build() -> Option<String> {
    cfg!(all(target_env = "musl", target_feature = "crt-static")).then(|| {
        format!(
            "this devplug is a static build and cannot load libnvidia-ml.so.1 (a static \
             binary has no dynamic loader): run the GPU image, devplug:{}-gpu, whose binaries \
             are built for glibc (deploy/README.md, \"GPU nodes\")",
            env!("CARGO_PKG_VERSION")
        )
    })
}

/// Wakes the NVML thread when the driver shows up: `/dev/nvidiactl` made, or the library
/// copied into a watched folder. Rewrites the CDI spec when another control node appears or
/// goes (`/dev/nvidia-uvm` is made on first use, often after discovery).
async fn watch_driver(
    settings: Arc<NvidiaSettings>,
    shared: Arc<Shared>,
    wake: Sender<()>,
    stop: CancellationToken,
) {
    let mut events = match Batches::new() {
        Ok(e) => e,
        Err(err) => {
            tracing::warn!(%err, "no inotify: the driver is found by retrying only");
            return;
        }
    };
    let mut dirs: BTreeSet<PathBuf> = BTreeSet::from([settings.dev_root.clone()]);
    match &settings.library {
        Some(lib) => dirs.extend(lib.parent().map(PathBuf::from)),
        None => {
            for root in &settings.driver_roots {
                for dir in driver_files::NVML_DIRS {
                    dirs.insert(root.join(dir));
                }
            }
        }
    }
    let mask = WatchMask::CREATE | WatchMask::MOVED_TO | WatchMask::DELETE | WatchMask::MOVED_FROM;
    for dir in dirs.iter().filter(|d| d.is_dir()) {
        if let Err(err) = events.watch(dir, mask) {
            tracing::debug!(dir = %dir.display(), %err, "cannot watch");
        }
    }
    loop {
        let batch = tokio::select! {
            _ = stop.cancelled() => return,
            batch = events.next() => batch,
        };
        let Ok(batch) = batch else { return };
        let control_changed = batch.iter().any(|e| {
            e.name
                .as_ref()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n != "nvidiactl" && view::CONTROL_NODES.contains(&n))
        });
        if control_changed {
            let (settings, shared) = (settings.clone(), shared.clone());
            let _ = tokio::task::spawn_blocking(move || shared.refresh_cdi(&settings)).await;
        }
        let interesting = batch.iter().any(|e| {
            !e.mask.contains(inotify::EventMask::DELETE)
                && !e.mask.contains(inotify::EventMask::MOVED_FROM)
                && e.name
                    .as_ref()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n == "nvidiactl" || n.starts_with("libnvidia-ml.so"))
        });
        if !interesting {
            continue;
        }
        // Let a driver installation settle (more nodes, a library still being written) before
        // the NVML thread tries: quiet for 50 ms, at most 500 ms.
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_millis(500);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(std::time::Duration::from_millis(50)) => break,
                _ = tokio::time::sleep_until(deadline) => break,
                more = events.next() => if more.is_err() { break },
            }
        }
        if wake.send(()).is_err() {
            return;
        }
    }
}

impl NvidiaBackend {
    /// The container's edits for `units` of `view` ([`edits`]).
    /// The edits for whole GPUs or MIG devices given to a DRA claim. The claim's own CDI spec
    /// is how they reach the container, and a CDI spec cannot name the resource's CDI devices,
    /// so the units' nodes, the control nodes and the driver's files are in the edits whatever
    /// the device plugin's `device_list_strategy` (`NVIDIA_VISIBLE_DEVICES` as it says).
    fn claim_edits(&self, ids: &[String]) -> Result<ContainerEdits, AllocateError> {
        let view = self.view();
        let mut units = edits::served(&view, ids)?;
        for unit in &mut units {
            unit.in_spec = false;
        }
        Ok(self.container_edits(&view, &units))
    }

    fn container_edits(&self, view: &View, units: &[edits::Given]) -> ContainerEdits {
        let cdi_ready = self.shared.cdi_ready.load(Ordering::Acquire);
        edits::container_edits(&self.settings, view, cdi_ready, units)
    }

    /// The MPS daemons, the driver's MPS program and the GPU's UUID for a share of `id`.
    fn mps_for(&self, id: &str) -> Result<(&MpsDaemons, mps::MpsProgram, String), AllocateError> {
        let mps = self.mps.as_ref().ok_or_else(|| {
            AllocateError::InvalidRequest(format!(
                "GPU {id} was allocated as a share, and this resource has no `share:`"
            ))
        })?;
        let view = self.view();
        let gpu = view.served(id)?;
        match gpu.kind {
            UnitKind::Gpu => {}
            UnitKind::Mig { .. } | UnitKind::Partition(_) => {
                return Err(AllocateError::InvalidRequest(format!(
                    "{id} is a MIG device: only whole GPUs are shared through MPS"
                )))
            }
        }
        let driver = view.driver.as_ref();
        let program = driver
            .and_then(|d| d.program(mps::MPS_CONTROL))
            .map(|control| mps::MpsProgram {
                control,
                lib_dir: driver.and_then(|d| d.lib_dir()),
            })
            .ok_or_else(|| {
                AllocateError::Failed(format!(
                    "the driver's {} was not found under its root (sharing through MPS needs \
                     driver_files on and the driver's programs)",
                    mps::MPS_CONTROL
                ))
            })?;
        Ok((mps, program, gpu.uuid().to_owned()))
    }
}

impl Backend for NvidiaBackend {
    fn devices(&self) -> watch::Receiver<DeviceList> {
        self.shared.devices.subscribe()
    }

    fn allocate(&self, ids: &[String]) -> Result<ContainerEdits, AllocateError> {
        let view = self.view();
        if partitions::any(&view, ids) {
            return Err(AllocateError::InvalidRequest(format!(
                "{ids:?}: MIG partitions (mig_strategy: dynamic) are made per DRA claim, and the \
                 device plugin does not serve them"
            )));
        }
        if self.settings.fail_requests_greater_than_one && view.shared && ids.len() > 1 {
            return Err(AllocateError::InvalidRequest(format!(
                "{} shared GPUs requested; fail_requests_greater_than_one allows one replica per \
                 container (replicas share a GPU, they add no compute)",
                ids.len()
            )));
        }
        let units = edits::served(&view, ids)?;
        Ok(self.container_edits(&view, &units))
    }

    fn preferred(&self, request: &PreferenceRequest<'_>) -> Vec<String> {
        let view = self.view();
        let out = if view.shared {
            crate::replicas::prefer(request, &view.shares(), self.settings.replica_policy)
        } else {
            let index = |ids: &[String]| -> Vec<usize> {
                ids.iter()
                    .filter_map(|id| view.index.get(id).copied())
                    .collect()
            };
            let selection = view.matrix.best(
                &index(request.available),
                &index(request.must_include),
                request.size,
            );
            selection
                .devices
                .iter()
                .filter_map(|&i| view.gpus.get(i).map(|g| g.ids[0].clone()))
                .collect()
        };
        // The host puts every must-include id first (ones this backend no longer knows too)
        // and trims the answer to the size.
        out
    }

    fn discovered(&self) -> devplug::BoxFuture<'_, ()> {
        let mut done = self.shared.discovered.subscribe();
        Box::pin(async move {
            // An error means the sender is gone: nothing more will be discovered.
            let _ = done.wait_for(|d| *d).await;
        })
    }

    fn options(&self) -> Options {
        Options {
            preferred_allocation: true,
            pre_start_required: false,
        }
    }

    /// Why the resource cannot serve GPUs now (NVML not loaded, driver not ready), if so.
    fn not_ready(&self) -> Option<String> {
        let not_ready = self
            .shared
            .not_ready
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        not_ready.or_else(|| {
            self.shared
                .health_unknown
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
        })
    }
}

impl crate::NodeLabelSource for NvidiaBackend {
    /// GPU Feature Discovery's labels for what this resource serves ([`labels`]).
    fn node_labels(&self) -> watch::Receiver<crate::NodeLabels> {
        self.shared.labels.subscribe()
    }
}
