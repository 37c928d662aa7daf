//! The backend's own thread: NVML calls block (`nvmlEventSetWait` for up to a second at a
//! time), so they never run on the async runtime. The thread loads NVML (retrying with
//! backoff, woken early when `/dev/nvidiactl` appears), discovers the GPUs, publishes the
//! device list and CDI spec, then waits for health events and checks faulted GPUs for
//! recovery until it is stopped. If NVML cannot be opened, the resource serves zero devices
//! (or, once it has served some, keeps them listed as Unhealthy with the reason) and reports
//! itself not ready.

use super::driver_files::{root_of, DriverFiles};
use super::health::{Change, HealthBook};
use super::seam::{DriverInfo, GpuDriver, GpuInfo, GpuSession, RawEvent, SessionEnd, WaitError};
use super::settings::{MigStrategy, NvidiaSettings};
use super::view::{UnitKind, View};
use devplug::cdi::CdiWriter;
use devplug::{Device, DeviceList, Health};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// First retry delay after a failure; doubles up to `retry_max_ms`.
const FIRST_RETRY: Duration = Duration::from_millis(500);

/// The longest event wait while no GPU is waiting for a recovery check. NVML needs no timer
/// (`nvmlEventSetWait` returns on an event); the wait is bounded only so that a backend dropped
/// by a config reload releases NVML within this time. Faulted GPUs are checked every
/// `health.check_interval_ms` instead.
pub(crate) const IDLE_WAIT: Duration = Duration::from_secs(30);

/// What the thread shares with the backend.
pub(crate) struct Shared {
    /// The latest view (for allocation).
    pub(crate) view: RwLock<Arc<View>>,
    /// The published device list.
    pub(crate) devices: watch::Sender<DeviceList>,
    /// Why the resource is not ready (NVML not open), if it is not.
    pub(crate) not_ready: RwLock<Option<String>>,
    /// Why no GPU's health can be told (NVML's events fail), while that lasts: the resource
    /// is not ready for it too.
    pub(crate) health_unknown: RwLock<Option<String>>,
    /// True when the CDI spec for the published devices is on disk.
    pub(crate) cdi_ready: AtomicBool,
    /// Set to stop the thread.
    pub(crate) stop: AtomicBool,
    /// The CDI writer (None when CDI is off).
    pub(crate) cdi: Mutex<Option<CdiWriter>>,
    /// Set once the first attempt to load NVML and discover has ended, either way.
    pub(crate) discovered: watch::Sender<bool>,
    /// The node labels of the published devices ([`super::labels`]).
    pub(crate) labels: watch::Sender<crate::NodeLabels>,
    /// The resource's settings, for the labels.
    pub(crate) settings: Arc<NvidiaSettings>,
}

impl Shared {
    fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// The first discovery has ended (found GPUs, or found it cannot): registration may go on.
    pub(crate) fn set_discovered(&self) {
        self.discovered
            .send_if_modified(|d| !std::mem::replace(d, true));
    }

    pub(crate) fn set_not_ready(&self, reason: Option<String>) {
        *self.not_ready.write().unwrap_or_else(|e| e.into_inner()) = reason;
    }

