//! A whole single-node Kubernetes cluster on this machine, for tests of what a pod really gets.
//!
//! [`Node::start`] runs etcd, kube-apiserver (Node and RBAC authorization, the default admission
//! chain), kube-controller-manager, kube-scheduler, containerd (runc, CNI bridge, CDI on) and a
//! kubelet that registers its Node through the API server, imports devplug's image and a small
//! busybox image into containerd (no registry is reachable), and waits until the Node is Ready.
//! A scenario can switch the node to another containerd or to CRI-O and back
//! ([`Node::switch_containerd`], [`Node::switch_to_crio`]; the module `runtime`).
//! [`Node::stop`] undoes all of it; so does a reaper process if the test binary dies first, and
//! the next start if even that was killed (see [`cleanup`]).
//!
//! What it took to run a node on one machine without a network:
//! - Only loopback addresses and the network namespaces containerd makes. The kubelet refuses a
//!   loopback node IP, so the Node has no address: `kubectl logs`/`exec` cannot reach it, and
//!   tests read containers' output from the kubelet's pod log folder ([`Node::container_log`]).
//! - No kube-proxy: a pod reaches the API server only on the host network, with
//!   `KUBERNETES_SERVICE_HOST=127.0.0.1` and `KUBERNETES_SERVICE_PORT=6443` in its env. The API
//!   server listens on the fixed port [`API_PORT`] for that reason.
//! - cgroup v1 needs a cgroup root of our own ([`CGROUP_ROOT`]); runc cannot lower
//!   `oom_score_adj` in a VM without CAP_SYS_RESOURCE (`restrict_oom_score_adj`).
//! - The kubelet's root is `/var/lib/kubelet`, as on a real node and as devplug's manifests
//!   expect; a marker file there says it is ours. The tests refuse to run where that folder
//!   exists without the marker: that machine is a real node.
//!
//! Requirements and where to get them: [`requirements::find`].

pub mod cleanup;
pub mod config;
mod containerd;
mod crio;
pub mod image;
mod logs;
pub mod requirements;
mod runtime;

pub use logs::cri_log_text;
pub use requirements::Requirements;

use containerd::Containerd;
use runtime::Runtime;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The kubelet's root folder (its device-plugins/ folder is fixed below it).
pub const KUBELET_ROOT: &str = "/var/lib/kubelet";
/// The file in [`KUBELET_ROOT`] that says the tests made it.
pub const MARKER: &str = ".devplug-test-node";
/// The Node's name.
pub const NODE_NAME: &str = "devplug-node";
/// kube-apiserver's port on 127.0.0.1 (fixed: host-network pods are told it in their env).
pub const API_PORT: u16 = 6443;
/// etcd's client port on 127.0.0.1.
pub const ETCD_PORT: u16 = 2379;
/// etcd's peer port on 127.0.0.1.
pub const ETCD_PEER_PORT: u16 = 2380;
/// The CNI bridge's name.
pub const BRIDGE: &str = "devplugtest0";
/// The pods' addresses, on [`BRIDGE`] only.
pub const POD_SUBNET: &str = "10.244.77.0/24";
/// The pod network's gateway: [`BRIDGE`]'s address on the host, once a pod on the pod network
/// made it.
pub const POD_GATEWAY: &str = "10.244.77.1";
/// The kubelet's cgroup root, made in every hierarchy.
pub const CGROUP_ROOT: &str = "devplug-test";
/// The node's folder: configs, certificates, etcd's data, containerd's root and state, logs.
pub const NODE_DIR: &str = "/var/tmp/devplug-test-node";

/// Where the node keeps its files.
#[derive(Debug, Clone)]
pub struct Layout {
    /// The node's folder.
    pub dir: PathBuf,
}

