//! Constants of the v1beta1 contract, as the kubelet defines them.

/// The only API version the kubelet accepts in `RegisterRequest.version`.
pub const VERSION: &str = "v1beta1";

/// The kubelet's device-plugins folder on Linux.
pub const DEVICE_PLUGIN_PATH: &str = "/var/lib/kubelet/device-plugins/";

/// File name of the kubelet's registration socket inside [`DEVICE_PLUGIN_PATH`].
pub const KUBELET_SOCKET_NAME: &str = "kubelet.sock";

/// The health string that counts as healthy. Any other string, including empty, is unhealthy.
pub const HEALTHY: &str = "Healthy";

/// The health string for an unhealthy device.
pub const UNHEALTHY: &str = "Unhealthy";

/// How long the kubelet waits for PreStartContainer, in seconds.
pub const PRE_START_CONTAINER_TIMEOUT_SECS: u64 = 30;

/// How long the kubelet waits when dialling a plugin back during Register, in seconds.
pub const DIAL_TIMEOUT_SECS: u64 = 10;

/// How long the kubelet keeps a disconnected resource before removing it, in seconds (5 min).
pub const ENDPOINT_STOP_GRACE_SECS: u64 = 300;

/// The default largest message a grpc-go client (the kubelet) accepts: 4 MiB.
pub const MAX_RECV_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

/// The kubelet's checkpoint file in the device-plugins folder; it survives a kubelet restart.
pub const CHECKPOINT_FILE_NAME: &str = "kubelet_internal_checkpoint";

/// The kubelet's plugin-watcher folder: a socket here serving `pluginregistration.Registration`
/// registers a plugin.
pub const PLUGINS_REGISTRY_PATH: &str = "/var/lib/kubelet/plugins_registry/";

/// `PluginInfo.type` of a device plugin registering through the plugin watcher.
pub const PLUGIN_TYPE_DEVICE_PLUGIN: &str = "DevicePlugin";

/// `PluginInfo.type` of a CSI plugin.
pub const PLUGIN_TYPE_CSI: &str = "CSIPlugin";

/// `PluginInfo.type` of a DRA plugin.
pub const PLUGIN_TYPE_DRA: &str = "DRAPlugin";

/// How long the kubelet's plugin watcher gives `GetInfo`, in milliseconds.
pub const GET_INFO_TIMEOUT_MILLIS: u64 = 1_000;

/// How long the kubelet's plugin watcher gives `NotifyRegistrationStatus`, in seconds.
pub const NOTIFY_TIMEOUT_SECS: u64 = 5;

/// The kubelet's pod resources socket.
pub const POD_RESOURCES_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";

/// The kubelet's rate limit on the pod resources API, shared by every client (queries a second).
pub const POD_RESOURCES_QPS: u32 = 100;

/// The burst the kubelet's pod resources rate limit allows.
pub const POD_RESOURCES_BURST: u32 = 10;

/// The service names a DRA plugin lists in `PluginInfo.supported_versions`, newest first: the
/// kubelet takes the first one it supports. These are not the gRPC paths.
pub const DRA_SUPPORTED_VERSIONS: [&str; 2] = ["v1.DRAPlugin", "v1beta1.DRAPlugin"];

/// The names of the DRA device health service (`DRAResourceHealth`), newest first, that a DRA
/// plugin lists in `supported_versions` beside [`DRA_SUPPORTED_VERSIONS`] for each version it
/// serves: kubelets open the health stream only for plugins that list it, and a 1.37 kubelet
/// picks `v1` where both are listed (`v1alpha1` is read through 1.39; 1.34-1.36 know only it).
pub const DRA_HEALTH_SERVICES: [&str; 2] = ["v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"];

/// The kubelet's folder of plugin sockets; a DRA driver serves `<this>/<driver>/dra.sock`.
pub const PLUGINS_PATH: &str = "/var/lib/kubelet/plugins/";

/// The file name of a DRA driver's `DRAPlugin` socket in its folder under [`PLUGINS_PATH`].
pub const DRA_SOCKET_NAME: &str = "dra.sock";

/// How long the kubelet gives each `NodePrepareResources` / `NodeUnprepareResources`, in seconds.
pub const DRA_CALL_TIMEOUT_SECS: u64 = 45;

/// The folder of dynamic CDI spec files (the runtime also reads `/etc/cdi`, static ones).
pub const CDI_DYNAMIC_DIR: &str = "/var/run/cdi";
