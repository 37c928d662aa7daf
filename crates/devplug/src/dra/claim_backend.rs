//! [`ClaimBackend`]: what a backend does for DRA claims, beyond what [`Backend`] does for the
//! device plugin.
//!
//! A device plugin only ever hands whole devices to containers ([`Backend::allocate`]); the
//! kubelet keeps the books. A DRA claim is prepared and unprepared by the driver itself, can hold
//! a share of a device (consumable capacity), and outlives a restart of the driver (its
//! checkpoint). So a backend that serves claims answers five more questions, each with a
//! default that suits a backend whose devices are handed over whole and need nothing made or
//! removed: a backend writes `impl ClaimBackend for MyBackend {}` and is a DRA driver.
//!
//! The calls are synchronous, as a backend's work is (NVML, spawning a daemon, sysfs writes);
//! the driver runs them on tokio's blocking pool, never on the runtime that serves the sockets,
//! so one slow claim never delays another resource's `Allocate` or `ListAndWatch`.

use crate::{AllocateError, Backend, ContainerEdits};
use std::collections::BTreeMap;

/// A [`Backend`] whose devices can be given to DRA claims.
pub trait ClaimBackend: Backend {
    /// The edits for devices `ids`, given whole to one request of a claim. The default is what
    /// [`Backend::allocate`] gives a device plugin's container. A backend that makes something
    /// per claim (a MIG partition) makes it here, and removes it in
    /// [`ClaimBackend::unprepare_devices`].
    fn prepare_devices(&self, ids: &[String]) -> Result<ContainerEdits, AllocateError> {
        self.allocate(ids)
    }

    /// The edits for one share of device `id`, a device shared by capacity
    /// ([`super::DeviceAttributes::shared`]), given what the share consumed of each
    /// capacity (`cores` → 40, `memory` → bytes), as the scheduler recorded it. The edits are
    /// where the limits reach the container. The default refuses, so a share is never handed
    /// out as if it were the whole device.
    fn prepare_share(
        &self,
        id: &str,
        consumed: &BTreeMap<String, u64>,
    ) -> Result<ContainerEdits, AllocateError> {
        let _ = consumed;
        Err(AllocateError::InvalidRequest(format!(
            "device {id} was allocated as a share, and this backend does not share devices by \
             capacity"
        )))
    }

    /// Devices `ids`, given whole by [`ClaimBackend::prepare_devices`], are done with: their
    /// claim is unprepared, or its prepare failed after the devices were given. Removes what
    /// preparing made. Must succeed when there is nothing left to remove (it may be called
    /// again for the same ids); an error fails the unprepare, which the kubelet retries. The
    /// default has nothing to remove.
    fn unprepare_devices(&self, ids: &[String]) -> Result<(), ReleaseError> {
        let _ = ids;
        Ok(())
    }

    /// The last prepared share of device `id` is released (its claims unprepared): a backend
    /// that runs something per shared device (a sharing daemon) stops it here. The default does
    /// nothing.
    fn unprepare_shares(&self, id: &str) {
        let _ = id;
    }

    /// Device `id` has shares prepared before this process started and not released (read from
    /// the driver's checkpoint); called once the backend's first discovery has ended. A backend
    /// that runs something per shared device starts it again. The default does nothing.
    fn restore_shares(&self, id: &str) {
        let _ = id;
    }
}

/// Why devices could not be released ([`ClaimBackend::unprepare_devices`]). The driver fails
/// the claim's unprepare with this message, and the kubelet retries it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ReleaseError(pub String);
