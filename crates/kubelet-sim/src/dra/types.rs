//! What the kubelet's DRA side talks about: the `DRAPlugin` service versions, claims and
//! devices (with their `v1` and `v1beta1` wire forms), per-claim results and errors, and the
//! records the node state keeps (registered endpoints, prepared claims, pods' claims).

use devplug_proto::constants::DRA_SUPPORTED_VERSIONS;
use devplug_proto::{dra_v1, dra_v1beta1};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tonic::transport::Channel;

/// A version of the `DRAPlugin` gRPC service the kubelet can speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DraService {
    /// `v1.DRAPlugin`, package `k8s.io.kubelet.pkg.apis.dra.v1` (kubelets 1.34+).
    V1,
    /// `v1beta1.DRAPlugin`, package `k8s.io.kubelet.pkg.apis.dra.v1beta1` (kubelets 1.32+).
    V1beta1,
}

impl DraService {
    /// Every service the kubelet knows, newest first.
    pub const ALL: [DraService; 2] = [DraService::V1, DraService::V1beta1];

    /// The name a plugin lists in `supported_versions` (`"v1.DRAPlugin"`).
    pub fn name(self) -> &'static str {
        match self {
            DraService::V1 => DRA_SUPPORTED_VERSIONS[0],
            DraService::V1beta1 => DRA_SUPPORTED_VERSIONS[1],
        }
    }

    /// The service for a `supported_versions` entry, if the kubelet knows it.
    pub fn from_name(name: &str) -> Option<DraService> {
        DraService::ALL.into_iter().find(|s| s.name() == name)
    }
}

impl std::fmt::Display for DraService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The version of the device health service the kubelet opens (`HealthService::pick`).
pub use devplug_proto::dra_health::HealthService;

/// A ResourceClaim as the kubelet names it to a DRA plugin.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DraClaim {
    /// The claim's namespace.
    pub namespace: String,
    /// The claim's UID: the key of the plugin's answer.
    pub uid: String,
    /// The claim's name.
    pub name: String,
}

impl DraClaim {
    /// A claim `namespace/name` with UID `uid`.
    pub fn new(
        namespace: impl Into<String>,
        name: impl Into<String>,
        uid: impl Into<String>,
    ) -> Self {
        DraClaim {
            namespace: namespace.into(),
            uid: uid.into(),
            name: name.into(),
        }
    }

    pub(crate) fn to_v1(&self) -> dra_v1::Claim {
        dra_v1::Claim {
            namespace: self.namespace.clone(),
            uid: self.uid.clone(),
            name: self.name.clone(),
        }
    }

    pub(crate) fn to_v1beta1(&self) -> dra_v1beta1::Claim {
        dra_v1beta1::Claim {
            namespace: self.namespace.clone(),
            uid: self.uid.clone(),
            name: self.name.clone(),
        }
    }

    pub(crate) fn from_v1(claim: dra_v1::Claim) -> Self {
        DraClaim {
            namespace: claim.namespace,
            uid: claim.uid,
            name: claim.name,
        }
    }

    pub(crate) fn from_v1beta1(claim: dra_v1beta1::Claim) -> Self {
        DraClaim {
            namespace: claim.namespace,
            uid: claim.uid,
            name: claim.name,
        }
    }
}

/// One device a plugin prepared for a claim.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DraDevice {
    /// The claim's requests this device satisfies.
    pub request_names: Vec<String>,
    /// The pool the device belongs to.
    pub pool_name: String,
    /// The device's name in its pool.
    pub device_name: String,
    /// Fully qualified CDI device names (`vendor/class=name`) the container runtime applies.
    pub cdi_device_ids: Vec<String>,
    /// The share of a consumable-capacity device (v1 only, Kubernetes 1.35+).
    pub share_id: Option<String>,
}

impl DraDevice {
    pub(crate) fn from_v1(d: dra_v1::Device) -> Self {
        DraDevice {
            request_names: d.request_names,
            pool_name: d.pool_name,
            device_name: d.device_name,
            cdi_device_ids: d.cdi_device_ids,
            share_id: d.share_id,
        }
    }

    pub(crate) fn from_v1beta1(d: dra_v1beta1::Device) -> Self {
        DraDevice {
            request_names: d.request_names,
            pool_name: d.pool_name,
            device_name: d.device_name,
            cdi_device_ids: d.cdi_device_ids,
            share_id: None,
        }
    }

    pub(crate) fn to_v1(&self) -> dra_v1::Device {
        dra_v1::Device {
            request_names: self.request_names.clone(),
            pool_name: self.pool_name.clone(),
            device_name: self.device_name.clone(),
            cdi_device_ids: self.cdi_device_ids.clone(),
            share_id: self.share_id.clone(),
        }
    }

    pub(crate) fn to_v1beta1(&self) -> dra_v1beta1::Device {
        dra_v1beta1::Device {
            request_names: self.request_names.clone(),
            pool_name: self.pool_name.clone(),
            device_name: self.device_name.clone(),
            cdi_device_ids: self.cdi_device_ids.clone(),
        }
    }
}

