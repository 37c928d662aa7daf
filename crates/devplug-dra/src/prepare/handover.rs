//! The backend's part of preparing and unpreparing, run on tokio's blocking pool.
//!
//! A backend's claim calls are synchronous and may take long: creating a MIG partition through
//! NVML, starting an MPS daemon. The runtime that serves the kubelet's sockets is one thread
//! (`devplug run` serves every resource from a current-thread runtime), so a call made on it
//! would stall every device plugin's `Allocate` and `ListAndWatch` for as long. Each call here
//! moves to the blocking pool and is awaited, so the driver's own lock still orders its claims
//! while everything else goes on.

use super::error::PrepareError;
use super::plan::RequestDevices;
use devplug::dra::ClaimBackend;
use devplug::ContainerEdits;
use std::sync::Arc;

/// The backend's edits for each request, in order (the request's name with its edits). If a
/// request is refused, the devices given to the requests before it are released again.
pub(super) async fn hand_over(
    driver: &str,
    backend: &Arc<dyn ClaimBackend>,
    requests: Vec<RequestDevices>,
) -> Result<Vec<(String, ContainerEdits)>, PrepareError> {
    let all: Vec<String> = requests.iter().flat_map(|r| r.whole.clone()).collect();
    let backend = backend.clone();
    let driver = driver.to_owned();
    let task = tokio::task::spawn_blocking(move || {
        let mut given: Vec<String> = Vec::new();
        let mut out = Vec::with_capacity(requests.len());
        for request in requests {
            let mut edits = ContainerEdits::default();
            if !request.whole.is_empty() {
                edits = match backend.prepare_devices(&request.whole) {
                    Ok(edits) => edits,
                    Err(source) => {
                        release_logged(&driver, backend.as_ref(), &given);
                        return Err(PrepareError::DevicesRefused {
                            ids: request.whole,
                            source,
                        });
                    }
                };
                given.extend(request.whole.iter().cloned());
            }
            for (id, consumed) in &request.shares {
                match backend.prepare_share(id, consumed) {
                    Ok(share) => edits = edits.merge(share),
                    Err(source) => {
                        release_logged(&driver, backend.as_ref(), &given);
                        return Err(PrepareError::ShareRefused {
                            id: id.clone(),
                            source,
                        });
                    }
                }
            }
            out.push((request.name, edits));
        }
        Ok(out)
    });
    task.await.map_err(|err| PrepareError::BackendGone {
        ids: all,
        reason: err.to_string(),
    })?
}

/// Releases devices given whole; the backend's error is the caller's.
pub(super) async fn release(
    backend: &Arc<dyn ClaimBackend>,
    ids: Vec<String>,
) -> Result<(), PrepareError> {
    if ids.is_empty() {
        return Ok(());
    }
    let backend = backend.clone();
    let task = {
        let ids = ids.clone();
        tokio::task::spawn_blocking(move || backend.unprepare_devices(&ids))
    };
    match task.await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(source)) => Err(PrepareError::Release { ids, source }),
        Err(err) => Err(PrepareError::BackendGone {
            ids,
            reason: err.to_string(),
        }),
    }
}

/// Releases the devices of a claim whose prepare failed after they were given; a release that
/// fails is logged (the backend finds what it made again when asked once more).
pub(super) async fn release_after_failure(
    driver: &str,
    backend: &Arc<dyn ClaimBackend>,
    ids: Vec<String>,
) {
    if let Err(err) = release(backend, ids.clone()).await {
        tracing::warn!(%driver, devices = ?ids, %err, "cannot release the devices of a claim whose prepare failed");
    }
}

/// Tells the backend that the last share of each of `ids` is gone.
pub(super) async fn shares_released(backend: &Arc<dyn ClaimBackend>, ids: Vec<String>) {
    if ids.is_empty() {
        return;
    }
    let backend = backend.clone();
    let task = tokio::task::spawn_blocking(move || {
        for id in ids {
            backend.unprepare_shares(&id);
        }
    });
    if let Err(err) = task.await {
        tracing::warn!(%err, "the backend's release of shared devices ended without an answer");
    }
}

/// Tells the backend, once its first discovery has ended, which devices have shares prepared
/// before this process started.
pub(crate) async fn restore_shares(backend: Arc<dyn ClaimBackend>, ids: Vec<String>) {
    if ids.is_empty() {
        return;
    }
    backend.discovered().await;
    let task = tokio::task::spawn_blocking(move || {
        for id in ids {
            backend.restore_shares(&id);
        }
    });
    if let Err(err) = task.await {
        tracing::warn!(%err, "the backend's restore of shared devices ended without an answer");
    }
}

/// Releases devices from the blocking pool itself, logging a failure.
fn release_logged(driver: &str, backend: &dyn ClaimBackend, ids: &[String]) {
    if ids.is_empty() {
        return;
    }
    if let Err(err) = backend.unprepare_devices(ids) {
        tracing::warn!(%driver, devices = ?ids, %err, "cannot release the devices of a claim whose prepare failed");
    }
}