    fn view(&self) -> Arc<View> {
        self.view.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Publishes `view` with health from `health` (a function of the GPU's UUID and, for a
    /// MIG device, its GPU-instance id).
    fn publish(&self, view: &View, health: impl Fn(&str, Option<u32>) -> Health) {
        let mut devices = Vec::new();
        for gpu in &view.gpus {
            let gi = match &gpu.kind {
                UnitKind::Mig { mig, .. } => Some(mig.gi),
                UnitKind::Gpu | UnitKind::Partition(_) => None,
            };
            let h = health(&gpu.info.uuid, gi);
            for id in &gpu.ids {
                let mut device = Device::new(id.clone())
                    .with_health(h.clone())
                    .with_numa_nodes(gpu.numa);
                device.attributes.clone_from(&gpu.attributes);
                devices.push(device);
            }
        }
        let list = DeviceList::new(devices).with_counter_sets(view.counter_sets.clone());
        let labels = super::labels::node_labels(&self.settings, view, &health);
        self.labels.send_if_modified(|current| {
            let modified = *current != labels;
            if modified {
                *current = labels;
            }
            modified
        });
        self.devices.send_if_modified(|current| {
            let modified = *current != list;
            if modified {
                *current = list;
            }
            modified
        });
    }

    /// Writes the CDI spec for a new view, then makes the view current.
    fn install(&self, view: View, settings: &NvidiaSettings) {
        let mut cdi = self.cdi.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(writer) = cdi.as_mut() {
            match writer.write(&view.spec(&settings.dev_root)) {
                Ok(_) => self.cdi_ready.store(true, Ordering::Release),
                Err(err) => {
                    tracing::error!(path = %writer.path().display(), %err,
                        "cannot write the CDI spec; allocations carry no CDI names");
                    self.cdi_ready.store(false, Ordering::Release);
                }
            }
        }
        *self.view.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(view);
    }

    /// Writes the CDI spec again for the current view (a control node such as
    /// `/dev/nvidia-uvm`, made on first use by nvidia-modprobe, appeared after discovery).
    pub(crate) fn refresh_cdi(&self, settings: &NvidiaSettings) {
        let view = self.view();
        if view.gpus.is_empty() {
            return;
        }
        let mut cdi = self.cdi.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(writer) = cdi.as_mut() {
            match writer.write(&view.spec(&settings.dev_root)) {
                Ok(changed) => {
                    if changed {
                        tracing::info!(path = %writer.path().display(), "CDI spec rewritten: control nodes changed");
                    }
                }
                Err(err) => tracing::error!(path = %writer.path().display(), %err,
                    "cannot rewrite the CDI spec"),
            }
        }
    }
}

/// Waits up to `timeout` for a wake-up; false if the backend is gone.
fn pause(wake: &Receiver<()>, timeout: Duration) -> bool {
    match wake.recv_timeout(timeout) {
        Ok(()) | Err(RecvTimeoutError::Timeout) => true,
        Err(RecvTimeoutError::Disconnected) => false,
    }
}

/// The thread's body.
pub(crate) fn run(
    mut driver: Box<dyn GpuDriver>,
    settings: Arc<NvidiaSettings>,
    shared: Arc<Shared>,
    wake: Receiver<()>,
) {
    let retry_max = Duration::from_millis(settings.retry_max_ms);
    let mut backoff = FIRST_RETRY;
    let mut logged: Option<String> = None;
    loop {
        if shared.stopping() {
            return;
        }
        // Set once a session has discovered its GPUs: only then does the backoff start over,
        // so that NVML opening but discovery failing (a GPU lost at discovery) is retried
        // with the same growing backoff as NVML not opening at all.
        let mut served = false;
        let outcome =
            driver.open(&mut |session| monitor(session, &settings, &shared, &wake, &mut served));
        let reason = match outcome {
            Ok(SessionEnd::Stop) => return,
            Ok(SessionEnd::Reopen(reason)) => reason,
            Err(reason) => format!("NVML not available: {reason}"),
        };
        if served {
            backoff = FIRST_RETRY;
        }
        if logged.as_ref() != Some(&reason) {
            tracing::warn!(%reason, retry_in_ms = backoff.as_millis() as u64,
                "NVIDIA GPUs are not served; retrying (also when /dev/nvidiactl appears)");
            logged = Some(reason.clone());
        }
        shared.set_not_ready(Some(reason.clone()));
        // Devices served before stay listed, Unhealthy with the reason; never served: none.
        let view = shared.view();
        shared.publish(&view, |_, _| Health::unhealthy(reason.clone()));
        shared.set_discovered();
        if !pause(&wake, backoff) {
            return;
        }
        backoff = backoff.saturating_mul(2).min(retry_max);
    }
}

/// The MIG layout of a snapshot: per GPU, its MIG mode and MIG device UUIDs.
type Layout = Vec<(String, bool, Vec<String>)>;

fn layout(snapshot: &super::seam::Snapshot) -> Layout {
    snapshot
        .gpus
        .iter()
        .map(|g| {
            let migs = g.migs.iter().map(|m| m.uuid.clone()).collect();
            (g.uuid.clone(), g.mig_enabled, migs)
        })
        .collect()
}

/// What one discovery found: the installed view, the GPUs to watch, the MIG layout.
type Found = (Arc<View>, Vec<GpuInfo>, Layout);

/// Discovers the GPUs, installs the view (CDI spec first) and says whether it is ready;
/// returns the view, the GPUs to watch (each once, also when it has several MIG devices) and
/// the MIG layout it was built from.
fn discover(
    session: &mut dyn GpuSession,
    settings: &NvidiaSettings,
    shared: &Shared,
) -> Result<Found, String> {
    let known = known_gpus(&shared.view());
    let snapshot = session
        .snapshot()
        .and_then(|s| s.with_lost_as_known(&known))
        .map_err(|e| format!("GPU discovery failed: {e}"))?;
    for lost in &snapshot.lost {
        tracing::warn!(index = lost.index, reason = %lost.reason, "a GPU does not answer at discovery; the others are served, it as it was last seen (Unhealthy) where this resource served it");
    }
    let mut view = View::build(settings, &snapshot);
    let info = session.driver();
    view.driver_version.clone_from(&info.version);
    view.cuda_version = info.cuda_version;
    let (driver, refused) = match driver_files(settings, info) {
        Ok(found) => (found, None),
        Err(refused) => (None, Some(refused)),
    };
    view.driver = driver;
    if settings.mig_strategy == MigStrategy::None {
        for gpu in view.gpus.iter().filter(|g| g.info.mig_enabled) {
            tracing::warn!(uuid = %gpu.info.uuid, "MIG mode is on; served whole (mig_strategy none)");
        }
    }
    if let Some(problem) = &view.problem {
        tracing::error!(%problem, "NVIDIA resource cannot serve its MIG devices");
    }
    tracing::info!(
        gpus = view.gpus.len(),
        devices = view.index.len(),
        "NVIDIA GPUs discovered"
    );
    let problem = view.problem.clone().or(refused);
    shared.install(view, settings);
    shared.set_not_ready(problem);
    let view = shared.view();
    let mut infos: Vec<GpuInfo> = Vec::new();
    for g in &view.gpus {
        if !infos.iter().any(|i| i.uuid == g.info.uuid) {
            infos.push(g.info.clone());
        }
    }
    // With a MIG strategy, every selected GPU is watched, also one that serves nothing now:
    // a MIG change there can give this resource devices.
    if settings.mig_strategy != MigStrategy::None {
        for g in &snapshot.gpus {
            if super::view::selected(settings, g) && !infos.iter().any(|i| i.uuid == g.uuid) {
                infos.push(g.clone());
            }
        }
    }
    Ok((view, infos, layout(&snapshot)))
}

/// The GPUs `view` serves, as discovery read them.
fn known_gpus(view: &View) -> Vec<GpuInfo> {
    view.gpus.iter().map(|g| g.info.clone()).collect()
}

/// The driver's files to give containers, found from where NVML was loaded and the version
/// it reports; `None` when turned off or when the driver's folder is unknown; `Err` (the
/// resource's not-ready reason) when the loader would mix driver versions.
fn driver_files(
    settings: &NvidiaSettings,
    driver: DriverInfo,
) -> Result<Option<Arc<DriverFiles>>, String> {
    if !settings.driver_files {
        return Ok(None);
    }
    let (Some(library), Some(version)) = (driver.library, driver.version) else {
        tracing::warn!(
            "NVML was found by the dynamic loader's search path (or reports no driver version): \
             its folder is unknown, so containers get no driver files; set `library` or \
             `driver_roots`"
        );
        return Ok(None);
    };
    let root = root_of(&library, &settings.driver_roots);
    let host_root = settings.host_driver_root.clone().unwrap_or(root.clone());
    let files = match DriverFiles::locate(&root, &host_root, &library, &version) {
        Ok(files) => files,
        Err(mixed) => {
            tracing::error!(%mixed, "containers get no driver files");
            return Err(mixed.to_string());
        }
    };
    if files.has_cuda() {
        tracing::info!(%version, root = %root.display(), host_root = %host_root.display(),
            libraries = %files.lib_dir().unwrap_or_default().display(),
            files = files.files.len(), "driver files found; containers get them read-only");
    } else {
        tracing::warn!(%version, root = %root.display(),
            "no libcuda.so.{version} where the dynamic loader looks (NVML's folder, the loader \
             cache, ld.so.conf's folders, the usual library folders): containers get no CUDA \
             library");
    }
    Ok(Some(Arc::new(files)))
}

/// One NVML session: discover, publish, watch health (and MIG changes, discovering again).
fn monitor(
    session: &mut dyn GpuSession,
    settings: &NvidiaSettings,
    shared: &Shared,
    wake: &Receiver<()>,
    served: &mut bool,
) -> SessionEnd {
    let mut monitor = match Monitor::start(session, settings, shared) {
        Ok(m) => m,
        Err(end) => return end,
    };
    *served = true;
    let mut first = true;
    loop {
        if shared.stopping() {
            return SessionEnd::Stop;
        }
        if monitor.arm_due() {
            match monitor.arm() {
                Ok(Armed::Done) => monitor.publish(),
                Ok(Armed::Rediscovered) => continue,
                Err(end) => return end,
            }
        }
        if first {
            // The first list goes out once health is watched (or known not to be).
            monitor.publish();
            shared.set_discovered();
            first = false;
        }
        let Some(result) = monitor.wait(wake) else {
            return SessionEnd::Stop;
        };
        // Publish a fault before anything can clear it, then look for recovery once a tick.
        match monitor.on_wait(result) {
            Ok(true) => monitor.publish(),
            Ok(false) => {}
            Err(end) => return end,
        }
        if monitor.check_recoveries() && monitor.armed {
            monitor.publish();
        }
    }
}

/// What [`Monitor::arm`] did.
enum Armed {
    /// The event set is built, or failed with the health made unknown and a retry due.
    Done,
    /// The MIG layout changed before changes were watched: discovered again, to be armed again.
    Rediscovered,
}

/// The state of one NVML session's loop: what is served and watched, the GPUs' health, and
/// when the event set is built (again).
struct Monitor<'a> {
    session: &'a mut dyn GpuSession,
    settings: &'a NvidiaSettings,
    shared: &'a Shared,
    /// The installed view.
    view: Arc<View>,
    /// The GPUs the event set watches.
    infos: Vec<GpuInfo>,
    /// The MIG layout the view was built from.
    layout: Layout,
    book: HealthBook,
    /// True when the event set is built (or no events are watched).
    armed: bool,
    /// When to build the event set next, while not armed.
    rearm_at: Instant,
    /// The wait after the next failure to build it.
    rearm_backoff: Duration,
    /// When faulted GPUs were last checked for recovery.
    last_check: Instant,
    /// GPUs left out of the event set; one that comes back makes the set be built again.
    unmonitored: BTreeSet<String>,
}

impl<'a> Monitor<'a> {
    /// Discovers the GPUs; the event set is built at the first [`Monitor::arm`].
    fn start(
        session: &'a mut dyn GpuSession,
        settings: &'a NvidiaSettings,
        shared: &'a Shared,
    ) -> Result<Self, SessionEnd> {
        let (view, infos, layout) =
            discover(session, settings, shared).map_err(SessionEnd::Reopen)?;
        let now = Instant::now();
        let mut monitor = Monitor {
            session,
            settings,
            shared,
            view,
            infos,
            layout,
            book: HealthBook::new(&settings.health.ignored_xids),
            armed: true,
            rearm_at: now,
            rearm_backoff: FIRST_RETRY,
            last_check: now,
            unmonitored: BTreeSet::new(),
        };
        monitor.armed = !monitor.watching();
        Ok(monitor)
    }

