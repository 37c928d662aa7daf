//! `NodePrepareResources` and `NodeUnprepareResources` for one driver, without the gRPC: what
//! the kubelet asks for, claim by claim, with an answer for every claim and never a whole-call
//! failure for one bad claim.
//!
//! Preparing a claim: its allocation from the [`ClaimSource`] (our driver's results only, in our
//! pool), the devices looked up by their slice names in the backend's newest list (a device
//! that left or is unhealthy is that claim's error), the backend's `allocate` once per request
//! of the claim (the same container edits `Allocate` gives a device plugin container; its
//! `pre_start` too when the backend asks for it), one CDI spec file per claim written
//! atomically with one CDI device per request (`<driver>/claim=<claim uid>-<request>`), then
//! the claim in the checkpoint, then the answer. The first device of each request carries that
//! request's CDI id: the kubelet gives a container the CDI ids of the devices of the requests it
//! uses, so each request's edits reach it exactly once. A container using two requests of one
//! claim gets both requests' edits; an environment variable both set ends with the later one.
//!
//! Repeats are answered from the checkpoint; unpreparing a claim we do not know is a success.
//! The claims of a call are read from the API server first, all at once and under one deadline
//! for the call, with nothing locked: a slow or hung API server makes only that call slow, and
//! an unprepare, which needs no API server, never waits for it. The rest (the backend, the CDI
//! spec, the checkpoint) is serialized per driver, as the checkpoint is one file.

use super::checkpoint::{Checkpoint, CheckpointError, PreparedClaim, PreparedDevice};
use super::claims::{AllocatedDevice, ClaimRef, ClaimSource};
use super::names::device_name;
use devplug::{Backend, ContainerEdits};
use devplug_backends::cdi::{qualified_name, Spec};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Mutex;

/// How long the claim reads of one call may take together (the kubelet gives the whole call
/// 45 s; the rest of a prepare is local and quick).
pub const CLAIM_READ_DEADLINE: Duration = Duration::from_secs(30);

/// Per-claim results of a call, by claim UID.
pub type ClaimResults<T> = BTreeMap<String, Result<T, String>>;

/// Where a driver keeps its files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrepareFiles {
    /// Folder of the CDI spec files (`/var/run/cdi`).
    pub cdi_dir: PathBuf,
    /// The checkpoint file.
    pub checkpoint: PathBuf,
}

/// Prepares and unprepares the claims of one driver.
pub struct Preparer {
    driver: String,
    pool: String,
    backend: Arc<dyn Backend>,
    claims: Arc<dyn ClaimSource>,
    files: PrepareFiles,
    state: Mutex<Checkpoint>,
    read_deadline: Duration,
}

impl Preparer {
    /// A preparer of `driver`'s claims for `pool` (the node name), reading the checkpoint.
    pub fn new(
        driver: &str,
        pool: &str,
        backend: Arc<dyn Backend>,
        claims: Arc<dyn ClaimSource>,
        files: PrepareFiles,
    ) -> Result<Preparer, CheckpointError> {
        let checkpoint = Checkpoint::load(&files.checkpoint, driver)?;
        remove_stale_specs(&files.cdi_dir, driver, &checkpoint);
        for (uid, claim) in &checkpoint.claims {
            if let Err(err) = restore_spec(driver, uid, claim) {
                tracing::error!(%driver, claim = %uid, error = %err, "a prepared claim's CDI spec is missing");
            }
        }
        Ok(Preparer {
            driver: driver.to_owned(),
            pool: pool.to_owned(),
            backend,
            claims,
            files,
            state: Mutex::new(checkpoint),
            read_deadline: CLAIM_READ_DEADLINE,
        })
    }

    /// The same preparer with another deadline for the claim reads of one call (default
    /// [`CLAIM_READ_DEADLINE`]).
    pub fn with_read_deadline(mut self, deadline: Duration) -> Preparer {
        self.read_deadline = deadline;
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

    /// The driver's name.
    pub fn driver(&self) -> &str {
        &self.driver
    }

    /// The prepared claims now, by UID.
    pub async fn prepared(&self) -> BTreeMap<String, PreparedClaim> {
        self.state.lock().await.claims.clone()
    }

    /// The backend ids of the devices prepared claims hold shares of.
    pub async fn shared_devices(&self) -> std::collections::BTreeSet<String> {
        self.state
            .lock()
            .await
            .claims
            .values()
            .flat_map(|claim| &claim.devices)
            .filter(|d| d.share_id.is_some())
            .map(|d| d.id.clone())
            .collect()
    }

    /// Prepares every claim; one result per distinct claim UID.
    pub async fn prepare(&self, claims: &[ClaimRef]) -> ClaimResults<Vec<PreparedDevice>> {
        let mut distinct: Vec<&ClaimRef> = Vec::new();
        for claim in claims {
            if !distinct.iter().any(|c| c.uid == claim.uid) {
                distinct.push(claim);
            }
        }
        // The allocations of the claims not prepared yet, read with nothing locked.
        let known: Vec<bool> = {
            let state = self.state.lock().await;
            distinct
                .iter()
                .map(|c| state.claims.contains_key(&c.uid))
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
                let read = tokio::time::timeout_at(deadline, self.claims.allocation(claim)).await;
                Some(read.unwrap_or_else(|_| {
                    Err(format!(
                        "reading ResourceClaim {claim} from the API server took over {:?}",
                        self.read_deadline
                    ))
                }))
            });
        let read = futures_util::future::join_all(reads).await;
        let released = self.released_holders(&read, deadline).await;

        let mut results = BTreeMap::new();
        let mut state = self.state.lock().await;
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
        if new.is_empty() {
            return results;
        }
        if let Err(err) = self.save(&state) {
            for claim in new {
                if let Some(undone) = state.claims.remove(&claim.uid) {
                    let _ = std::fs::remove_file(&undone.cdi_spec);
                    self.release(&whole_ids(&undone.devices));
                }
                tracing::warn!(driver = %self.driver, claim = %claim, error = %err, "cannot prepare the claim");
                results.insert(claim.uid.clone(), Err(err.clone()));
            }
            return results;
        }
        for claim in new {
            let devices = state.claims.get(&claim.uid).map_or(0, |c| c.devices.len());
            tracing::info!(driver = %self.driver, claim = %claim, devices, "claim prepared");
        }
        results
    }

