//! The kubelet device plugin API, v1beta1: the wire contract devplug speaks.
//!
//! - [`v1beta1`]: prost messages and tonic clients/servers generated from `proto/v1beta1/api.proto`
//!   (committed; `tests/bootstrap.rs` regenerates and diffs it).
//! - [`constants`]: the kubelet's constants (API version, paths, health strings).
//! - [`uds`]: gRPC channels over Unix sockets with the kubelet's `:authority`, and servers that
//!   accept any client's (through [`authority`]).
//! - [`authority`]: serves clients that send a socket path as `:authority` (kubelets up to 1.25),
//!   which h2 would otherwise reset.
//! - `topology.rs`: `TopologyInfo::for_numa_nodes`, a device's NUMA nodes on the wire.
//! - [`resource_name`]: the kubelet's check on extended resource names, so that plugins and the
//!   simulator reject the same names the kubelet does.
//!
//! - [`pluginregistration`]: the kubelet's plugin-watcher registration API (a socket in
//!   `plugins_registry`), generated from `proto/pluginregistration/api.proto`.
//! - [`podresources`]: the kubelet's pod resources API v1 (package `v1`), generated from
//!   `proto/podresources/api.proto`.
//!
//! - [`dra_v1`] and [`dra_v1beta1`]: the kubelet's DRA plugin API (`DRAPlugin`), packages
//!   `k8s.io.kubelet.pkg.apis.dra.v1` (Kubernetes 1.34+) and `…v1beta1` (1.32+), generated from
//!   `proto/dra/*/api.proto`.
//! - [`dra_health`]: a client of that stream in either version ([`dra_health::HealthStream`]).
//! - [`dra_health_v1`] and [`dra_health_v1alpha1`]: the kubelet's DRA device health stream
//!   (`DRAResourceHealth`, package `v1`, Kubernetes 1.37+, and `v1alpha1`, 1.34+), generated from
//!   `proto/dra-health/*/api.proto`.
//!
//! Field names, numbers and the package names are the kubelet's (`k8s.io/kubelet/pkg/apis/…`),
//! and are pinned by `tests/wire.rs`.

pub mod authority;
pub mod constants;
pub mod dra_health;
pub mod resource_name;
mod topology;
pub mod uds;

/// Generated code for package `v1beta1`.
#[allow(
    missing_docs,
    clippy::all,
    clippy::pedantic,
    clippy::unwrap_used,
    clippy::expect_used
)]
pub mod v1beta1 {
    include!("gen/v1beta1.rs");
}

/// Generated code for package `pluginregistration` (the kubelet's plugin watcher).
#[allow(
    missing_docs,
    clippy::all,
    clippy::pedantic,
    clippy::unwrap_used,
    clippy::expect_used
)]
pub mod pluginregistration {
    include!("gen/pluginregistration.rs");
}

/// Generated code for the kubelet's pod resources API, package `v1`.
#[allow(
    missing_docs,
    clippy::all,
    clippy::pedantic,
    clippy::unwrap_used,
    clippy::expect_used
)]
pub mod podresources {
    include!("gen/v1.rs");
}

/// Generated code for the kubelet's DRA plugin API, package `k8s.io.kubelet.pkg.apis.dra.v1`.
#[allow(
    missing_docs,
    clippy::all,
    clippy::pedantic,
    clippy::unwrap_used,
    clippy::expect_used
)]
pub mod dra_v1 {
    include!("gen/k8s.io.kubelet.pkg.apis.dra.v1.rs");
}

/// Generated code for the kubelet's DRA plugin API, package
/// `k8s.io.kubelet.pkg.apis.dra.v1beta1`.
#[allow(
    missing_docs,
    clippy::all,
    clippy::pedantic,
    clippy::unwrap_used,
    clippy::expect_used
)]
pub mod dra_v1beta1 {
    include!("gen/k8s.io.kubelet.pkg.apis.dra.v1beta1.rs");
}

/// Generated code for the kubelet's DRA device health API, package `v1alpha1`
/// (`DRAResourceHealth`).
#[allow(
    missing_docs,
    clippy::all,
    clippy::pedantic,
    clippy::unwrap_used,
    clippy::expect_used
)]
pub mod dra_health_v1alpha1 {
    include!("gen/v1alpha1.rs");
}

/// Generated code for the kubelet's DRA device health API, package `v1` (`DRAResourceHealth`,
/// Kubernetes 1.37+).
#[allow(
    missing_docs,
    clippy::all,
    clippy::pedantic,
    clippy::unwrap_used,
    clippy::expect_used
)]
pub mod dra_health_v1 {
    include!("gen/dra-health-v1/v1.rs");

    use super::dra_health_v1alpha1 as alpha;

    /// A `v1alpha1` health message as `v1`: the same fields, numbers and values (v1 is v1alpha1
    /// promoted), so a server answers both from one message and a client reads both as one.
    impl From<alpha::NodeWatchResourcesResponse> for NodeWatchResourcesResponse {
        fn from(message: alpha::NodeWatchResourcesResponse) -> Self {
            NodeWatchResourcesResponse {
                devices: message
                    .devices
                    .into_iter()
                    .map(|d| DeviceHealth {
                        device: d.device.map(|id| DeviceIdentifier {
                            pool_name: id.pool_name,
                            device_name: id.device_name,
                        }),
                        health: d.health,
                        last_updated_time: d.last_updated_time,
                        health_check_timeout_seconds: d.health_check_timeout_seconds,
                        message: d.message,
                    })
                    .collect(),
            }
        }
    }
}
