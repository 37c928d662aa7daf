//! `NodePrepareResources` and `NodeUnprepareResources` for one driver, without the gRPC: what
//! the kubelet asks for, claim by claim, with an answer for every claim and never a whole-call
//! failure for one bad claim.
//!
//! Preparing a claim: its allocation from the [`ClaimSource`] (our driver's results only, in our
//! pool), checked against the devices that other prepared claims hold (`conflicts`), the
//! devices looked up by their slice names in the backend's newest list and grouped by request
//! (`plan`: a device that left or is unhealthy is that claim's error), the backend's edits
//! for each request ([`ClaimBackend::prepare_devices`] for the devices given whole,
//! [`ClaimBackend::prepare_share`] for shares; run off the runtime by `handover`; its
//! `pre_start` too when the backend asks for it), one CDI spec file per claim written
//! atomically with one CDI device per request (`claim_spec`), then the claim in the
//! checkpoint, then the answer.
//!
//! Repeats are answered from the checkpoint; unpreparing a claim we do not know is a success.
//! The claims of a call are read from the API server first, all at once and under one deadline
//! for the call, with nothing locked: a slow or hung API server makes only that call slow, and
//! an unprepare, which needs no API server, never waits for it. The rest (the backend, the CDI
//! spec, the checkpoint) is serialized per driver, as the checkpoint is one file: by the
//! driver's mutex in this process and by a file lock across processes (`node_lock`: two
//! instances serve at once during a rolling update with surge).

mod claim_spec;
mod conflicts;
mod device_metadata;
mod error;
mod group_commit;
mod handover;
mod node_lock;
mod plan;
#[cfg(test)]
mod tests;

pub use claim_spec::{remove_stale_specs, restore_spec, spec_path};
pub use device_metadata::{CONTAINER_DIR as DEVICE_METADATA_DIR, POD_CLAIM_NAME_ANNOTATION};
pub use error::PrepareError;
pub(crate) use handover::restore_shares;

use super::checkpoint::{Checkpoint, CheckpointError, FileStamp, PreparedClaim, PreparedDevice};
use super::claims::{AllocatedDevice, ClaimRef, ClaimSource};
use crate::claim_metrics::ClaimMetrics;
use conflicts::{holders_of, refuse_taken_devices, whole_ids};
use devplug::dra::ClaimBackend;
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Mutex, MutexGuard};

/// How long the claim reads of one call may take together (the kubelet gives the whole call
/// 45 s; the rest of a prepare is local and quick).
pub const CLAIM_READ_DEADLINE: Duration = Duration::from_secs(30);

/// Per-claim results of a call, by claim UID.
pub type ClaimResults<T> = BTreeMap<String, Result<T, PrepareError>>;

/// A claim's allocation as read at the start of a call: `None` when the claim was prepared
/// already, so nothing was read.
type Read = Option<Result<Vec<AllocatedDevice>, PrepareError>>;

/// The time of each stage of a call ([`crate::claim_metrics::PREPARE_STAGES`]).
struct StageClock {
    last: std::time::Instant,
    laps: [Duration; crate::claim_metrics::PREPARE_STAGES.len()],
}

impl StageClock {
    fn start() -> StageClock {
        StageClock {
            last: std::time::Instant::now(),
            laps: Default::default(),
        }
    }

    /// Ends stage `i`: the time since the last lap is its.
    fn lap(&mut self, i: usize) {
        let now = std::time::Instant::now();
        if let Some(lap) = self.laps.get_mut(i) {
            *lap = now.saturating_duration_since(self.last);
        }
        self.last = now;
    }
}

/// Where a driver keeps its files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrepareFiles {
    /// Folder of the CDI spec files (`/var/run/cdi`).
    pub cdi_dir: PathBuf,
    /// The checkpoint file.
    pub checkpoint: PathBuf,
}

impl PrepareFiles {
    /// The folder of the claims' device metadata files: `dra-device-metadata` beside the
    /// checkpoint, on the same persistent disk.
    pub fn device_metadata_dir(&self) -> PathBuf {
        self.checkpoint
            .parent()
            .unwrap_or(std::path::Path::new("."))
            .join("dra-device-metadata")
    }
}

