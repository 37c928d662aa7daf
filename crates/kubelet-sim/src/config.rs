//! How the simulated kubelet behaves: [`SimConfig`] (grace period, plugin watcher, pod
//! resources socket, timeouts) and [`ClientKeying`] (how its device plugin server keys
//! clients, which changed in Kubernetes 1.37).

use devplug_proto::constants::{DRA_CALL_TIMEOUT_SECS, ENDPOINT_STOP_GRACE_SECS};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How the simulated kubelet behaves.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// How long a disconnected resource is kept before removal (the kubelet: 5 minutes).
    pub grace: Duration,
    /// How the kubelet finds the plugin client to disconnect when a ListAndWatch stream ends.
    pub clients: ClientKeying,
    /// The pause between binding `kubelet.sock` and listening on it. A Go kubelet creates the
    /// file with `bind()` and accepts connections only after `listen()`: a plugin that dials the
    /// moment the file appears is refused. The default (1 ms) makes that gap visible every time.
    pub listen_delay: Duration,
    /// The plugin-watcher folder (the kubelet's `plugins_registry/`) to run the plugin watcher
    /// on; `None` runs no watcher.
    pub plugins_registry: Option<PathBuf>,
    /// How often the plugin manager's reconciler registers new sockets (the kubelet: 1 s).
    pub watcher_reconcile: Duration,
    /// Where to serve the pod resources API v1 (the kubelet:
    /// `/var/lib/kubelet/pod-resources/kubelet.sock`); `None` serves none.
    pub pod_resources_socket: Option<PathBuf>,
    /// How long a DRA plugin has to answer `NodePrepareResources` or `NodeUnprepareResources`
    /// (the kubelet: 45 s).
    pub dra_call_timeout: Duration,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            grace: Duration::from_secs(ENDPOINT_STOP_GRACE_SECS),
            clients: ClientKeying::default(),
            listen_delay: Duration::from_millis(1),
            plugins_registry: None,
            watcher_reconcile: Duration::from_secs(1),
            pod_resources_socket: None,
            dra_call_timeout: Duration::from_secs(DRA_CALL_TIMEOUT_SECS),
        }
    }
}

impl SimConfig {
    /// This config with the plugin watcher on `plugins_registry` beside the device-plugins
    /// folder `dir` (as on a node: `/var/lib/kubelet/{device-plugins,plugins_registry}`).
    pub fn with_watcher_beside(mut self, dir: &Path) -> SimConfig {
        let root = dir
            .parent()
            .map_or_else(|| PathBuf::from("/"), Path::to_path_buf);
        self.plugins_registry = Some(root.join("plugins_registry"));
        self
    }

    /// This config serving the pod resources API at `pod-resources/kubelet.sock` beside the
    /// device-plugins folder `dir`.
    pub fn with_pod_resources_beside(mut self, dir: &Path) -> SimConfig {
        let root = dir
            .parent()
            .map_or_else(|| PathBuf::from("/"), Path::to_path_buf);
        self.pod_resources_socket = Some(root.join("pod-resources").join("kubelet.sock"));
        self
    }
}

/// How the kubelet's device plugin server keys its clients.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ClientKeying {
    /// Kubelets 1.25 to 1.36: one client per resource name. A new registration replaces the
    /// entry but leaves the old client's stream running; when any stream of the resource ends,
    /// the kubelet looks the name up again and disconnects whatever client holds it now, even a
    /// newer one (all devices unhealthy, endpoint stopped). A rolling upgrade thus cuts the new
    /// instance off when the old one stops.
    #[default]
    ResourceName,
    /// Kubelets from 1.37 (kubernetes#135437): clients keyed by resource name and socket path;
    /// the end of a stream that is no longer the resource's current endpoint changes nothing.
    SocketPath,
}