impl Layout {
    /// The admin kubeconfig.
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.join("kubeconfig")
    }
    /// The API server's serving certificate (self-signed, its own CA).
    pub fn ca(&self) -> PathBuf {
        self.dir.join("certs/apiserver.crt")
    }
    /// containerd's socket.
    pub fn containerd_socket(&self) -> PathBuf {
        self.dir.join("containerd.sock")
    }
    /// The folder of a runtime's root and state: `containerd` for the node's own, another name
    /// for each other runtime the node switched to ([`Node::switch_containerd`],
    /// [`Node::switch_to_crio`]), so
    /// that two versions never share a metadata database.
    pub fn runtime_files(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
    /// The CNI configuration folder.
    pub fn cni_conf_dir(&self) -> PathBuf {
        self.dir.join("cni")
    }
    /// The kubelet's pod log folder: `<namespace>_<pod>_<uid>/<container>/<restart>.log`.
    pub fn pod_logs(&self) -> PathBuf {
        self.dir.join("pod-logs")
    }
    /// The processes' own logs.
    pub fn logs(&self) -> PathBuf {
        self.dir.join("logs")
    }
    fn pid_file(&self, name: &str) -> PathBuf {
        self.dir.join("pids").join(name)
    }
    fn cleanup_script(&self) -> PathBuf {
        self.dir.join("cleanup.sh")
    }
    /// A list of files the tests made outside the node's folder, removed by the cleanup.
    pub fn made_files(&self) -> PathBuf {
        self.dir.join("cdi-specs-made")
    }
}

/// How long the node took to come up, for the benchmarks page.
#[derive(Debug, Clone, Copy)]
pub struct StartTimes {
    /// etcd and the API server started → `/readyz` ok.
    pub api_server: Duration,
    /// The kubelet started → Node Ready (not-ready taint gone).
    pub kubelet_to_ready: Duration,
    /// The whole start, images included.
    pub total: Duration,
}

/// A running node. Stop it with [`Node::stop`].
#[derive(Debug)]
pub struct Node {
    /// What the node was made from.
    pub requirements: Requirements,
    /// Its files.
    pub layout: Layout,
    /// How long the start took.
    pub start_times: StartTimes,
    processes: Mutex<BTreeMap<&'static str, Child>>,
    reaper: Mutex<Option<Child>>,
    runtime: Mutex<Runtime>,
}

fn fail(what: &str, err: impl std::fmt::Display) -> String {
    format!("{what}: {err}")
}

fn write(path: &Path, text: impl AsRef<[u8]>) -> Result<(), String> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| fail(&parent.display().to_string(), e))?;
    }
    std::fs::write(path, text).map_err(|e| fail(&path.display().to_string(), e))
}

/// Makes [`CGROUP_ROOT`] in every mounted hierarchy (v1 controllers, named ones, and v2).
fn make_cgroup_roots() -> Result<(), String> {
    let mut roots = vec![PathBuf::from("/sys/fs/cgroup")];
    if let Ok(entries) = std::fs::read_dir("/sys/fs/cgroup") {
        roots.extend(entries.flatten().map(|e| e.path()));
    }
    for root in roots {
        if root.join("cgroup.procs").is_file() {
            let ours = root.join(CGROUP_ROOT);
            std::fs::create_dir_all(&ours).map_err(|e| fail(&ours.display().to_string(), e))?;
        }
    }
    Ok(())
}

impl Node {
    /// Starts the node (cleaning up first what a killed run left behind) and waits until its
    /// Node is Ready.
    pub async fn start(requirements: Requirements) -> Result<Node, String> {
        let started = Instant::now();
        let layout = Layout {
            dir: PathBuf::from(NODE_DIR),
        };
        // A run killed with its reaper leaves its script behind: run it, then ours.
        if layout.cleanup_script().is_file() {
            cleanup::run(&layout.cleanup_script())?;
        }
        write(&layout.cleanup_script(), cleanup::script(&layout))?;
        cleanup::run(&layout.cleanup_script())?;
        write(&layout.cleanup_script(), cleanup::script(&layout))?;
        let reaper = cleanup::reaper(&layout.cleanup_script())?;
        let containerd = Containerd {
            bin_dir: requirements.assets.clone(),
            files: layout.runtime_files("containerd"),
        };
        let node = Node {
            requirements,
            layout,
            start_times: StartTimes {
                api_server: Duration::ZERO,
                kubelet_to_ready: Duration::ZERO,
                total: Duration::ZERO,
            },
            processes: Mutex::new(BTreeMap::new()),
            reaper: Mutex::new(Some(reaper)),
            runtime: Mutex::new(Runtime::Containerd(containerd)),
        };
        match node.bring_up(started).await {
            Ok(times) => Ok(Node {
                start_times: times,
                ..node
            }),
            Err(err) => {
                let logs = node.keep_logs("start");
                node.stop();
                Err(format!("{err} (logs kept in {})", logs.display()))
            }
        }
    }