    /// How often faulted GPUs are checked for recovery.
    fn tick(&self) -> Duration {
        Duration::from_millis(self.settings.health.check_interval_ms)
    }

    /// Whether MIG layout changes are watched (under a MIG strategy).
    fn watch_mig(&self) -> bool {
        self.settings.mig_strategy != MigStrategy::None
    }

    /// Whether events are watched at all: for health, or for MIG layout changes.
    fn watching(&self) -> bool {
        self.settings.health.enabled || self.watch_mig()
    }

    /// Publishes the view with the book's health; while the book cannot tell any GPU's health
    /// (NVML failing: a driver upgraded without a reboot, a sick driver), the resource is not
    /// ready either, with that reason, so `/readyz` says why every GPU is Unhealthy.
    fn publish(&self) {
        *self
            .shared
            .health_unknown
            .write()
            .unwrap_or_else(|e| e.into_inner()) =
            self.book.unknown().map(|why| format!("NVIDIA GPUs: {why}"));
        self.shared
            .publish(&self.view, |u, gi| self.book.unit_health(u, gi));
    }

    /// Builds the event set again at once.
    fn rearm_now(&mut self) {
        self.armed = false;
        self.rearm_at = Instant::now();
    }

    /// Builds the event set again after the backoff, which doubles up to `retry_max_ms`.
    fn rearm_later(&mut self) {
        let retry_max = Duration::from_millis(self.settings.retry_max_ms);
        self.rearm_at = Instant::now() + self.rearm_backoff;
        self.rearm_backoff = self.rearm_backoff.saturating_mul(2).min(retry_max);
    }