    /// The prepared claims that hold a device the read allocations want, and that the API
    /// server no longer has (deleted, or deallocated): the kubelet has yet to unprepare them
    /// (a force-deleted pod, a kubelet restart; its reconcile runs every minute), and the
    /// scheduler has given their devices away. Read with nothing locked, by `deadline`; a
    /// holder that cannot be read counts as still holding.
    async fn released_holders(
        &self,
        read: &[Option<Result<Vec<AllocatedDevice>, String>>],
        deadline: tokio::time::Instant,
    ) -> HashSet<String> {
        let wanted: Vec<&AllocatedDevice> = read
            .iter()
            .flatten()
            .flatten()
            .flatten()
            .filter(|d| is_exclusive(d.share_id.as_ref(), d.admin_access))
            .collect();
        if wanted.is_empty() {
            return HashSet::new();
        }
        let holders: Vec<ClaimRef> = self
            .state
            .lock()
            .await
            .claims
            .iter()
            .filter(|(_, prepared)| {
                prepared.devices.iter().any(|held| {
                    is_exclusive(held.share_id.as_ref(), held.admin_access)
                        && wanted
                            .iter()
                            .any(|w| w.pool == held.pool && w.device == held.device)
                })
            })
            .map(|(uid, prepared)| ClaimRef {
                namespace: prepared.namespace.clone(),
                name: prepared.name.clone(),
                uid: uid.clone(),
            })
            .collect();
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
        allocation: Option<Result<Vec<AllocatedDevice>, String>>,
        released: &HashSet<String>,
    ) -> Result<Vec<PreparedDevice>, String> {
        if let Some(done) = state.claims.get(&claim.uid) {
            restore_spec(&self.driver, &claim.uid, done)?;
            return Ok(done.devices.clone());
        }
        let allocated = match allocation {
            Some(read) => read?,
            // Unprepared by a call that ran while this one read: read it now.
            None => tokio::time::timeout(self.read_deadline, self.claims.allocation(claim))
                .await
                .map_err(|_| {
                    format!(
                        "reading ResourceClaim {claim} from the API server took over {:?}",
                        self.read_deadline
                    )
                })??,
        };
        refuse_taken_devices(&self.driver, claim, state, &allocated, released)?;
        let (spec, devices) = self.plan(claim, &allocated)?;
        let undo = |err: String| {
            self.release(&whole_ids(&devices));
            err
        };
        if self.backend.options().pre_start_required {
            let ids: Vec<String> = devices.iter().map(|d| d.id.clone()).collect();
            self.backend
                .pre_start(&ids)
                .await
                .map_err(|e| undo(format!("preparing the devices failed: {}", e.0)))?;
        }
        let spec_path = self.spec_path(&claim.uid);
        let spec_json = spec.to_json();
        devplug_backends::cdi::write_atomic(&spec_path, spec_json.as_bytes()).map_err(|e| {
            undo(format!(
                "cannot write the CDI spec {}: {e}",
                spec_path.display()
            ))
        })?;
        state.claims.insert(
            claim.uid.clone(),
            PreparedClaim {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
                devices: devices.clone(),
                cdi_spec: spec_path.clone(),
                cdi_spec_json: Some(spec_json),
            },
        );
        Ok(devices)
    }