    async fn bring_up(&self, started: Instant) -> Result<StartTimes, String> {
        let layout = &self.layout;
        let assets = self.requirements.assets.clone();
        for sub in ["pids", "logs", "certs", "etcd", "kubelet-certs"] {
            let d = layout.dir.join(sub);
            std::fs::create_dir_all(&d).map_err(|e| fail(&d.display().to_string(), e))?;
        }
        write(
            &Path::new(KUBELET_ROOT).join(MARKER),
            "made by devplug's whole-node tests\n",
        )?;
        write(&layout.made_files(), "")?;
        make_cgroup_roots()?;
        let (private_key, public_key) = crate::api_server::service_account_keys()?;
        write(&layout.dir.join("sa.key"), private_key)?;
        write(&layout.dir.join("sa.pub"), public_key)?;
        write(
            &layout.dir.join("tokens.csv"),
            format!("{},admin,admin,system:masters\n", config::ADMIN_TOKEN),
        )?;
        write(
            &layout.kubeconfig(),
            config::kubeconfig(&layout.ca(), config::ADMIN_TOKEN),
        )?;

        let api_started = Instant::now();
        self.spawn("etcd", &assets.join("etcd"), &config::etcd_args(layout))?;
        self.spawn(
            "kube-apiserver",
            &assets.join("kube-apiserver"),
            &config::apiserver_args(layout),
        )?;
        self.wait_api_ready().await?;
        let api_server = api_started.elapsed();
        self.spawn(
            "kube-controller-manager",
            &assets.join("kube-controller-manager"),
            &config::controller_manager_args(layout),
        )?;
        self.spawn(
            "kube-scheduler",
            &assets.join("kube-scheduler"),
            &config::scheduler_args(layout),
        )?;

        write(
            &layout.cni_conf_dir().join("10-devplug-test.conflist"),
            config::cni_conflist(),
        )?;
        write(
            &layout.dir.join("busybox.oci.tar"),
            image::busybox_archive(&self.requirements.busybox)?,
        )?;
        self.start_runtime().await?;

        let kubelet_started = Instant::now();
        self.start_kubelet()?;
        self.wait_node_ready(Duration::from_secs(90)).await?;
        Ok(StartTimes {
            api_server,
            kubelet_to_ready: kubelet_started.elapsed(),
            total: started.elapsed(),
        })
    }