    /// Discovers the GPUs again (the MIG layout changed) and watches the new layout.
    fn rediscover(&mut self) -> Result<(), SessionEnd> {
        (self.view, self.infos, self.layout) =
            discover(&mut *self.session, self.settings, self.shared).map_err(SessionEnd::Reopen)?;
        self.rearm_now();
        Ok(())
    }

    fn arm_due(&self) -> bool {
        !self.armed && Instant::now() >= self.rearm_at
    }

    /// Builds the event set; a GPU left out of it is unmonitored (lost, if it does not answer).
    fn arm(&mut self) -> Result<Armed, SessionEnd> {
        let (health, watch_mig) = (self.settings.health.enabled, self.watch_mig());
        match self.session.arm(&self.infos, health, watch_mig) {
            Ok(left_out) => {
                self.unmonitored.clear();
                for (uuid, why) in left_out {
                    if !health {
                        tracing::debug!(%uuid, %why, "MIG changes of this GPU are not watched");
                        continue;
                    }
                    // Not answering at all: lost, not just unmonitored.
                    if let Some(g) = self.view.gpus.iter().find(|g| g.info.uuid == uuid) {
                        if !self.session.probe(g.info.index, &uuid) {
                            log(&uuid, self.book.lost(&uuid));
                        }
                    }
                    tracing::warn!(%uuid, %why, "GPU health is not monitored");
                    self.unmonitored.insert(uuid);
                }
                self.armed = true;
                self.rearm_backoff = FIRST_RETRY;
                self.book.set_unknown(None);
                // A MIG change between discovery and this registration sent its event to no
                // one: look once more now that changes are watched.
                // (Lost GPUs as the view has them, as discovery put them: not a change.)
                if watch_mig
                    && self
                        .session
                        .snapshot()
                        .and_then(|s| s.with_lost_as_known(&known_gpus(&self.view)))
                        .is_ok_and(|s| layout(&s) != self.layout)
                {
                    tracing::info!("MIG layout changed during discovery; discovering again");
                    self.rediscover()?;
                    return Ok(Armed::Rediscovered);
                }
            }
            Err(e) if !health => {
                tracing::warn!(err = %e, "MIG changes are not watched");
                self.armed = true;
            }
            Err(e) => {
                let reason = format!("health unknown: cannot watch NVML events: {e}");
                tracing::error!(%reason, retry_in_ms = self.rearm_backoff.as_millis() as u64);
                self.book.set_unknown(Some(reason));
                self.rearm_later();
            }
        }
        Ok(Armed::Done)
    }