    /// The CDI spec and the answer for a claim's allocation, from the backend's newest list.
    fn plan(
        &self,
        claim: &ClaimRef,
        allocated: &[AllocatedDevice],
    ) -> Result<(Spec, Vec<PreparedDevice>), String> {
        let list = self.backend.devices().borrow().clone();
        let by_name: HashMap<String, &devplug::Device> = list
            .devices()
            .iter()
            .map(|d| (device_name(&d.id), d))
            .collect();
        // Requests in allocation order, each with its whole devices' ids and its shares.
        let mut requests: Vec<Request<'_>> = Vec::new();
        let mut devices: Vec<PreparedDevice> = Vec::new();
        for result in allocated {
            if result.pool != self.pool {
                return Err(format!(
                    "device {} is in pool {:?}, not this node's pool {:?}",
                    result.device, result.pool, self.pool
                ));
            }
            let device = by_name.get(&result.device).ok_or_else(|| {
                format!(
                    "device {} is not one of driver {}'s devices on this node (any more)",
                    result.device, self.driver
                )
            })?;
            if let devplug::Health::Unhealthy { reason } = &device.health {
                if !result.tolerates_unhealthy {
                    return Err(format!("device {} is unhealthy: {reason}", result.device));
                }
                tracing::warn!(driver = %self.driver, claim = %claim, device = %result.device,
                    %reason, "preparing an unhealthy device: the claim tolerates its taint");
            }
            let index = match requests.iter().position(|r| r.name == result.request) {
                Some(index) => index,
                None => {
                    requests.push(Request {
                        name: &result.request,
                        whole: Vec::new(),
                        shares: Vec::new(),
                    });
                    requests.len().saturating_sub(1)
                }
            };
            if let Some(request) = requests.get_mut(index) {
                if result.share_id.is_some() {
                    request.shares.push((device.id.clone(), &result.consumed));
                } else if !request.whole.contains(&device.id) {
                    request.whole.push(device.id.clone());
                }
            }
            match devices.iter_mut().find(|d| d.device == result.device) {
                Some(known) => known.request_names.push(result.request.clone()),
                None => devices.push(PreparedDevice {
                    request_names: vec![result.request.clone()],
                    pool: result.pool.clone(),
                    device: result.device.clone(),
                    id: device.id.clone(),
                    cdi_device_ids: Vec::new(),
                    share_id: result.share_id.clone(),
                    admin_access: result.admin_access,
                }),
            }
        }
        let kind = self.cdi_kind();
        let mut spec = Spec::new(kind.clone());
        // Whole devices allocated so far: released again if a later request fails.
        let mut given: Vec<String> = Vec::new();
        for request in &requests {
            let mut edits = ContainerEdits::default();
            if !request.whole.is_empty() {
                let ids = &request.whole;
                edits = self.backend.allocate(ids).map_err(|e| {
                    self.release(&given);
                    format!("the backend refused devices {ids:?}: {e}")
                })?;
                given.extend(ids.iter().cloned());
            }
            for (id, consumed) in &request.shares {
                let share = self.backend.allocate_share(id, consumed).map_err(|e| {
                    self.release(&given);
                    format!("the backend refused a share of device {id}: {e}")
                })?;
                edits = edits.merge(share);
            }
            let name = cdi_device_name(&claim.uid, request.name);
            spec = spec.device(name.clone(), &edits);
            if let Some(first) = devices
                .iter_mut()
                .find(|d| d.request_names.iter().any(|r| r == request.name))
            {
                first.cdi_device_ids.push(qualified_name(&kind, &name));
            }
        }
        Ok((spec, devices))
    }

