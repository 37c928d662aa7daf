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

/// The CNI network: a bridge of our own, no masquerading, addresses from [`POD_SUBNET`].
pub fn cni_conflist() -> String {
    format!(
        r#"{{"cniVersion":"1.0.0","name":"devplug-test","plugins":[{{"type":"bridge","bridge":"{BRIDGE}","isGateway":true,"ipMasq":false,"ipam":{{"type":"host-local","ranges":[[{{"subnet":"{POD_SUBNET}"}}]]}}}},{{"type":"loopback"}}]}}"#
    )
}

/// The kubelet's configuration. Node status every second and ConfigMaps watched, so tests see
/// changes quickly; everything else as a node would have it.
pub fn kubelet_yaml(layout: &Layout) -> String {
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
        socket = layout.containerd_socket().display(),
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