/// The driver's state held for a change (see [`Preparer::lock_for_change`]).
struct ChangeGuard<'a> {
    preparer: &'a Preparer,
    state: MutexGuard<'a, Checkpoint>,
    /// The node-wide lock (released when dropped) and the changes of other calls waiting for
    /// their write (`group_commit`).
    carry: Option<group_commit::Carry>,
}

impl std::ops::Deref for ChangeGuard<'_> {
    type Target = Checkpoint;
    fn deref(&self) -> &Checkpoint {
        &self.state
    }
}

impl std::ops::DerefMut for ChangeGuard<'_> {
    fn deref_mut(&mut self) -> &mut Checkpoint {
        &mut self.state
    }
}

/// Prepares and unprepares the claims of one driver.
pub struct Preparer {
    driver: String,
    pool: String,
    backend: Arc<dyn ClaimBackend>,
    claims: Arc<dyn ClaimSource>,
    files: PrepareFiles,
    state: Mutex<Checkpoint>,
    /// The checkpoint file as this instance last read or wrote it: another stamp at the path
    /// means another instance of the driver wrote it since.
    stamp: std::sync::Mutex<Option<FileStamp>>,
    read_deadline: Duration,
    /// Whether each prepared claim gets its device metadata files (KEP-5304).
    device_metadata: bool,
    metrics: Arc<ClaimMetrics>,
    /// The prepared claims as last saved, for the device status writer.
    saved: tokio::sync::watch::Sender<crate::device_status::PreparedClaims>,
    /// Calls waiting for the state to make a change (`group_commit`).
    waiting: std::sync::atomic::AtomicUsize,
    /// The lock and the changes waiting for their write, between two holders of the state.
    carried: std::sync::Mutex<Option<group_commit::Carry>>,
    /// Wakes the calls waiting for a group's write when the carry was left with nobody to
    /// take it.
    abandoned: tokio::sync::Notify,
    /// Checkpoint writes made (each one fsync).
    writes: std::sync::atomic::AtomicU64,
}

impl Preparer {
    /// A preparer of `driver`'s claims for `pool` (the node name), reading the checkpoint.
    pub fn new(
        driver: &str,
        pool: &str,
        backend: Arc<dyn ClaimBackend>,
        claims: Arc<dyn ClaimSource>,
        files: PrepareFiles,
    ) -> Result<Preparer, CheckpointError> {
        // The clean-up of files no claim lists only while no other instance of the driver is
        // in a call (it may have written a claim's spec and not yet its checkpoint); the next
        // start cleans up what this one left.
        let quiet = match node_lock::try_lock(&files.checkpoint) {
            Ok(quiet) => quiet,
            Err(err) => {
                tracing::warn!(%driver, path = %node_lock::lock_path(&files.checkpoint).display(), %err, "cannot open the checkpoint's lock file");
                None
            }
        };
        let stamp = FileStamp::of(&files.checkpoint);
        let checkpoint = Checkpoint::load(&files.checkpoint, driver)?;
        if quiet.is_some() {
            remove_stale_specs(&files.cdi_dir, driver, &checkpoint);
            device_metadata::remove_stale_metadata(
                &files.device_metadata_dir(),
                driver,
                &checkpoint,
            );
        } else {
            tracing::info!(%driver, "another instance of the driver is in a call: files no claim lists are left for the next start");
        }
        drop(quiet);
        for (uid, claim) in &checkpoint.claims {
            if let Err(err) = restore_spec(driver, uid, claim) {
                tracing::error!(%driver, claim = %uid, error = %err, "a prepared claim's CDI spec is missing");
            }
        }
        let saved = tokio::sync::watch::Sender::new(Arc::new(checkpoint.claims.clone()));
        Ok(Preparer {
            saved,
            driver: driver.to_owned(),
            pool: pool.to_owned(),
            backend,
            claims,
            files,
            state: Mutex::new(checkpoint),
            stamp: std::sync::Mutex::new(stamp),
            read_deadline: CLAIM_READ_DEADLINE,
            device_metadata: false,
            metrics: Arc::default(),
            waiting: Default::default(),
            carried: Default::default(),
            abandoned: Default::default(),
            writes: Default::default(),
        })
    }