    fn spawn(&self, name: &'static str, binary: &Path, args: &[String]) -> Result<(), String> {
        let log_path = self.layout.logs().join(format!("{name}.log"));
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| fail(&log_path.display().to_string(), e))?;
        let err = log.try_clone().map_err(|e| fail("log", e))?;
        // The running runtime's folder first, then the node's: containerd finds its shim in
        // PATH.
        let path = std::env::var("PATH").unwrap_or_default();
        let child = Command::new(binary)
            .args(args)
            .env(
                "PATH",
                format!(
                    "{}:{}:{path}",
                    self.runtime()?.bin_dir().display(),
                    self.requirements.assets.display()
                ),
            )
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .map_err(|e| fail(&format!("cannot run {}", binary.display()), e))?;
        write(&self.layout.pid_file(name), child.id().to_string())?;
        let old = self
            .processes
            .lock()
            .map_err(|_| "the process table's lock is poisoned".to_owned())?
            .insert(name, child);
        if let Some(mut old) = old {
            let _ = old.kill();
            let _ = old.wait();
        }
        Ok(())
    }

    /// Stops the process `name` (SIGTERM, SIGKILL after `grace`, or SIGKILL at once when `grace`
    /// is zero) and waits for it.
    fn stop_process(&self, name: &str, grace: Duration) -> Result<(), String> {
        let child = self
            .processes
            .lock()
            .map_err(|_| "the process table's lock is poisoned".to_owned())?
            .remove(name);
        let Some(mut child) = child else {
            return Ok(());
        };
        if !grace.is_zero() {
            let _ = Command::new("kill")
                .arg(child.id().to_string())
                .stdin(Stdio::null())
                .status();
            let deadline = Instant::now() + grace;
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = child.kill();
        let _ = child.wait();
        let _ = std::fs::remove_file(self.layout.pid_file(name));
        Ok(())
    }

    /// Starts a host process the node's cleanup stops (e.g. devplug run as a host service),
    /// logging to `logs/<name>.log`. Its command line must name the node's folder (a config
    /// file there will do): the cleanup signals only such processes.
    pub fn start_host_process(
        &self,
        name: &'static str,
        binary: &Path,
        args: &[String],
    ) -> Result<(), String> {
        self.spawn(name, binary, args)
    }

    /// Stops a process started by [`Node::start_host_process`] (SIGTERM, SIGKILL after 5 s).
    pub fn stop_host_process(&self, name: &str) -> Result<(), String> {
        self.stop_process(name, Duration::from_secs(5))
    }

    /// Whether kube-scheduler is still running (it exits on a panic).
    pub fn scheduler_running(&self) -> bool {
        self.process_running("kube-scheduler")
    }

    /// Stops kube-scheduler (if it still runs) and starts it again.
    pub fn restart_scheduler(&self) -> Result<(), String> {
        self.stop_process("kube-scheduler", Duration::from_secs(5))?;
        self.spawn(
            "kube-scheduler",
            &self.requirements.assets.join("kube-scheduler"),
            &config::scheduler_args(&self.layout),
        )
    }

    /// Whether the process `name` the node started still runs.
    fn process_running(&self, name: &str) -> bool {
        self.processes
            .lock()
            .ok()
            .and_then(|mut table| {
                table
                    .get_mut(name)
                    .map(|c| matches!(c.try_wait(), Ok(None)))
            })
            .unwrap_or(false)
    }

    /// Starts the kubelet (after [`Node::stop_kubelet`]) on the runtime the node runs now.
    pub fn start_kubelet(&self) -> Result<(), String> {
        write(
            &self.layout.dir.join("kubelet.yaml"),
            config::kubelet_yaml(&self.layout, &self.runtime_socket()?),
        )?;
        self.spawn(
            "kubelet",
            &self.requirements.assets.join("kubelet"),
            &config::kubelet_args(&self.layout),
        )
    }

    /// Stops the kubelet as its service manager would (SIGTERM, then SIGKILL after 10 s).
    pub fn stop_kubelet(&self) -> Result<(), String> {
        self.stop_process("kubelet", Duration::from_secs(10))
    }

    /// Runs kubectl with the admin kubeconfig, `stdin` as its input; its stdout, or an error
    /// with its stderr.
    pub fn kubectl(&self, args: &[&str], stdin: Option<&str>) -> Result<String, String> {
        use std::io::Write;
        let mut child = Command::new(&self.requirements.kubectl)
            .arg("--kubeconfig")
            .arg(self.layout.kubeconfig())
            .args(args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| fail("kubectl", e))?;
        if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
            pipe.write_all(text.as_bytes())
                .map_err(|e| fail("kubectl stdin", e))?;
        }
        let output = child.wait_with_output().map_err(|e| fail("kubectl", e))?;
        if output.status.success() {
            Ok(String::from_utf8_lossy(&output.stdout).into_owned())
        } else {
            Err(format!(
                "kubectl {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&output.stderr).trim()
            ))
        }
    }

    /// An admin client of the node's API server (for the calling runtime).
    pub async fn client(&self) -> Result<kube::Client, String> {
        crate::api_server::client(&self.layout.kubeconfig()).await
    }

    async fn wait_api_ready(&self) -> Result<(), String> {
        crate::api_server::wait_ready_async(&self.layout.kubeconfig(), &self.layout.ca()).await
    }

    /// Waits until the Node is Ready and carries no not-ready taint.
    pub async fn wait_node_ready(&self, timeout: Duration) -> Result<(), String> {
        use k8s_openapi::api::core::v1::Node as KubeNode;
        let client = self.client().await?;
        let nodes: kube::Api<KubeNode> = kube::Api::all(client);
        let ready = |node: Option<&KubeNode>| {
            let Some(node) = node else { return false };
            let ready = node
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            let tainted = node
                .spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .is_some_and(|t| t.iter().any(|t| t.key.starts_with("node.kubernetes.io/")));
            ready && !tainted
        };
        let waited = tokio::time::timeout(
            timeout,
            kube::runtime::wait::await_condition(nodes, NODE_NAME, ready),
        )
        .await;
        match waited {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(err)) => Err(format!("waiting for the Node: {err}")),
            Err(_) => Err(format!(
                "the Node was not Ready in {timeout:?} (kubelet log: {})",
                self.layout.logs().join("kubelet.log").display()
            )),
        }
    }

    /// Makes a character device node `/dev/devplug-test-<n>` (the numbers of /dev/null), for
    /// the host device backend; the cleanup removes it.
    pub fn make_test_device(&self, n: u32) -> Result<PathBuf, String> {
        let path = PathBuf::from(format!("{}{n}", cleanup::TEST_DEVICE_PREFIX));
        if !path.exists() {
            make_null_device(&path)?;
        }
        Ok(path)
    }

    /// Records a file made outside the node's folder (a CDI spec, a host folder) for the
    /// cleanup to remove.
    pub fn remember_made_file(&self, path: &Path) -> Result<(), String> {
        use std::io::Write;
        let mut list = std::fs::OpenOptions::new()
            .append(true)
            .open(self.layout.made_files())
            .map_err(|e| fail("made files", e))?;
        writeln!(list, "{}", path.display()).map_err(|e| fail("made files", e))
    }

    /// Stops everything and removes every file, mount, cgroup and link the node made.
    pub fn stop(&self) {
        let names: Vec<&'static str> = cleanup::STOP_ORDER.to_vec();
        for name in names {
            let _ = self.stop_process(name, Duration::from_secs(5));
        }
        let _ = cleanup::run(&self.layout.cleanup_script());
        if let Ok(mut reaper) = self.reaper.lock() {
            if let Some(mut reaper) = reaper.take() {
                let _ = reaper.kill();
                let _ = reaper.wait();
            }
        }
    }
}

/// Makes a character device at `path` that is `/dev/null` (1:3): a device node the runtime
/// accepts where a test needs one. Needs root.
pub fn make_null_device(path: &Path) -> Result<(), String> {
    let status = Command::new("mknod")
        .arg(path)
        .args(["c", "1", "3"])
        .status()
        .map_err(|e| fail("mknod", e))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("mknod {}: {status}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cleanup_script_names_only_the_nodes_own_things() {
        let layout = Layout {
            dir: PathBuf::from(NODE_DIR),
        };
        let script = cleanup::script(&layout);
        assert!(script.contains(&format!("ip link delete {BRIDGE}")));
        assert!(script.contains(&format!("'{KUBELET_ROOT}/{MARKER}'")));
        assert!(script.contains("grep -qF \"$dir\""), "{script}");
        for line in script.lines().filter(|l| l.contains("rm -rf")) {
            assert!(
                line.contains("\"$dir\"")
                    || line.contains("devplug-test")
                    || line.contains(KUBELET_ROOT)
                    // The files the tests listed as made (Node::remember_made_file).
                    || line.contains("done < \"$spec\""),
                "removes something not the node's: {line}"
            );
        }
    }
}
