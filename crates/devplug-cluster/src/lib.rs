//! The cluster side of devplug, through kube-rs, kept out of the core crate.
//!
//! - [`capacity`]: extended resources on a Node's status by JSON patch: set, remove
//!   (a missing key is "already gone"), list.
//! - [`advertise`]: resources kept on our own Node by `devplug run` (`advertise:`), event-driven.
//! - [`node_labels`]: the labels the backends describe the node with, on our Node (server-side
//!   apply) or in a NodeFeature object for Node Feature Discovery; removed at uninstall.
//! - [`policy_check`]: whether the admission policy that keeps a feature to its own node is in
//!   force (a server-side dry run of a write it must refuse).
//! - [`events`]: device health, registration and config reload problems as Events on the Node.
//! - [`refused_pods`]: pods the kubelet refused at admission for a resource we serve (after a
//!   reboot): deleted where their controller replaced them, reported where nothing does.
//!
//! The DRA driver is a crate of its own (`devplug-dra`), and the test control plane lives in the
//! test kit (`devplug-testkit`).
//!
//! Clients come from the usual places: `--kubeconfig`, else `KUBECONFIG` / `~/.kube/config`, else
//! the in-cluster service account ([`connect`]).

pub mod advertise;
pub mod capacity;
pub mod events;
pub mod node_labels;
pub mod policy_check;
pub mod refused_pods;

use std::path::Path;
use std::time::Duration;

/// The longest one request of a cluster feature to the API server may take (watches excepted:
/// kube-rs's watcher has its own timeouts). A hung request must not stop a feature for good.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Seconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `request` within [`REQUEST_TIMEOUT`]; past it, a timeout error.
pub(crate) async fn timed<T>(
    request: impl std::future::Future<Output = Result<T, kube::Error>>,
) -> Result<T, kube::Error> {
    match tokio::time::timeout(REQUEST_TIMEOUT, request).await {
        Ok(answer) => answer,
        Err(_) => Err(kube::Error::Service(
            format!(
                "no answer from the API server within {} s",
                REQUEST_TIMEOUT.as_secs()
            )
            .into(),
        )),
    }
}

/// Why a client could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The kubeconfig file could not be read or used.
    #[error("kubeconfig {path}: {message}")]
    Kubeconfig {
        /// The file.
        path: String,
        /// What was wrong.
        message: String,
    },
    /// No kubeconfig and not in a cluster.
    #[error("no cluster to talk to: {0} (give --kubeconfig, set KUBECONFIG, or run in a pod)")]
    Infer(String),
}

/// A client from `kubeconfig` if given, else inferred (KUBECONFIG, `~/.kube/config`, then the
/// in-cluster service account).
pub async fn connect(kubeconfig: Option<&Path>) -> Result<kube::Client, ConnectError> {
    match kubeconfig {
        Some(path) => from_kubeconfig(path)
            .await
            .map_err(|message| ConnectError::Kubeconfig {
                path: path.display().to_string(),
                message,
            }),
        None => {
            if let Some(missing) = no_cluster_source() {
                return Err(ConnectError::Infer(missing));
            }
            kube::Client::try_default()
                .await
                .map_err(|e| ConnectError::Infer(e.to_string()))
        }
    }
}

/// Why no cluster can be inferred, when none of kube-rs's sources is there: no `KUBECONFIG`, no
/// `~/.kube/config`, not in a pod. One short line instead of kube-rs's nested one.
fn no_cluster_source() -> Option<String> {
    if std::env::var_os("KUBECONFIG").is_some_and(|v| !v.is_empty())
        || std::env::var_os("KUBERNETES_SERVICE_HOST").is_some()
    {
        return None;
    }
    let home = std::env::var_os("HOME").map(std::path::PathBuf::from)?;
    let default = home.join(".kube").join("config");
    (!default.exists()).then(|| {
        format!(
            "KUBECONFIG is not set, {} does not exist, and this is not a pod",
            default.display()
        )
    })
}

/// A client for the kubeconfig file at `path`, its current context (no environment).
pub async fn from_kubeconfig(path: &Path) -> Result<kube::Client, String> {
    let kubeconfig = kube::config::Kubeconfig::read_from(path).map_err(|e| e.to_string())?;
    let options = kube::config::KubeConfigOptions::default();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &options)
        .await
        .map_err(|e| e.to_string())?;
    kube::Client::try_from(config).map_err(|e| e.to_string())
}