    /// The same preparer with another deadline for the claim reads of one call (default
    /// [`CLAIM_READ_DEADLINE`]).
    pub fn with_read_deadline(mut self, deadline: Duration) -> Preparer {
        self.read_deadline = deadline;
        self
    }

    /// The same preparer writing, for each claim it prepares, a device metadata file per
    /// request mounted into the containers that use it (KEP-5304; default off).
    pub fn with_device_metadata(mut self, on: bool) -> Preparer {
        self.device_metadata = on;
        self
    }

    /// The pool the driver publishes (the node's name).
    pub fn pool(&self) -> &str {
        &self.pool
    }

    /// The backend's device list, as it changes.
    pub fn devices(&self) -> tokio::sync::watch::Receiver<devplug::DeviceList> {
        self.backend.devices()
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn ClaimBackend> {
        &self.backend
    }

    /// The driver's name.
    pub fn driver(&self) -> &str {
        &self.driver
    }

    /// The counters of the prepare and unprepare calls.
    pub fn metrics(&self) -> &Arc<ClaimMetrics> {
        &self.metrics
    }

    /// The prepared claims as last saved to the checkpoint, by UID, as they change.
    pub fn saved(&self) -> tokio::sync::watch::Receiver<crate::device_status::PreparedClaims> {
        self.saved.subscribe()
    }

    /// The prepared claims now, by UID.
    pub async fn prepared(&self) -> BTreeMap<String, PreparedClaim> {
        self.state.lock().await.claims.clone()
    }

    /// The backend ids of the devices prepared claims hold shares of.
    pub async fn shared_devices(&self) -> BTreeSet<String> {
        self.state
            .lock()
            .await
            .claims
            .values()
            .flat_map(|claim| &claim.devices)
            .filter(|d| d.hold.share_id().is_some())
            .map(|d| d.id.clone())
            .collect()
    }

    /// Checkpoint writes made so far (each one fsync): calls queued on the driver's lock share
    /// one.
    pub fn checkpoint_writes(&self) -> u64 {
        self.writes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Prepares every claim; one result per distinct claim UID. Counted in [`Self::metrics`].
    pub async fn prepare(&self, claims: &[ClaimRef]) -> ClaimResults<Vec<PreparedDevice>> {
        let start = std::time::Instant::now();
        let results = self.prepare_claims(claims).await;
        let errors = results.values().filter(|r| r.is_err()).count();
        self.metrics
            .prepare
            .record(start.elapsed(), results.len(), errors);
        results
    }

    async fn prepare_claims(&self, claims: &[ClaimRef]) -> ClaimResults<Vec<PreparedDevice>> {
        let mut clock = StageClock::start();
        let mut distinct: Vec<&ClaimRef> = Vec::new();
        for claim in claims {
            if !distinct.iter().any(|c| c.uid == claim.uid) {
                distinct.push(claim);
            }
        }
        // The allocations of the claims not prepared yet, read with nothing locked: the claims
        // known are those of the last checkpoint write (the state itself is locked by every
        // change, so calls landing together would read one after the other). A claim whose
        // write is still pending is read once more and answered from the state below.
        let known: Vec<bool> = {
            let saved = self.saved.borrow();
            distinct
                .iter()
                .map(|c| saved.contains_key(&c.uid))
                .collect()
        };
        // One deadline for the call: each read ends by it, and a read that ends keeps its result.
        let now = tokio::time::Instant::now();
        let deadline = now
            .checked_add(self.read_deadline)
            .unwrap_or_else(|| now + Duration::from_secs(86_400));
        let reads = distinct
            .iter()
            .zip(&known)
            .map(|(claim, known)| async move {
                if *known {
                    return None;
                }
                Some(self.read_allocation(claim, deadline).await)
            });
        let read: Vec<Read> = futures_util::future::join_all(reads).await;
        let released = self.released_holders(&read, deadline).await;
        clock.lap(0);

        let mut results = BTreeMap::new();
        let mut state = self.lock_for_change().await;
        clock.lap(1);
        // The claims prepared by this call, recorded in one checkpoint write at the end (a
        // write a claim would write the whole checkpoint n times for n claims).
        let mut new: Vec<&ClaimRef> = Vec::new();
        for (claim, allocation) in distinct.into_iter().zip(read) {
            let known = state.claims.contains_key(&claim.uid);
            let result = self
                .prepare_one(&mut state, claim, allocation, &released)
                .await;
            match &result {
                Err(err) => {
                    tracing::warn!(driver = %self.driver, claim = %claim, error = %err, "cannot prepare the claim");
                }
                Ok(_) if !known => new.push(claim),
                Ok(_) => {}
            }
            results.insert(claim.uid.clone(), result);
        }
        let devices: Vec<usize> = new
            .iter()
            .map(|c| state.claims.get(&c.uid).map_or(0, |c| c.devices.len()))
            .collect();
        let own = group_commit::Undo::Prepared(new.iter().map(|c| c.uid.clone()).collect());
        clock.lap(2);
        // One durable write for this call and those queued behind it.
        let committed = self.commit(state, own).await;
        clock.lap(3);
        self.metrics.prepare_stages.record(clock.laps);
        if let Err(err) = committed {
            for claim in new {
                tracing::warn!(driver = %self.driver, claim = %claim, error = %err, "cannot prepare the claim");
                results.insert(claim.uid.clone(), Err(err.clone()));
            }
            return results;
        }
        for (claim, devices) in new.into_iter().zip(devices) {
            tracing::info!(driver = %self.driver, claim = %claim, devices, "claim prepared");
        }
        results
    }

    /// Reads one claim's allocation by `deadline`.
    async fn read_allocation(
        &self,
        claim: &ClaimRef,
        deadline: tokio::time::Instant,
    ) -> Result<Vec<AllocatedDevice>, PrepareError> {
        match tokio::time::timeout_at(deadline, self.claims.allocation(claim)).await {
            Ok(read) => read.map_err(PrepareError::Claim),
            Err(_) => Err(PrepareError::ClaimReadTimeout {
                claim: claim.to_string(),
                after: self.read_deadline,
            }),
        }
    }

    /// The prepared claims that hold a device the read allocations want, and that the API
    /// server no longer has (deleted, or deallocated): the kubelet has yet to unprepare them
    /// (a force-deleted pod, a kubelet restart; its reconcile runs every minute), and the
    /// scheduler has given their devices away. Read with nothing locked, by `deadline`; a
    /// holder that cannot be read counts as still holding.
    async fn released_holders(
        &self,
        read: &[Read],
        deadline: tokio::time::Instant,
    ) -> HashSet<String> {
        let wanted: Vec<&AllocatedDevice> = read
            .iter()
            .flatten()
            .flatten()
            .flatten()
            .filter(|d| d.hold.is_exclusive())
            .collect();
        if wanted.is_empty() {
            return HashSet::new();
        }
        // From the last checkpoint write, as `known` above: a holder whose write is pending
        // is not asked about, and the change below refuses the device as taken (the kubelet
        // tries again).
        let holders = holders_of(&self.saved.borrow().clone(), &wanted);
        let checks = holders.iter().map(|holder| async move {
            let exists = tokio::time::timeout_at(deadline, self.claims.exists(holder)).await;
            matches!(exists, Ok(Ok(false))).then(|| holder.uid.clone())
        });
        futures_util::future::join_all(checks)
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    /// Prepares one claim, given its allocation as read (`None`: it was prepared already when
    /// the call began) and the holders of its devices that the API server no longer has. A new
    /// claim is in `state` but not yet in the checkpoint file: the caller writes it.
    async fn prepare_one(
        &self,
        state: &mut Checkpoint,
        claim: &ClaimRef,
        allocation: Read,
        released: &HashSet<String>,
    ) -> Result<Vec<PreparedDevice>, PrepareError> {
        if let Some(done) = state.claims.get(&claim.uid) {
            claim_spec::restore_missing_spec(&self.driver, &claim.uid, done)?;
            return Ok(done.devices.clone());
        }
        let allocated = match allocation {
            Some(read) => read?,
            // Unprepared by a call that ran while this one read: read it now.
            None => {
                let deadline = tokio::time::Instant::now()
                    .checked_add(self.read_deadline)
                    .unwrap_or_else(tokio::time::Instant::now);
                self.read_allocation(claim, deadline).await?
            }
        };
        refuse_taken_devices(&self.driver, claim, state, &allocated, released)?;
        let list = self.backend.devices().borrow().clone();
        let plan::Plan {
            requests,
            mut devices,
        } = plan::plan(&self.driver, &self.pool, claim, &allocated, &list)?;
        let mut edits = handover::hand_over(&self.driver, &self.backend, requests).await?;
        let metadata = if self.device_metadata {
            let about = device_metadata::MetadataClaim {
                namespace: &claim.namespace,
                name: &claim.name,
                uid: &claim.uid,
                pod_claim_name: allocated.iter().find_map(|d| d.pod_claim_name.as_deref()),
            };
            let root = self.files.device_metadata_dir();
            let files = device_metadata::files(&self.driver, &root, &about, &devices, &list);
            device_metadata::mount_into(&files, &mut edits);
            files.into_iter().map(|f| (f.host_path, f.text)).collect()
        } else {
            Vec::new()
        };
        let spec = claim_spec::build(&self.cdi_kind(), &claim.uid, &edits, &mut devices);
        let spec_json = spec.to_json();
        if let Err(err) = self.finish(claim, &devices, &spec_json, metadata).await {
            handover::release_after_failure(&self.driver, &self.backend, whole_ids(&devices)).await;
            return Err(err);
        }
        let spec_path = self.spec_path(&claim.uid);
        state.claims.insert(
            claim.uid.clone(),
            PreparedClaim {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
                devices: devices.clone(),
                cdi_spec: spec_path,
                cdi_spec_json: Some(spec_json),
            },
        );
        Ok(devices)
    }

    /// After the backend gave the devices: its pre-start hook, when it asks for one, the
    /// claim's device metadata files (`metadata`: path and text; none when off), then its CDI
    /// spec file, which mounts them.
    async fn finish(
        &self,
        claim: &ClaimRef,
        devices: &[PreparedDevice],
        spec_json: &str,
        metadata: Vec<(PathBuf, String)>,
    ) -> Result<(), PrepareError> {
        if self.backend.options().pre_start_required {
            let ids: Vec<String> = devices.iter().map(|d| d.id.clone()).collect();
            self.backend
                .pre_start(&ids)
                .await
                .map_err(|e| PrepareError::PreStart(e.0))?;
        }
        let written = async {
            if !metadata.is_empty() {
                device_metadata::write(metadata).await?;
            }
            claim_spec::write(self.spec_path(&claim.uid), spec_json.to_owned()).await
        }
        .await;
        if written.is_err() {
            let _ = device_metadata::remove(&self.files.device_metadata_dir(), &claim.uid);
        }
        written
    }

    /// Unprepares every claim; one result per distinct claim UID. Counted in [`Self::metrics`].
    pub async fn unprepare(&self, claims: &[ClaimRef]) -> ClaimResults<()> {
        let start = std::time::Instant::now();
        let results = self.unprepare_claims(claims).await;
        let errors = results.values().filter(|r| r.is_err()).count();
        self.metrics
            .unprepare
            .record(start.elapsed(), results.len(), errors);
        results
    }

    async fn unprepare_claims(&self, claims: &[ClaimRef]) -> ClaimResults<()> {
        let mut results = BTreeMap::new();
        let mut state = self.lock_for_change().await;
        // Removed from `state` here, from the checkpoint file in one write at the end.
        let mut removed: Vec<(&ClaimRef, PreparedClaim)> = Vec::new();
        for claim in claims {
            let result = self.unprepare_one(&mut state, claim).await;
            match result {
                Err(err) => {
                    tracing::warn!(driver = %self.driver, claim = %claim, error = %err, "cannot unprepare the claim");
                    results.insert(claim.uid.clone(), Err(err));
                }
                Ok(gone) => {
                    removed.extend(gone.map(|g| (claim, g)));
                    results.insert(claim.uid.clone(), Ok(()));
                }
            }
        }
        // Shared devices whose last share went with these claims.
        let mut unshared: Vec<String> = Vec::new();
        for (_, gone) in &removed {
            for released in &gone.devices {
                let still_shared = state.claims.values().any(|other| {
                    other
                        .devices
                        .iter()
                        .any(|d| d.id == released.id && d.hold.share_id().is_some())
                });
                if released.hold.share_id().is_some() && !still_shared {
                    unshared.push(released.id.clone());
                }
            }
        }
        let names: Vec<&ClaimRef> = removed.iter().map(|(claim, _)| *claim).collect();
        let own = group_commit::Undo::Unprepared(
            removed
                .into_iter()
                .map(|(claim, gone)| (claim.uid.clone(), gone))
                .collect(),
        );
        // One durable write for this call and those queued behind it.
        if let Err(err) = self.commit(state, own).await {
            for claim in names {
                tracing::warn!(driver = %self.driver, claim = %claim, error = %err, "cannot unprepare the claim");
                results.insert(claim.uid.clone(), Err(err.clone()));
            }
            return results;
        }
        for claim in names {
            tracing::info!(driver = %self.driver, claim = %claim, "claim unprepared");
        }
        handover::shares_released(&self.backend, unshared).await;
        results
    }

    /// Releases what the backend made for one claim, removes its CDI spec and takes it out of
    /// `state`; what was taken out (`None`: it was not prepared). The caller writes the
    /// checkpoint.
    async fn unprepare_one(
        &self,
        state: &mut Checkpoint,
        claim: &ClaimRef,
    ) -> Result<Option<PreparedClaim>, PrepareError> {
        let Some(prepared) = state.claims.get(&claim.uid) else {
            return Ok(None);
        };
        // What the backend made for the claim goes first: if it cannot, the claim stays
        // prepared and the kubelet's retry tries again.
        handover::release(&self.backend, whole_ids(&prepared.devices)).await?;
        claim_spec::remove(&prepared.cdi_spec)?;
        device_metadata::remove(&self.files.device_metadata_dir(), &claim.uid)?;
        Ok(state.claims.remove(&claim.uid))
    }

    /// Writes `state` to the checkpoint file; the error as each claim of the call is told it.
    /// The write (and its fsync) runs on a blocking thread: a slow disk must not stall the
    /// runtime that serves the kubelet, publishes the slices and watches the API server.
    async fn save(&self, state: &Checkpoint) -> Result<(), PrepareError> {
        let path = self.files.checkpoint.clone();
        let claims = Arc::new(state.claims.clone());
        let state = state.clone();
        let written = tokio::task::spawn_blocking({
            let path = path.clone();
            move || state.save(&path)
        })
        .await
        .unwrap_or_else(|join| Err(std::io::Error::other(join.to_string())));
        written.map_err(|source| PrepareError::WriteCheckpoint {
            path: path.clone(),
            source: Arc::new(source),
        })?;
        self.set_stamp(FileStamp::of(&path));
        self.saved.send_replace(claims);
        self.writes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    fn set_stamp(&self, stamp: Option<FileStamp>) {
        if let Ok(mut kept) = self.stamp.lock() {
            *kept = stamp;
        }
    }

    /// The CDI kind of this driver's claim specs: `<driver>/claim`.
    pub fn cdi_kind(&self) -> String {
        format!("{}/claim", self.driver)
    }

    fn spec_path(&self, uid: &str) -> PathBuf {
        spec_path(&self.files.cdi_dir, &self.driver, uid)
    }
}