    /// Unprepares every claim; one result per distinct claim UID.
    pub async fn unprepare(&self, claims: &[ClaimRef]) -> ClaimResults<()> {
        let mut results = BTreeMap::new();
        let mut state = self.state.lock().await;
        // Removed from `state` here, from the checkpoint file in one write at the end.
        let mut removed: Vec<(&ClaimRef, PreparedClaim)> = Vec::new();
        for claim in claims {
            let result = self.unprepare_one(&mut state, claim);
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
        if removed.is_empty() {
            return results;
        }
        if let Err(err) = self.save(&state) {
            for (claim, gone) in removed {
                state.claims.insert(claim.uid.clone(), gone);
                tracing::warn!(driver = %self.driver, claim = %claim, error = %err, "cannot unprepare the claim");
                results.insert(claim.uid.clone(), Err(err.clone()));
            }
            return results;
        }
        for (claim, gone) in &removed {
            for released in &gone.devices {
                let still_shared = state.claims.values().any(|other| {
                    other
                        .devices
                        .iter()
                        .any(|d| d.id == released.id && d.share_id.is_some())
                });
                if released.share_id.is_some() && !still_shared {
                    self.backend.release_shares(&released.id);
                }
            }
            tracing::info!(driver = %self.driver, claim = %claim, "claim unprepared");
        }
        results
    }

    /// Removes one claim's CDI spec and takes it out of `state`; what was taken out (`None`:
    /// it was not prepared). The caller writes the checkpoint.
    fn unprepare_one(
        &self,
        state: &mut Checkpoint,
        claim: &ClaimRef,
    ) -> Result<Option<PreparedClaim>, String> {
        let Some(prepared) = state.claims.get(&claim.uid) else {
            return Ok(None);
        };
        // What the backend made for the claim goes first: if it cannot, the claim stays
        // prepared and the kubelet's retry tries again.
        let whole = whole_ids(&prepared.devices);
        if !whole.is_empty() {
            self.backend
                .release(&whole)
                .map_err(|e| format!("the backend cannot release devices {whole:?}: {e}"))?;
        }
        match std::fs::remove_file(&prepared.cdi_spec) {
            Ok(()) => {}
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
            Err(err) => {
                return Err(format!(
                    "cannot remove the CDI spec {}: {err}",
                    prepared.cdi_spec.display()
                ))
            }
        }
        Ok(state.claims.remove(&claim.uid))
    }

    /// Releases whole devices allocated for a claim whose prepare failed after all; a release
    /// that fails is logged (the backend finds what it made again when asked once more).
    fn release(&self, ids: &[String]) {
        if ids.is_empty() {
            return;
        }
        if let Err(err) = self.backend.release(ids) {
            tracing::warn!(driver = %self.driver, devices = ?ids, %err, "cannot release the devices of a claim whose prepare failed");
        }
    }

    /// Writes `state` to the checkpoint file; the error as each claim of the call is told it.
    fn save(&self, state: &Checkpoint) -> Result<(), String> {
        state.save(&self.files.checkpoint).map_err(|err| {
            format!(
                "cannot write the checkpoint {}: {err}",
                self.files.checkpoint.display()
            )
        })
    }

    /// The CDI kind of this driver's claim specs: `<driver>/claim`.
    pub fn cdi_kind(&self) -> String {
        format!("{}/claim", self.driver)
    }

    fn spec_path(&self, uid: &str) -> PathBuf {
        spec_path(&self.files.cdi_dir, &self.driver, uid)
    }
}

/// One request of a claim as prepared: the ids of the whole devices it got, and its shares of
/// shared devices with what each consumed.
struct Request<'a> {
    name: &'a str,
    whole: Vec<String>,
    shares: Vec<(String, &'a BTreeMap<String, u64>)>,
}

/// The ids of the devices a claim was given whole by the backend's `allocate`, which it
/// releases when the claim is done: not shares, not admin access (which only looks at a device
/// another claim has).
fn whole_ids(devices: &[PreparedDevice]) -> Vec<String> {
    let mut ids: Vec<String> = Vec::new();
    for device in devices {
        if is_exclusive(device.share_id.as_ref(), device.admin_access) && !ids.contains(&device.id)
        {
            ids.push(device.id.clone());
        }
    }
    ids
}

/// Whether a device given this way goes to one claim at a time: not a share of a device with
/// consumable capacity, not admin access.
fn is_exclusive(share_id: Option<&String>, admin_access: bool) -> bool {
    share_id.is_none() && !admin_access
}

/// Refuses an allocation that gives a claim a device another prepared claim has, unless one of
/// the two has it as a share (consumable capacity) or with admin access: a device that is not
/// shareable goes to one claim at a time, and two live claims holding it means the scheduler
/// worked from a stale view (another driver publishing our devices, an allocation made by
/// hand). The first claim keeps it; the second gets this error. A holder the API server no
/// longer has (`released`) is not in the way: the scheduler gave its device away when it went,
/// and the kubelet has yet to unprepare it; that is logged.
fn refuse_taken_devices(
    driver: &str,
    claim: &ClaimRef,
    state: &Checkpoint,
    allocated: &[AllocatedDevice],
    released: &HashSet<String>,
) -> Result<(), String> {
    for wanted in allocated
        .iter()
        .filter(|d| is_exclusive(d.share_id.as_ref(), d.admin_access))
    {
        let holders = state.claims.iter().filter(|(_, prepared)| {
            prepared.devices.iter().any(|held| {
                held.pool == wanted.pool
                    && held.device == wanted.device
                    && is_exclusive(held.share_id.as_ref(), held.admin_access)
            })
        });
        for (uid, holder) in holders {
            if released.contains(uid) {
                tracing::warn!(%driver, %claim, device = %wanted.device, holder = %format!("{}/{}", holder.namespace, holder.name), "the device is still prepared for a claim the API server no longer has (the kubelet unprepares it within a minute); preparing the new claim");
                continue;
            }
            return Err(format!(
                "device {} is already prepared for ResourceClaim {}/{} and cannot be shared: \
                 the scheduler allocated it to two claims (another driver publishing this \
                 node's devices, or an allocation made by hand); this claim waits until the \
                 other is unprepared",
                wanted.device, holder.namespace, holder.name
            ));
        }
    }
    Ok(())
}

/// Writes a prepared claim's CDI spec again from the checkpoint when its file is gone: the
/// checkpoint is on persistent disk, `/var/run/cdi` usually on a tmpfs that a reboot empties
/// (and a failed unprepare can leave the claim without its file), and a container whose CDI
/// device has no spec cannot start. `Ok(false)`: the file is there.
pub fn restore_spec(driver: &str, uid: &str, claim: &PreparedClaim) -> Result<bool, String> {
    if claim.cdi_spec.exists() {
        return Ok(false);
    }
    let Some(json) = &claim.cdi_spec_json else {
        return Err(format!(
            "the CDI spec {} of prepared claim {}/{} is missing, and this checkpoint (from an older \
             devplug) does not hold its content: delete the claim's pods so the kubelet \
             unprepares and prepares it again",
            claim.cdi_spec.display(),
            claim.namespace,
            claim.name
        ));
    };
    devplug_backends::cdi::write_atomic(&claim.cdi_spec, json.as_bytes()).map_err(|e| {
        format!(
            "the CDI spec {} of prepared claim {}/{} is missing and cannot be written again: {e}",
            claim.cdi_spec.display(),
            claim.namespace,
            claim.name
        )
    })?;
    tracing::warn!(%driver, claim = %uid, spec = %claim.cdi_spec.display(), "the CDI spec of a prepared claim was missing (a reboot, or a failed unprepare); written again from the checkpoint");
    Ok(true)
}

/// Removes this driver's claim specs that no claim of the checkpoint owns: left by a claim
/// unprepared while devplug was not running to see it (an uninstall, a checkpoint removed by
/// hand). Only files devplug writes are touched: named `devplug-<driver>-*.json`, with the
/// driver's claim kind inside. Returns how many went.
pub fn remove_stale_specs(cdi_dir: &Path, driver: &str, checkpoint: &Checkpoint) -> usize {
    let Ok(entries) = std::fs::read_dir(cdi_dir) else {
        return 0;
    };
    let kind = format!("{driver}/claim");
    let prefix = spec_path(cdi_dir, driver, "")
        .file_name()
        .and_then(|n| n.to_str())
        .map(|n| n.trim_end_matches(".json").to_owned())
        .unwrap_or_default();
    let owned: std::collections::HashSet<PathBuf> = checkpoint
        .claims
        .iter()
        .flat_map(|(uid, c)| [c.cdi_spec.clone(), spec_path(cdi_dir, driver, uid)])
        .collect();
    let mut removed = 0;
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with(&prefix) || !name.ends_with(".json") || owned.contains(&path) {
            continue;
        }
        let ours = std::fs::read_to_string(&path)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .is_some_and(|spec| spec["kind"] == kind.as_str());
        if !ours {
            continue;
        }
        match std::fs::remove_file(&path) {
            Ok(()) => {
                removed += 1;
                tracing::info!(%driver, spec = %path.display(), "removed the CDI spec of a claim no longer prepared");
            }
            Err(err) => {
                tracing::warn!(%driver, spec = %path.display(), %err, "cannot remove a stale CDI spec")
            }
        }
    }
    removed
}