    /// Waits for an event, or for the next recovery check or rebuild of the event set; `None`
    /// when the backend is gone.
    fn wait(&mut self, wake: &Receiver<()>) -> Option<Result<RawEvent, WaitError>> {
        let tick = self.tick();
        if self.armed && self.watching() {
            // Only a GPU waiting for its recovery check needs the tick.
            let longest = if self.book.pending().is_empty() {
                IDLE_WAIT
            } else {
                tick
            };
            return Some(self.session.wait(longest));
        }
        let until = if self.armed {
            tick
        } else {
            self.rearm_at
                .saturating_duration_since(Instant::now())
                .min(tick)
        };
        pause(wake, until).then_some(Err(WaitError::Timeout))
    }

    /// Applies what the wait gave; true if a GPU's health changed.
    fn on_wait(&mut self, result: Result<RawEvent, WaitError>) -> Result<bool, SessionEnd> {
        match result {
            Ok(RawEvent::MigChanged { uuid }) => {
                tracing::info!(%uuid, "MIG layout changed; discovering again");
                // Published (only if the list changed) once the new layout is watched.
                self.rediscover()?;
                Ok(false)
            }
            Ok(event) => Ok(handle(
                &mut *self.session,
                &self.view,
                &mut self.book,
                event,
            )),
            Err(WaitError::Timeout) => Ok(false),
            Err(WaitError::GpuLost) => {
                let mut changed = false;
                for gpu in &self.view.gpus {
                    if !self.session.probe(gpu.info.index, &gpu.info.uuid) {
                        changed |= log(&gpu.info.uuid, self.book.lost(&gpu.info.uuid));
                    }
                }
                Ok(changed)
            }
            Err(WaitError::Failed(e)) => {
                let reason = format!("health unknown: NVML event wait failed: {e}");
                tracing::error!(%reason, "rebuilding the event set");
                self.book.set_unknown(Some(reason));
                self.armed = false;
                self.rearm_later();
                Ok(true)
            }
        }
    }

