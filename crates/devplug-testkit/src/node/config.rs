//! The configuration files of the node's processes: what it took to run a kubelet on one machine
//! with only loopback addresses (see the module docs of [`super`]).

use super::{
    Layout, API_PORT, BRIDGE, CGROUP_ROOT, ETCD_PEER_PORT, ETCD_PORT, NODE_NAME, POD_SUBNET,
};
use std::path::Path;

/// The admin token in the API server's static token file (`system:masters`).
pub const ADMIN_TOKEN: &str = "devplug-node-admin";

/// A kubeconfig for `token` against the node's API server.
pub fn kubeconfig(ca: &Path, token: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: node\n  cluster:\n    server: https://127.0.0.1:{API_PORT}\n    certificate-authority: {}\nusers:\n- name: admin\n  user:\n    token: {token}\ncontexts:\n- name: node\n  context:\n    cluster: node\n    user: admin\ncurrent-context: node\n",
        ca.display()
    )
}

/// etcd's flags.
pub fn etcd_args(layout: &Layout) -> Vec<String> {
    vec![
        format!("--data-dir={}", layout.dir.join("etcd").display()),
        format!("--listen-client-urls=http://127.0.0.1:{ETCD_PORT}"),
        format!("--listen-peer-urls=http://127.0.0.1:{ETCD_PEER_PORT}"),
        "--unsafe-no-fsync".into(),
    ]
}

/// The feature gates of the node's control plane: Kubernetes 1.36's defaults and
/// `DRADeviceTaintRules`, which 1.37 turns on (an administrator's DeviceTaintRule: the API
/// server serves it, kube-scheduler heeds it, kube-controller-manager evicts for `NoExecute`).
pub const FEATURE_GATES: &str = "--feature-gates=DRADeviceTaintRules=true";

/// kube-apiserver's flags: Node and RBAC authorization and the default admission chain (the
/// controller-manager makes the `default` service accounts).
pub fn apiserver_args(layout: &Layout) -> Vec<String> {
    vec![
        FEATURE_GATES.into(),
        // DeviceTaintRule is served in resource.k8s.io/v1beta2, off by default in 1.36.
        "--runtime-config=resource.k8s.io/v1beta2=true".into(),
        "--bind-address=127.0.0.1".into(),
        "--advertise-address=127.0.0.1".into(),
        format!("--secure-port={API_PORT}"),
        format!("--cert-dir={}", layout.dir.join("certs").display()),
        format!("--etcd-servers=http://127.0.0.1:{ETCD_PORT}"),
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
        format!(
            "--service-account-key-file={}",
            layout.dir.join("sa.pub").display()
        ),
        format!(
            "--service-account-signing-key-file={}",
            layout.dir.join("sa.key").display()
        ),
        format!(
            "--token-auth-file={}",
            layout.dir.join("tokens.csv").display()
        ),
        "--authorization-mode=Node,RBAC".into(),
        "--service-cluster-ip-range=10.96.0.0/24".into(),
        "--allow-privileged=true".into(),
        // Otherwise it complains every 10 s that 127.0.0.1 is a loopback address.
        "--endpoint-reconciler-type=none".into(),
    ]
}

/// kube-controller-manager's flags: every controller but the cloud ones (DaemonSets, Jobs,
/// service accounts, the node lifecycle that lifts the not-ready taint, ResourceClaims from
/// templates).
pub fn controller_manager_args(layout: &Layout) -> Vec<String> {
    vec![
        FEATURE_GATES.into(),
        format!("--kubeconfig={}", layout.kubeconfig().display()),
        "--leader-elect=false".into(),
        "--bind-address=127.0.0.1".into(),
        "--secure-port=0".into(),
        format!("--root-ca-file={}", layout.ca().display()),
        format!(
            "--service-account-private-key-file={}",
            layout.dir.join("sa.key").display()
        ),
        "--use-service-account-credentials=false".into(),
        "--controllers=*,-cloud-node-lifecycle,-route,-service-lb-controller".into(),
    ]
}

/// kube-scheduler's flags.
pub fn scheduler_args(layout: &Layout) -> Vec<String> {
    vec![
        FEATURE_GATES.into(),
        format!("--kubeconfig={}", layout.kubeconfig().display()),
        "--leader-elect=false".into(),
        "--secure-port=0".into(),
    ]
}

/// containerd's configuration (version 2, migrated by containerd 2.x): its own root, state and
/// socket; the test image as the sandbox image; `restrict_oom_score_adj` (runc cannot lower
/// `oom_score_adj` in a VM without CAP_SYS_RESOURCE); cgroupfs; our CNI folder; network
/// namespaces under the state folder, so that every one it makes is ours to remove. CDI is on
/// by default in containerd 2.x, reading /etc/cdi and /var/run/cdi.
/// containerd 1.6 reads the same file (without CDI, which it lacks); it needs the runc
/// runtime's `runtime_type` spelled out once the table is there (2.x fills it in).
pub fn containerd_toml(
    layout: &Layout,
    root: &Path,
    state: &Path,
    sandbox_image: &str,
    cni_bin_dir: &str,
) -> String {
    format!(
        r#"version = 2
root = "{root}"
state = "{state}"
[grpc]
  address = "{socket}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{sandbox_image}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
    SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin_dir}"
    conf_dir = "{cni_conf}"
"#,
        root = root.display(),
        state = state.display(),
        socket = layout.containerd_socket().display(),
        cni_conf = layout.cni_conf_dir().display(),
    )
}