/// The CDI spec file of a claim: `<cdi_dir>/devplug-<driver>-<uid>.json`.
pub fn spec_path(cdi_dir: &Path, driver: &str, uid: &str) -> PathBuf {
    let clean = |s: &str| -> String {
        s.chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                    c
                } else {
                    '_'
                }
            })
            .collect()
    };
    cdi_dir.join(format!("devplug-{}-{}.json", clean(driver), clean(uid)))
}

/// The CDI device name of one request of a claim: `<uid>-<request>`, with characters CDI does
/// not take (the `/` of a sub-request) as `_`.
fn cdi_device_name(uid: &str, request: &str) -> String {
    format!("{uid}-{request}")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "_-.:".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use devplug::backend::BoxFuture;
    use devplug::{AllocateError, ContainerEdits, Device, DeviceList, Health};
    use tokio::sync::watch;

    struct Npus(watch::Sender<DeviceList>);

    impl Backend for Npus {
        fn devices(&self) -> watch::Receiver<DeviceList> {
            self.0.subscribe()
        }
        fn allocate(&self, ids: &[String]) -> Result<ContainerEdits, AllocateError> {
            Ok(ContainerEdits::default().env("NPU_VISIBLE_DEVICES", ids.join(",")))
        }
        fn allocate_share(
            &self,
            id: &str,
            consumed: &BTreeMap<String, u64>,
        ) -> Result<ContainerEdits, AllocateError> {
            let cores = consumed.get("cores").copied().unwrap_or(0);
            Ok(ContainerEdits::default()
                .env("NPU_VISIBLE_DEVICES", id)
                .env("NPU_CORES", cores.to_string()))
        }
        fn release_shares(&self, id: &str) {
            self.0.send_modify(|list| {
                list.set_health(id, Health::unhealthy("released (test marker)"));
            });
        }
    }

    struct Fixed(HashMap<String, Vec<AllocatedDevice>>);

    impl ClaimSource for Fixed {
        fn allocation<'a>(
            &'a self,
            claim: &'a ClaimRef,
        ) -> BoxFuture<'a, Result<Vec<AllocatedDevice>, String>> {
            let found = self.0.get(&claim.uid).cloned();
            Box::pin(async move { found.ok_or_else(|| "no such claim".to_owned()) })
        }
    }

    #[tokio::test]
    async fn a_checkpoint_that_cannot_be_written_undoes_the_whole_call() {
        let dir = tempfile::tempdir().unwrap();
        let files = PrepareFiles {
            cdi_dir: dir.path().join("cdi"),
            checkpoint: dir.path().join("driver/checkpoint.json"),
        };
        let list = DeviceList::new((0..3).map(|i| Device::new(format!("npu-{i}"))));
        let (tx, _) = watch::channel(list);
        let claims = Fixed(HashMap::from([
            ("a".to_owned(), vec![allocated("x", "npu-0")]),
            ("b".to_owned(), vec![allocated("x", "npu-1")]),
            ("c".to_owned(), vec![allocated("x", "npu-2")]),
        ]));
        let preparer = Preparer::new(
            "npu.example.com",
            "node-a",
            Arc::new(Npus(tx)),
            Arc::new(claims),
            files.clone(),
        )
        .unwrap();
        assert!(preparer.prepare(&[claim("a")]).await["a"].is_ok());
        // The checkpoint's folder turns into a file: no write can succeed.
        let folder = dir.path().join("driver");
        std::fs::rename(&folder, dir.path().join("driver-moved")).unwrap();
        std::fs::write(&folder, "not a folder").unwrap();
        let both = preparer
            .prepare(&[claim("b"), claim("c"), claim("a")])
            .await;
        for uid in ["b", "c"] {
            let err = both[uid].as_ref().unwrap_err();
            assert!(err.contains("cannot write the checkpoint"), "{err}");
            assert!(!spec_path(&files.cdi_dir, "npu.example.com", uid).exists());
        }
        assert!(both["a"].is_ok(), "prepared before: answered from memory");
        assert_eq!(preparer.prepared().await.len(), 1);
        let gone = preparer.unprepare(&[claim("a")]).await;
        assert!(gone["a"]
            .as_ref()
            .unwrap_err()
            .contains("cannot write the checkpoint"));
        assert_eq!(preparer.prepared().await.len(), 1, "still prepared");
        std::fs::remove_file(&folder).unwrap();
        std::fs::rename(dir.path().join("driver-moved"), &folder).unwrap();
        assert!(preparer
            .prepare(&[claim("b"), claim("c")])
            .await
            .values()
            .all(Result::is_ok));
        assert!(preparer
            .unprepare(&[claim("a"), claim("b"), claim("c")])
            .await
            .values()
            .all(Result::is_ok));
        assert!(preparer.prepared().await.is_empty());
    }

    #[tokio::test]
    async fn an_unhealthy_device_is_prepared_only_for_a_claim_that_tolerates_its_taint() {
        let dir = tempfile::tempdir().unwrap();
        let sick = Device::new("npu-0").with_health(Health::unhealthy("ECC"));
        let (tx, _) = watch::channel(DeviceList::new([sick]));
        let claims = Fixed(HashMap::from([
            ("plain".to_owned(), vec![allocated("a", "npu-0")]),
            (
                "tolerant".to_owned(),
                vec![AllocatedDevice {
                    tolerates_unhealthy: true,
                    ..allocated("a", "npu-0")
                }],
            ),
        ]));
        let preparer = Preparer::new(
            "npu.example.com",
            "node-a",
            Arc::new(Npus(tx)),
            Arc::new(claims),
            files_in(dir.path()),
        )
        .unwrap();
        let plain = preparer.prepare(&[claim("plain")]).await;
        let err = plain["plain"].as_ref().unwrap_err();
        assert!(err.contains("npu-0 is unhealthy: ECC"), "{err}");
        let tolerant = preparer.prepare(&[claim("tolerant")]).await;
        assert!(tolerant["tolerant"].is_ok(), "{tolerant:?}");
    }

    #[tokio::test]
    async fn a_device_that_is_not_shareable_is_prepared_for_one_claim_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let (tx, _) = watch::channel(DeviceList::new([Device::new("npu-0")]));
        let shared = |share: &str| AllocatedDevice {
            share_id: Some(share.into()),
            consumed: BTreeMap::from([("cores".to_owned(), 40)]),
            ..allocated("a", "npu-0")
        };
        let admin = AllocatedDevice {
            admin_access: true,
            ..allocated("a", "npu-0")
        };
        let claims = Fixed(HashMap::from([
            ("first".to_owned(), vec![allocated("a", "npu-0")]),
            ("second".to_owned(), vec![allocated("a", "npu-0")]),
            ("monitor".to_owned(), vec![admin]),
            ("share-1".to_owned(), vec![shared("s1")]),
            ("share-2".to_owned(), vec![shared("s2")]),
        ]));
        let files = files_in(dir.path());
        let preparer = Preparer::new(
            "npu.example.com",
            "node-a",
            Arc::new(Npus(tx.clone())),
            Arc::new(claims),
            files.clone(),
        )
        .unwrap();
        assert!(preparer.prepare(&[claim("first")]).await["first"].is_ok());
        let second = preparer.prepare(&[claim("second")]).await;
        let err = second["second"].as_ref().unwrap_err();
        assert!(
            err.contains("already prepared for ResourceClaim ns/claim-first"),
            "{err}"
        );
        // Admin access may look at a device in use; shares of one device go together.
        assert!(preparer.prepare(&[claim("monitor")]).await["monitor"].is_ok());
        assert!(preparer.unprepare(&[claim("first")]).await["first"].is_ok());
        let shares = preparer
            .prepare(&[claim("share-1"), claim("share-2")])
            .await;
        assert!(shares.values().all(Result::is_ok), "{shares:?}");
        let spec = std::fs::read_to_string(preparer.spec_path("share-1")).unwrap();
        assert!(spec.contains("NPU_CORES=40"), "the share's limit: {spec}");
        // A restart finds which devices have shares, for the backend to serve them again.
        let again = Preparer::new(
            "npu.example.com",
            "node-a",
            Arc::new(Npus(tx.clone())),
            Arc::new(Fixed(HashMap::new())),
            files.clone(),
        )
        .unwrap();
        assert_eq!(
            again.shared_devices().await,
            std::collections::BTreeSet::from(["npu-0".to_owned()])
        );
        // The backend hears of it when the last share of a device goes, not before.
        preparer.unprepare(&[claim("share-1")]).await;
        assert!(tx.borrow().get("npu-0").unwrap().health.is_healthy());
        preparer.unprepare(&[claim("share-2")]).await;
        assert!(!tx.borrow().get("npu-0").unwrap().health.is_healthy());
        tx.send_modify(|list| {
            list.set_health("npu-0", Health::Healthy);
        });
        // Once the shares are gone, the whole device can go to the second claim.
        assert!(preparer.prepare(&[claim("second")]).await["second"].is_ok());

        // The holder is gone from the API server (its pod force-deleted, the kubelet yet to
        // unprepare it): the scheduler gave its device away, and the new claim is prepared.
        drop(preparer);
        let later = Preparer::new(
            "npu.example.com",
            "node-a",
            Arc::new(Npus(tx)),
            Arc::new(Fixed(HashMap::from([(
                "third".to_owned(),
                vec![allocated("a", "npu-0")],
            )]))),
            files,
        )
        .unwrap();
        let third = later.prepare(&[claim("third")]).await;
        assert!(third["third"].is_ok(), "{third:?}");
    }

    /// An API server that never answers for claims whose UID starts with `hung`.
    struct HungFor(Fixed);

    impl ClaimSource for HungFor {
        fn allocation<'a>(
            &'a self,
            claim: &'a ClaimRef,
        ) -> BoxFuture<'a, Result<Vec<AllocatedDevice>, String>> {
            if claim.uid.starts_with("hung") {
                Box::pin(std::future::pending())
            } else {
                self.0.allocation(claim)
            }
        }
    }

    #[tokio::test]
    async fn a_hung_api_server_slows_only_its_own_call_and_never_an_unprepare() {
        let dir = tempfile::tempdir().unwrap();
        let (tx, _) = watch::channel(DeviceList::new([
            Device::new("npu-0"),
            Device::new("npu-1"),
        ]));
        let claims = HungFor(Fixed(HashMap::from([
            ("u1".to_owned(), vec![allocated("a", "npu-0")]),
            ("u2".to_owned(), vec![allocated("a", "npu-1")]),
        ])));
        let files = files_in(dir.path());
        let deadline = Duration::from_millis(400);
        let preparer = Arc::new(
            Preparer::new(
                "npu.example.com",
                "node-a",
                Arc::new(Npus(tx)),
                Arc::new(claims),
                files,
            )
            .unwrap()
            .with_read_deadline(deadline),
        );
        assert!(preparer.prepare(&[claim("u1")]).await["u1"].is_ok());

        // Two hung claims and a good one in one call: one deadline for all, not one each, and
        // the good claim is prepared.
        let started = std::time::Instant::now();
        let results = preparer
            .prepare(&[claim("hung-1"), claim("hung-2"), claim("u2")])
            .await;
        let took = started.elapsed();
        assert!(took < deadline * 2, "{took:?}");
        for hung in ["hung-1", "hung-2"] {
            let err = results[hung].as_ref().unwrap_err();
            assert!(err.contains("took over 400ms"), "{err}");
        }
        assert!(results["u2"].is_ok(), "{results:?}");

        // While a call waits on the API server, an unprepare (which needs none) and a repeated
        // prepare (answered from the checkpoint) go through at once.
        let waiting = {
            let preparer = preparer.clone();
            tokio::spawn(async move { preparer.prepare(&[claim("hung-3")]).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        let started = std::time::Instant::now();
        assert!(preparer.prepare(&[claim("u1")]).await["u1"].is_ok());
        assert!(preparer.unprepare(&[claim("u1")]).await["u1"].is_ok());
        let took = started.elapsed();
        assert!(took < Duration::from_millis(200), "{took:?}");
        assert!(!waiting.is_finished(), "the hung call still waits");
        assert!(waiting.await.unwrap()["hung-3"].is_err());
    }

    /// A backend that makes something per allocation (as MIG partitions are made) and says
    /// what it was asked to release; it refuses `npu-1`, and releases only when let.
    struct Made {
        list: watch::Sender<DeviceList>,
        released: std::sync::Mutex<Vec<String>>,
        refuse_release: std::sync::atomic::AtomicBool,
    }

    impl Backend for Made {
        fn devices(&self) -> watch::Receiver<DeviceList> {
            self.list.subscribe()
        }
        fn allocate(&self, ids: &[String]) -> Result<ContainerEdits, AllocateError> {
            if ids.iter().any(|id| id == "npu-1") {
                return Err(AllocateError::Failed("npu-1 cannot be made".into()));
            }
            Ok(ContainerEdits::default().env("NPU_VISIBLE_DEVICES", ids.join(",")))
        }
        fn release(&self, ids: &[String]) -> Result<(), devplug::ReleaseError> {
            if self
                .refuse_release
                .load(std::sync::atomic::Ordering::SeqCst)
            {
                return Err(devplug::ReleaseError("the device is busy".into()));
            }
            self.released.lock().unwrap().extend(ids.iter().cloned());
            Ok(())
        }
    }

    #[tokio::test]
    async fn what_allocation_made_is_released_at_unprepare_and_when_prepare_fails() {
        let dir = tempfile::tempdir().unwrap();
        let list = DeviceList::new((0..3).map(|i| Device::new(format!("npu-{i}"))));
        let backend = Arc::new(Made {
            list: watch::channel(list).0,
            released: std::sync::Mutex::new(Vec::new()),
            refuse_release: std::sync::atomic::AtomicBool::new(false),
        });
        let claims = Fixed(HashMap::from([
            (
                "a".to_owned(),
                vec![allocated("first", "npu-0"), allocated("second", "npu-1")],
            ),
            ("b".to_owned(), vec![allocated("x", "npu-2")]),
        ]));
        let preparer = Preparer::new(
            "npu.example.com",
            "node-a",
            backend.clone(),
            Arc::new(claims),
            files_in(dir.path()),
        )
        .unwrap();
        // The second request fails: what the first one got is released again.
        let err = preparer.prepare(&[claim("a")]).await["a"]
            .clone()
            .unwrap_err();
        assert!(err.contains("npu-1 cannot be made"), "{err}");
        assert_eq!(*backend.released.lock().unwrap(), ["npu-0"]);
        backend.released.lock().unwrap().clear();
        assert!(preparer.prepare(&[claim("b")]).await["b"].is_ok());
        // A release that fails keeps the claim prepared, for the kubelet to retry.
        backend
            .refuse_release
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let err = preparer.unprepare(&[claim("b")]).await["b"]
            .clone()
            .unwrap_err();
        assert!(err.contains("the device is busy"), "{err}");
        assert_eq!(preparer.prepared().await.len(), 1);
        backend
            .refuse_release
            .store(false, std::sync::atomic::Ordering::SeqCst);
        assert!(preparer.unprepare(&[claim("b")]).await["b"].is_ok());
        assert!(preparer.prepared().await.is_empty());
        assert_eq!(*backend.released.lock().unwrap(), ["npu-2"]);
    }

    fn allocated(request: &str, device: &str) -> AllocatedDevice {
        AllocatedDevice {
            request: request.into(),
            pool: "node-a".into(),
            device: device.into(),
            share_id: None,
            consumed: BTreeMap::new(),
            tolerates_unhealthy: false,
            admin_access: false,
        }
    }

    fn files_in(dir: &Path) -> PrepareFiles {
        PrepareFiles {
            cdi_dir: dir.join("cdi"),
            checkpoint: dir.join("checkpoint.json"),
        }
    }

    fn claim(uid: &str) -> ClaimRef {
        ClaimRef {
            namespace: "ns".into(),
            name: format!("claim-{uid}"),
            uid: uid.into(),
        }
    }

    #[tokio::test]
    async fn prepare_writes_a_spec_per_claim_and_survives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let list = DeviceList::new([
            Device::new("npu-0"),
            Device::new("NPU-1"),
            Device::new("npu-2").with_health(Health::unhealthy("hot")),
        ]);
        let (tx, _) = watch::channel(list);
        let backend: Arc<dyn Backend> = Arc::new(Npus(tx));
        let claims: Arc<dyn ClaimSource> = Arc::new(Fixed(HashMap::from([
            (
                "u1".to_owned(),
                vec![
                    allocated("a", "npu-0"),
                    allocated("a", &device_name("NPU-1")),
                ],
            ),
            ("u2".to_owned(), vec![allocated("a", "npu-2")]),
            ("u3".to_owned(), vec![allocated("a", "npu-9")]),
        ])));
        let files = files_in(dir.path());
        let preparer = Preparer::new(
            "npu.example.com",
            "node-a",
            backend.clone(),
            claims.clone(),
            files.clone(),
        )
        .unwrap();
        let results = preparer
            .prepare(&[claim("u1"), claim("u2"), claim("u3"), claim("u4")])
            .await;
        let devices = results["u1"].as_ref().unwrap();
        assert_eq!(devices.len(), 2);
        assert_eq!(
            devices[0].cdi_device_ids,
            vec!["npu.example.com/claim=u1-a".to_owned()]
        );
        assert!(
            devices[1].cdi_device_ids.is_empty(),
            "one CDI id per request"
        );
        assert_eq!(devices[1].id, "NPU-1");
        assert!(results["u2"]
            .as_ref()
            .unwrap_err()
            .contains("unhealthy: hot"));
        assert!(results["u3"]
            .as_ref()
            .unwrap_err()
            .contains("npu-9 is not one"));
        assert!(results["u4"]
            .as_ref()
            .unwrap_err()
            .contains("no such claim"));
        let spec_file = spec_path(&files.cdi_dir, "npu.example.com", "u1");
        let spec = std::fs::read_to_string(&spec_file).unwrap();
        assert!(spec.contains("NPU_VISIBLE_DEVICES=npu-0,NPU-1"), "{spec}");

        // A new process answers the repeat from the checkpoint, and can unprepare.
        drop(preparer);
        let again = Preparer::new("npu.example.com", "node-a", backend, claims, files).unwrap();
        let results = again.prepare(&[claim("u1")]).await;
        assert_eq!(results["u1"].as_ref().unwrap(), devices);
        let results = again.unprepare(&[claim("u1"), claim("u9")]).await;
        assert!(results.values().all(Result::is_ok));
        assert!(!spec_file.exists());
        assert!(again.prepared().await.is_empty());
    }

    #[test]
    fn stale_claim_specs_go_at_start_and_nothing_else_does() {
        let dir = tempfile::tempdir().unwrap();
        let cdi = dir.path().join("cdi");
        std::fs::create_dir_all(&cdi).unwrap();
        let driver = "npu.example.com";
        let spec = |kind: &str| format!(r#"{{"cdiVersion":"0.5.0","kind":"{kind}","devices":[]}}"#);
        let kept = spec_path(&cdi, driver, "prepared");
        let stale = spec_path(&cdi, driver, "gone");
        let other_kind = spec_path(&cdi, driver, "other-kind");
        let other_driver = spec_path(&cdi, "npu.example.com-x", "u");
        let not_ours = cdi.join("nvidia.com_gpu.json");
        std::fs::write(&kept, spec("npu.example.com/claim")).unwrap();
        std::fs::write(&stale, spec("npu.example.com/claim")).unwrap();
        std::fs::write(&other_kind, spec("example.com/else")).unwrap();
        std::fs::write(&other_driver, spec("npu.example.com-x/claim")).unwrap();
        std::fs::write(&not_ours, spec("npu.example.com/claim")).unwrap();
        let mut checkpoint = Checkpoint::new(driver);
        checkpoint.claims.insert(
            "prepared".into(),
            PreparedClaim {
                namespace: "ns".into(),
                name: "c".into(),
                devices: Vec::new(),
                cdi_spec: kept.clone(),
                cdi_spec_json: None,
            },
        );
        assert_eq!(remove_stale_specs(&cdi, driver, &checkpoint), 1);
        assert!(!stale.exists());
        for left in [&kept, &other_kind, &other_driver, &not_ours] {
            assert!(left.exists(), "{}", left.display());
        }
        assert_eq!(
            remove_stale_specs(&dir.path().join("none"), driver, &checkpoint),
            0
        );
    }
}
