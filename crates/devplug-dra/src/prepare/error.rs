//! Why a claim could not be prepared or unprepared: the kubelet puts the message in the pod's
//! events and retries, so each says what is wrong and, where there is one, what to do.

use devplug::dra::ReleaseError;
use devplug::AllocateError;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Why one claim of a call failed. Cloned into every claim a failed checkpoint write undoes.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PrepareError {
    /// The claim's allocation could not be read or used, as the claim source said.
    #[error("{0}")]
    Claim(String),
    /// The API server did not answer in time.
    #[error("reading ResourceClaim {claim} from the API server took over {after:?}")]
    ClaimReadTimeout {
        /// The claim, `namespace/name`.
        claim: String,
        /// The deadline of the call's reads.
        after: Duration,
    },
    /// A device of another pool (another node's).
    #[error("device {device} is in pool {pool:?}, not this node's pool {ours:?}")]
    OtherPool {
        /// The device.
        device: String,
        /// Its pool.
        pool: String,
        /// This node's pool.
        ours: String,
    },
    /// A device this driver does not publish (any more).
    #[error("device {device} is not one of driver {driver}'s devices on this node (any more)")]
    UnknownDevice {
        /// The device.
        device: String,
        /// This driver.
        driver: String,
    },
    /// An unhealthy device, for a claim that does not tolerate the unhealthy taint.
    #[error("device {device} is unhealthy: {reason}")]
    Unhealthy {
        /// The device.
        device: String,
        /// Why it is unhealthy.
        reason: String,
    },
    /// A device that goes to one claim at a time is prepared for another live claim.
    #[error(
        "device {device} is already prepared for ResourceClaim {holder} and cannot be shared: \
         the scheduler allocated it to two claims (another driver publishing this node's \
         devices, or an allocation made by hand); this claim waits until the other is unprepared"
    )]
    Taken {
        /// The device.
        device: String,
        /// The claim that has it, `namespace/name`.
        holder: String,
    },
    /// The backend refused devices given whole.
    #[error("the backend refused devices {ids:?}: {source}")]
    DevicesRefused {
        /// The backend's ids.
        ids: Vec<String>,
        /// What the backend said.
        source: AllocateError,
    },
    /// The backend refused a share.
    #[error("the backend refused a share of device {id}: {source}")]
    ShareRefused {
        /// The backend's id of the device.
        id: String,
        /// What the backend said.
        source: AllocateError,
    },
    /// The backend's work for a claim ended without an answer (it panicked).
    #[error("the backend's work on devices {ids:?} ended without an answer: {reason}")]
    BackendGone {
        /// The backend's ids.
        ids: Vec<String>,
        /// What the task said.
        reason: String,
    },
    /// The backend's pre-start hook failed.
    #[error("preparing the devices failed: {0}")]
    PreStart(String),
    /// The claim's CDI spec could not be written.
    #[error("cannot write the CDI spec {}: {source}", path.display())]
    WriteSpec {
        /// The spec file.
        path: PathBuf,
        /// Why.
        source: Arc<std::io::Error>,
    },
    /// The claim's CDI spec could not be removed.
    #[error("cannot remove the CDI spec {}: {source}", path.display())]
    RemoveSpec {
        /// The spec file.
        path: PathBuf,
        /// Why.
        source: Arc<std::io::Error>,
    },
    /// A device metadata file of the claim could not be written.
    #[error("cannot write the device metadata file {}: {source}", path.display())]
    WriteMetadata {
        /// The file.
        path: PathBuf,
        /// Why.
        source: Arc<std::io::Error>,
    },
    /// The claim's device metadata folder could not be removed.
    #[error("cannot remove the device metadata folder {}: {source}", path.display())]
    RemoveMetadata {
        /// The folder.
        path: PathBuf,
        /// Why.
        source: Arc<std::io::Error>,
    },
    /// A prepared claim's spec file is gone, and the checkpoint does not hold its content.
    #[error(
        "the CDI spec {} of prepared claim {claim} is missing, and this checkpoint (from an \
         older devplug) does not hold its content: delete the claim's pods so the kubelet \
         unprepares and prepares it again",
        path.display()
    )]
    SpecLost {
        /// The spec file.
        path: PathBuf,
        /// The claim, `namespace/name`.
        claim: String,
    },
    /// A prepared claim's spec file is gone and cannot be written again.
    #[error(
        "the CDI spec {} of prepared claim {claim} is missing and cannot be written again: {source}",
        path.display()
    )]
    RewriteSpec {
        /// The spec file.
        path: PathBuf,
        /// The claim, `namespace/name`.
        claim: String,
        /// Why.
        source: Arc<std::io::Error>,
    },
    /// The checkpoint could not be written (the whole call is undone).
    #[error("cannot write the checkpoint {}: {source}", path.display())]
    WriteCheckpoint {
        /// The checkpoint file.
        path: PathBuf,
        /// Why.
        source: Arc<std::io::Error>,
    },
    /// The backend could not remove what it made for the claim (the claim stays prepared).
    #[error("the backend cannot release devices {ids:?}: {source}")]
    Release {
        /// The backend's ids.
        ids: Vec<String>,
        /// What the backend said.
        source: ReleaseError,
    },
}
