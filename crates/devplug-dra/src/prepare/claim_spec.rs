//! The CDI spec file of a prepared claim: one file per claim, one CDI device per request of
//! the claim (`<driver>/claim=<claim uid>-<request>`), written atomically, written again from
//! the checkpoint when a reboot emptied `/var/run/cdi`, and removed when nothing owns it.

use super::error::PrepareError;
use crate::checkpoint::{Checkpoint, PreparedClaim, PreparedDevice};
use devplug::cdi::{qualified_name, Spec};
use devplug::ContainerEdits;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The claim's spec from each request's edits, in request order; the first device of each
/// request gets that request's CDI id. The kubelet gives a container the CDI ids of the devices
/// of the requests it uses, so each request's edits reach it exactly once. A container using
/// two requests of one claim gets both requests' edits; an environment variable both set ends
/// with the later one.
pub(super) fn build(
    kind: &str,
    uid: &str,
    edits: &[(String, ContainerEdits)],
    devices: &mut [PreparedDevice],
) -> Spec {
    let mut spec = Spec::new(kind.to_owned());
    for (request, edits) in edits {
        let name = cdi_device_name(uid, request);
        spec = spec.device(name.clone(), edits);
        if let Some(first) = devices
            .iter_mut()
            .find(|d| d.request_names.iter().any(|r| r == request))
        {
            first.cdi_device_ids.push(qualified_name(kind, &name));
        }
    }
    spec
}

/// Writes a claim's spec atomically, without an fsync: the checkpoint, which is synced before
/// the kubelet hears the claim is prepared, holds the same text, and [`restore_spec`] writes
/// it again at start where the file is missing or differs (a power loss on a disk-backed CDI
/// folder). One disk flush per prepare instead of two.
pub(super) async fn write(path: PathBuf, json: String) -> Result<(), PrepareError> {
    // On a blocking thread: a slow disk must not stall the runtime.
    let written = tokio::task::spawn_blocking({
        let path = path.clone();
        move || devplug::cdi::write_atomic_unsynced(&path, json.as_bytes())
    })
    .await
    .unwrap_or_else(|join| Err(std::io::Error::other(join.to_string())));
    written
        .map(|_| ())
        .map_err(|source| PrepareError::WriteSpec {
            path,
            source: Arc::new(source),
        })
}

/// Removes a claim's spec; one already gone is fine.
pub(super) fn remove(path: &Path) -> Result<(), PrepareError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(PrepareError::RemoveSpec {
            path: path.to_owned(),
            source: Arc::new(source),
        }),
    }
}

/// Writes a prepared claim's CDI spec again from the checkpoint when its file is gone: the
/// checkpoint is on persistent disk, `/var/run/cdi` usually on a tmpfs that a reboot empties
/// (and a failed unprepare can leave the claim without its file), and a container whose CDI
/// device has no spec cannot start. A file that differs from the checkpoint's text (a write
/// cut short by a power loss: specs are written without an fsync) is written again too.
/// `Ok(false)`: the file is there, as the checkpoint has it.
pub fn restore_spec(driver: &str, uid: &str, claim: &PreparedClaim) -> Result<bool, PrepareError> {
    let name = format!("{}/{}", claim.namespace, claim.name);
    let Some(json) = &claim.cdi_spec_json else {
        if claim.cdi_spec.exists() {
            return Ok(false);
        }
        return Err(PrepareError::SpecLost {
            path: claim.cdi_spec.clone(),
            claim: name,
        });
    };
    if std::fs::read(&claim.cdi_spec).is_ok_and(|on_disk| on_disk == json.as_bytes()) {
        return Ok(false);
    }
    devplug::cdi::write_atomic(&claim.cdi_spec, json.as_bytes()).map_err(|source| {
        PrepareError::RewriteSpec {
            path: claim.cdi_spec.clone(),
            claim: name,
            source: Arc::new(source),
        }
    })?;
    tracing::warn!(%driver, claim = %uid, spec = %claim.cdi_spec.display(), "the CDI spec of a prepared claim was missing or not as the checkpoint has it (a reboot, a power loss, or a failed unprepare); written again from the checkpoint");
    Ok(true)
}

/// [`restore_spec`] for a repeated prepare: only a missing file is written again, found with a
/// stat rather than a read (the text was compared at start).
pub(super) fn restore_missing_spec(
    driver: &str,
    uid: &str,
    claim: &PreparedClaim,
) -> Result<bool, PrepareError> {
    if claim.cdi_spec.exists() {
        return Ok(false);
    }
    restore_spec(driver, uid, claim)
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
    cdi_dir.join(format!(
        "devplug-{}-{}.json",
        path_segment(driver),
        path_segment(uid)
    ))
}

/// `name` as one segment of a file name or path: characters other than ASCII letters,
/// digits, `-`, `_` and `.` as `_` (names the API server checked have none of them).
pub(super) fn path_segment(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
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