/// Where CRI-O keeps what it keeps, and what it runs.
pub struct CrioPaths<'a> {
    /// Its root: containers/storage's in `storage/`, its persistent files beside it.
    pub root: &'a Path,
    /// Its state (tmpfs on a real node): storage's run root, namespaces, exit files, socket.
    pub state: &'a Path,
    /// Its CRI socket.
    pub socket: &'a Path,
    /// CRI-O's namespace pinner (ships with it).
    pub pinns: &'a Path,
    /// The OCI runtime.
    pub runc: &'a Path,
    /// The container monitor CRI-O runs per container.
    pub conmon: &'a Path,
    /// The image signature policy (accept anything: the images are local).
    pub policy: &'a Path,
    /// The CNI configuration folder (the node's, shared with containerd).
    pub cni_conf: &'a Path,
    /// The CNI plugins' folder.
    pub cni_bin: &'a Path,
    /// The pause image, used only for pods that share a PID namespace (CRI-O drops the infra
    /// container otherwise).
    pub pause_image: &'a str,
}

/// CRI-O's configuration: everything it writes in its root and state (nothing under /var/lib,
/// /run or /etc of the machine but the CDI folders it reads, `/etc/cdi` and `/var/run/cdi`, its
/// default as on a node); storage `vfs`; cgroupfs, as the kubelet's; runc through conmon in
/// the pod's cgroup; our CNI folder; no NRI, metrics or irqbalance handling.
pub fn crio_conf(p: &CrioPaths<'_>) -> String {
    let root = p.root.display();
    let state = p.state.display();
    format!(
        r#"[crio]
root = "{root}/storage"
runroot = "{state}/storage"
storage_driver = "vfs"
log_dir = "{state}/logs"
version_file = "{state}/version"
version_file_persist = "{root}/version"
clean_shutdown_file = "{root}/clean.shutdown"

[crio.api]
listen = "{socket}"
stream_address = "127.0.0.1"
stream_port = "0"

[crio.runtime]
default_runtime = "runc"
cgroup_manager = "cgroupfs"
hooks_dir = ["{root}/hooks.d"]
container_exits_dir = "{state}/exits"
container_attach_socket_dir = "{state}/attach"
namespaces_dir = "{state}/ns"
pinns_path = "{pinns}"
decryption_keys_path = "{root}/keys"
irqbalance_config_file = ""
irqbalance_config_restore_file = "disable"
enable_criu_support = false

[crio.runtime.runtimes.runc]
runtime_path = "{runc}"
runtime_type = "oci"
runtime_root = "{state}/runc"
monitor_path = "{conmon}"
monitor_cgroup = "pod"

[crio.image]
namespaced_auth_dir = "{state}/auth"
signature_policy = "{policy}"
signature_policy_dir = "{root}/policies"
pause_image = "{pause_image}"

[crio.network]
network_dir = "{cni_conf}"
plugin_dirs = ["{cni_bin}"]

[crio.metrics]
enable_metrics = false

[crio.nri]
enable_nri = false
"#,
        socket = p.socket.display(),
        pinns = p.pinns.display(),
        runc = p.runc.display(),
        conmon = p.conmon.display(),
        policy = p.policy.display(),
        pause_image = p.pause_image,
        cni_conf = p.cni_conf.display(),
        cni_bin = p.cni_bin.display(),
    )
}

/// The CNI network: a bridge of our own, no masquerading, addresses from [`POD_SUBNET`].
pub fn cni_conflist() -> String {
    format!(
        r#"{{"cniVersion":"1.0.0","name":"devplug-test","plugins":[{{"type":"bridge","bridge":"{BRIDGE}","isGateway":true,"ipMasq":false,"ipam":{{"type":"host-local","ranges":[[{{"subnet":"{POD_SUBNET}"}}]]}}}},{{"type":"loopback"}}]}}"#
    )
}

/// The kubelet's configuration, on the runtime at `runtime_socket`. Node status every second
/// and ConfigMaps watched, so tests see changes quickly; everything else as a node would have
/// it.
pub fn kubelet_yaml(layout: &Layout, runtime_socket: &Path) -> String {
    format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
cgroupRoot: /{CGROUP_ROOT}
failSwapOn: false
failCgroupV1: false
evictionHard: {{}}
localStorageCapacityIsolation: false
address: 127.0.0.1
healthzBindAddress: 127.0.0.1
healthzPort: 0
readOnlyPort: 0
authentication:
  anonymous:
    enabled: true
  webhook:
    enabled: false
authorization:
  mode: AlwaysAllow
resolvConf: ""
podLogsDir: {logs}
containerRuntimeEndpoint: unix://{socket}
nodeStatusUpdateFrequency: 1s
syncFrequency: 10s
configMapAndSecretChangeDetectionStrategy: Watch
"#,
        logs = layout.pod_logs().display(),
        socket = runtime_socket.display(),
    )
}

/// The kubelet's flags.
pub fn kubelet_args(layout: &Layout) -> Vec<String> {
    vec![
        format!("--config={}", layout.dir.join("kubelet.yaml").display()),
        format!("--kubeconfig={}", layout.kubeconfig().display()),
        format!("--root-dir={}", super::KUBELET_ROOT),
        format!("--cert-dir={}", layout.dir.join("kubelet-certs").display()),
        format!("--hostname-override={NODE_NAME}"),
        "--node-ip=127.0.0.1".into(),
    ]
}