/// Why one claim of a call did not succeed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClaimError {
    /// The plugin's answer has no entry for the claim's UID.
    #[error("the plugin's answer has no result for this claim")]
    NotAnswered,
    /// The plugin answered with this non-empty `error`.
    #[error("{0}")]
    Failed(String),
}

/// Per-claim results of one call, by claim UID.
pub type ClaimResults<T> = BTreeMap<String, Result<T, ClaimError>>;

/// Why a DRA call failed as a whole.
#[derive(Debug, thiserror::Error)]
pub enum DraError {
    /// The driver name is empty (the kubelet refuses to look it up).
    #[error("DRA driver name is empty")]
    EmptyDriverName,
    /// No plugin is registered for the driver.
    #[error("DRA driver {0} is not registered")]
    NotRegistered(String),
    /// The chosen endpoint's socket did not accept a connection.
    #[error("DRA driver {driver}: failed to connect to {endpoint}: {source}")]
    Dial {
        /// The driver.
        driver: String,
        /// The endpoint's socket.
        endpoint: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The plugin did not answer within the per-call timeout.
    #[error("{method} of DRA driver {driver}: no answer within {after:?}")]
    Timeout {
        /// The driver.
        driver: String,
        /// `NodePrepareResources` or `NodeUnprepareResources`.
        method: &'static str,
        /// The timeout that ran out.
        after: Duration,
    },
    /// The call ended with a gRPC status.
    #[error("{method} of DRA driver {driver}: {code:?}: {message}")]
    Status {
        /// The driver.
        driver: String,
        /// `NodePrepareResources` or `NodeUnprepareResources`.
        method: &'static str,
        /// The status code.
        code: tonic::Code,
        /// The status message.
        message: String,
    },
    /// The answer has a result for a claim UID that was not asked for.
    #[error("{method} returned result for unknown claim UID {uid}")]
    UnknownClaim {
        /// The driver.
        driver: String,
        /// `NodePrepareResources` or `NodeUnprepareResources`.
        method: &'static str,
        /// The unexpected UID.
        uid: String,
    },
    /// One claim of a pod failed (pod helpers only: the kubelet gives up on the pod at the
    /// first failed claim).
    #[error("{method} failed for ResourceClaim {claim}: {error}")]
    ClaimFailed {
        /// The driver.
        driver: String,
        /// `NodePrepareResources` or `NodeUnprepareResources`.
        method: &'static str,
        /// The claim's name.
        claim: String,
        /// What went wrong.
        error: ClaimError,
    },
}

/// A registered endpoint of a DRA driver, as the kubelet's plugin manager records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraPluginRecord {
    /// The driver name (`GetInfo`'s `name`).
    pub driver: String,
    /// The socket serving `DRAPlugin` (`GetInfo`'s `endpoint`, or the registration socket when
    /// that was empty).
    pub endpoint: PathBuf,
    /// The registration socket in `plugins_registry/` it came through.
    pub registration_socket: PathBuf,
    /// The service version the kubelet chose.
    pub service: DraService,
    /// The device health service it opens, if the plugin lists one.
    pub health: Option<HealthService>,
    /// When the kubelet registered it.
    pub registered_at: Instant,
}

/// A claim the kubelet has prepared through one driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedClaim {
    /// The claim.
    pub claim: DraClaim,
    /// The devices the driver prepared for it.
    pub devices: Vec<DraDevice>,
    /// When the driver's answer came.
    pub prepared_at: Instant,
}

impl PreparedClaim {
    /// Every CDI device id of every device, in the driver's order.
    pub fn cdi_device_ids(&self) -> Vec<&str> {
        self.devices
            .iter()
            .flat_map(|d| d.cdi_device_ids.iter().map(String::as_str))
            .collect()
    }
}

/// A registered endpoint with its connection.
#[derive(Debug)]
pub(crate) struct DraEndpoint {
    pub(crate) record: DraPluginRecord,
    pub(crate) channel: Channel,
}

/// What the kubelet knows about DRA.
#[derive(Debug, Default)]
pub(crate) struct DraState {
    /// Registered endpoints, in registration order.
    pub(crate) plugins: Vec<DraEndpoint>,
    /// Driver → claim UID → prepared claim.
    pub(crate) prepared: BTreeMap<String, BTreeMap<String, PreparedClaim>>,
    /// Pod UID → the (driver, claim) pairs it references.
    pub(crate) pods: BTreeMap<String, BTreeSet<(String, DraClaim)>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_health_service_is_v1_where_listed_as_a_1_37_kubelet_picks_it() {
        let listed =
            |names: &[&str]| -> Vec<String> { names.iter().map(|n| (*n).to_owned()).collect() };
        assert_eq!(
            HealthService::pick(&listed(&[
                "v1.DRAPlugin",
                "v1alpha1.DRAResourceHealth",
                "v1.DRAResourceHealth"
            ])),
            Some(HealthService::V1)
        );
        assert_eq!(
            HealthService::pick(&listed(&[
                "v1beta1.DRAPlugin",
                "v1alpha1.DRAResourceHealth"
            ])),
            Some(HealthService::V1alpha1)
        );
        assert_eq!(HealthService::pick(&listed(&["v1.DRAPlugin"])), None);
        assert_eq!(HealthService::V1.name(), "v1.DRAResourceHealth");
    }
}