    /// Checks the faulted GPUs for recovery, once a tick; true if a GPU's health changed.
    fn check_recoveries(&mut self) -> bool {
        if self.last_check.elapsed() < self.tick() {
            return false;
        }
        self.last_check = Instant::now();
        let mut changed = false;
        for (uuid, _) in self.book.pending() {
            let Some(gpu) = self.view.gpus.iter().find(|g| g.info.uuid == uuid) else {
                continue;
            };
            let answers = self.session.probe(gpu.info.index, &uuid);
            let action = if answers {
                self.session.recovery_action(gpu.info.index).ok().flatten()
            } else {
                None
            };
            let change = self.book.check(&uuid, action, answers);
            if matches!(change, Change::Recovered(_)) && self.unmonitored.contains(&uuid) {
                // Back, but not in the event set: build it again with this GPU before it is
                // published healthy (the set's rebuild publishes).
                self.rearm_now();
            }
            changed |= log(&uuid, change);
        }
        changed
    }
}

/// Applies one event; true if a GPU's health changed.
fn handle(
    session: &mut dyn GpuSession,
    view: &View,
    book: &mut HealthBook,
    event: RawEvent,
) -> bool {
    let index_of = |uuid: &str| {
        view.gpus
            .iter()
            .find(|g| g.info.uuid == uuid)
            .map(|g| g.info.index)
    };
    match event {
        RawEvent::Xid { uuid, xid, gi, ci } => {
            let action = index_of(&uuid).and_then(|i| session.recovery_action(i).ok().flatten());
            if gi.is_some() {
                tracing::debug!(%uuid, xid, gi, ci, "XID attributed to a GPU instance");
            }
            log(&uuid, book.xid_in(&uuid, gi, xid, action))
        }
        RawEvent::DoubleBitEcc { uuid } => log(&uuid, book.ecc(&uuid)),
        RawEvent::MigChanged { .. } => false,
        RawEvent::Other { uuid } => {
            let Some(index) = index_of(&uuid) else {
                return false;
            };
            let action = session.recovery_action(index).ok().flatten();
            match action {
                Some(a) if a != super::seam::RecoveryAction::None => {
                    log(&uuid, book.xid(&uuid, 154, Some(a)))
                }
                _ => log(&uuid, book.check(&uuid, action, true)),
            }
        }
    }
}

fn log(uuid: &str, change: Change) -> bool {
    match change {
        Change::Unhealthy(reason) => {
            tracing::warn!(%uuid, %reason, "GPU unhealthy");
            true
        }
        Change::Ignored(what) => {
            tracing::info!(%uuid, %what, "XID ignored by policy: the application failed, the GPU is fine");
            false
        }
        Change::Recovered(was) => {
            tracing::info!(%uuid, %was, "GPU recovered (healthy after the hold-down)");
            true
        }
        Change::None => false,
    }
}

#[cfg(test)]
mod tests;
