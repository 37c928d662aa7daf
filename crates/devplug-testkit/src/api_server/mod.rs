//! A real control plane for tests, the envtest way: `etcd` and `kube-apiserver` from the folder
//! named by `KUBEBUILDER_ASSETS`, started once per test binary on loopback in a temp folder, and
//! stopped by PID when the test binary exits (a small reaper process watches it).
//!
//! [`ControlPlane`] is the same control plane (plus `kube-scheduler`) owned by a value instead,
//! for programs such as `devplug demo --dra`: its processes are stopped when it is dropped, and a
//! reaper stops them too should the program be killed before that.
//!
//! Without `KUBEBUILDER_ASSETS` [`ApiServer::shared`] returns `None` after printing a loud
//! message: tests then say `SKIPPED` and how to get the binaries, never pass silently; with
//! `DEVPLUG_REQUIRE_API_SERVER` set (CI) a missing `KUBEBUILDER_ASSETS` fails them instead. Get them
//! with `setup-envtest use 1.36.x -p path` (controller-runtime's tool; docs/testing.md, "Tests against a
//! real API server").
//!
//! The API server authenticates a static admin token (`system:masters`) and service account
//! tokens (TokenRequest), and authorizes with RBAC, so permission tests are real.
//!
//! - `control_plane.rs`: the processes (the shared API server of a test binary, a
//!   [`ControlPlane`] owned by a value, the readiness waits and the reaper).
//! - `credentials.rs`: the admin token and kubeconfigs, service account keys and tokens,
//!   clients.
//! - `fixtures.rs`: what tests make on the API server (Nodes, the rendered chart's
//!   permissions), unique names and the wait for a condition.

mod control_plane;
mod credentials;
mod fixtures;

pub use control_plane::{
    admin, assets_or_skip, missing_binaries, own_control_plane, wait_ready_async, ControlPlane,
    CONTROL_PLANE_BINARIES,
};
pub use credentials::{client, client_for_token, node_token, service_account_keys};
pub use fixtures::{
    apply_rendered_permissions, create_cluster_scoped, new_node, rand_u32, schedulable_node, until,
};

use std::path::PathBuf;

/// A running etcd + kube-apiserver pair.
#[derive(Debug)]
pub struct ApiServer {
    /// `https://127.0.0.1:PORT`.
    pub url: String,
    /// The serving certificate's CA bundle (PEM).
    pub ca: PathBuf,
    /// A kubeconfig for the admin.
    pub kubeconfig: PathBuf,
    /// The folder of etcd's data, the certificates and the logs: removed by the reaper for
    /// [`ApiServer::shared`]; the owner's to remove for a [`ControlPlane`].
    pub dir: PathBuf,
}

/// Why the control plane could not start.
fn fail(what: &str, err: impl std::fmt::Display) -> String {
    format!("{what}: {err}")
}
