//! The node's container runtime: which one runs now (containerd or CRI-O), its socket for the
//! kubelet, the test images in it, and what replaces or restarts it (a switch to another
//! runtime, a reboot).

use super::containerd::Containerd;
use super::crio::{crio_image_names, Crio};
use super::{fail, Node, BRIDGE, CGROUP_ROOT, KUBELET_ROOT, NODE_NAME};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The runtime the node runs now.
#[derive(Debug, Clone)]
pub(super) enum Runtime {
    Containerd(Containerd),
    Crio(Crio),
}

impl Runtime {
    /// Its name as the kubelet reports it (`status.nodeInfo.containerRuntimeVersion` is
    /// `<name>://<version>`).
    pub(super) fn name(&self) -> &'static str {
        match self {
            Runtime::Containerd(_) => "containerd",
            Runtime::Crio(_) => "cri-o",
        }
    }
    /// How long it gets between SIGTERM and SIGKILL when the node powers off: CRI-O notes its
    /// clean shutdown (without it, it wipes its storage at the next start); containerd is
    /// killed at once, as the node's reboots always did.
    fn stop_grace(&self) -> Duration {
        match self {
            Runtime::Containerd(_) => Duration::ZERO,
            Runtime::Crio(_) => Duration::from_secs(10),
        }
    }
    /// The name of its process in the node's process table (and its PID file).
    pub(super) fn process(&self) -> &'static str {
        match self {
            Runtime::Containerd(_) => "containerd",
            Runtime::Crio(_) => "crio",
        }
    }
    /// The folder of its binaries (first in the PATH of the processes the node starts).
    pub(super) fn bin_dir(&self) -> &Path {
        match self {
            Runtime::Containerd(c) => &c.bin_dir,
            Runtime::Crio(c) => &c.bin_dir,
        }
    }
    /// Its CRI socket.
    pub(super) fn socket(&self, layout: &super::Layout) -> PathBuf {
        match self {
            Runtime::Containerd(_) => layout.containerd_socket(),
            Runtime::Crio(c) => c.socket(),
        }
    }
    /// Its root: made on its first start, kept across reboots.
    fn root(&self) -> PathBuf {
        match self {
            Runtime::Containerd(c) => c.root(),
            Runtime::Crio(c) => c.root(),
        }
    }
    /// What lives on tmpfs on a real node: a reboot empties it.
    fn state(&self) -> PathBuf {
        match self {
            Runtime::Containerd(c) => c.state(),
            Runtime::Crio(c) => c.state(),
        }
    }
}

impl Node {
    /// The runtime the node runs now.
    pub(super) fn runtime(&self) -> Result<Runtime, String> {
        self.runtime
            .lock()
            .map(|c| c.clone())
            .map_err(|_| "the runtime record's lock is poisoned".to_owned())
    }

    /// The name of the runtime the node runs now (`containerd` or `cri-o`).
    pub fn runtime_name(&self) -> Result<&'static str, String> {
        self.runtime().map(|r| r.name())
    }

    /// The socket of the runtime the node runs now.
    pub fn runtime_socket(&self) -> Result<PathBuf, String> {
        Ok(self.runtime()?.socket(&self.layout))
    }

    /// Starts the runtime of [`Node::runtime`]; a fresh one gets the test images (CRI-O's
    /// before it starts, containerd's after).
    pub(super) async fn start_runtime(&self) -> Result<(), String> {
        let runtime = self.runtime()?;
        let fresh = !runtime.root().exists();
        match &runtime {
            Runtime::Containerd(containerd) => {
                self.start_containerd(containerd).await?;
                if fresh {
                    self.import_containerd_images()?;
                }
            }
            Runtime::Crio(crio) => {
                if fresh {
                    self.import_crio_images(crio)?;
                }
                self.start_crio(crio).await?;
            }
        }
        Ok(())
    }

    /// Gives image `source` the name `name` too. containerd tags it; CRI-O's storage was filled
    /// before it started, with every name the scenarios use (refused otherwise).
    pub fn tag_image(&self, source: &str, name: &str) -> Result<(), String> {
        match self.runtime()? {
            Runtime::Containerd(_) => self
                .ctr(&["images", "tag", "--force", source, name])
                .map(drop),
            Runtime::Crio(_) => {
                if crio_image_names().iter().any(|(_, n)| n == name) {
                    Ok(())
                } else {
                    Err(format!(
                        "{name}: not among the names CRI-O's storage was given before it \
                         started (devplug_testkit::node::crio)"
                    ))
                }
            }
        }
    }

    /// A node reboot, as far as one machine can have one: the kubelet and the runtime die with
    /// every container, and what lives on tmpfs on a real node is gone (the runtime's state,
    /// the pods' network namespaces and the bridge); the kubelet's root, the runtime's root,
    /// etcd and the API server stay. The kubelet is killed, CRI-O stopped as a service manager
    /// stops it (SIGTERM: it notes its clean shutdown), containerd killed. Then the runtime and the
    /// kubelet start again, in that order, as their service units do. `between` runs while the
    /// node is down (e.g. to start a host service before the kubelet).
    pub async fn reboot(&self, between: impl FnOnce() -> Result<(), String>) -> Result<(), String> {
        self.power_off()?;
        between()?;
        self.start_runtime().await?;
        self.start_kubelet()
    }

    /// Replaces the node's containerd as an operator would (drain aside): the kubelet and the
    /// runtime stop with every container, the containerd whose `containerd`,
    /// `containerd-shim-runc-v2` and `ctr` are in `bin_dir` starts with a root and state of its
    /// own (`files_name` under the node's folder; `None`: back to the node's own containerd),
    /// gets the test images, and the kubelet starts again and reports the new runtime in its
    /// Node's `status.nodeInfo.containerRuntimeVersion`, which this waits for.
    pub async fn switch_containerd(&self, other: Option<(&Path, &str)>) -> Result<String, String> {
        let next = match other {
            Some((bin_dir, files_name)) => Containerd {
                bin_dir: bin_dir.to_path_buf(),
                files: self.layout.runtime_files(files_name),
            },
            None => Containerd {
                bin_dir: self.requirements.assets.clone(),
                files: self.layout.runtime_files("containerd"),
            },
        };
        self.switch_runtime(Runtime::Containerd(next)).await
    }

    /// Replaces the node's runtime by CRI-O ([`super::requirements::crio`]) as
    /// [`Node::switch_containerd`] does; back with `switch_containerd(None)`.
    pub async fn switch_to_crio(&self) -> Result<String, String> {
        let crio = self.crio_runtime()?;
        self.switch_runtime(crio).await
    }

    async fn switch_runtime(&self, next: Runtime) -> Result<String, String> {
        self.power_off()?;
        let name = next.name();
        *self
            .runtime
            .lock()
            .map_err(|_| "the runtime record's lock is poisoned".to_owned())? = next;
        self.start_runtime().await?;
        // `ctr` says `1.6.20~ds1` where the CRI says `1.6.20`: the release numbers must agree.
        let release = |v: &str| -> String {
            v.split("://")
                .last()
                .unwrap_or_default()
                .trim_start_matches('v')
                .chars()
                .take_while(|c| c.is_ascii_digit() || *c == '.')
                .collect()
        };
        let wanted = match name {
            "containerd" => Some(release(&self.ctr_version()?)),
            _ => None,
        };
        self.start_kubelet()?;
        self.wait_node_ready(Duration::from_secs(90)).await?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let reported = self.kubectl(
                &[
                    "get",
                    "node",
                    NODE_NAME,
                    "-o",
                    "jsonpath={.status.nodeInfo.containerRuntimeVersion}",
                ],
                None,
            )?;
            let same_release = wanted.as_ref().is_none_or(|w| release(&reported) == *w);
            if reported.starts_with(&format!("{name}://")) && same_release {
                return Ok(reported);
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "the Node reports runtime {reported:?} 30 s after the kubelet started on \
                     {name} {}",
                    wanted.unwrap_or_default()
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The kubelet killed, the runtime stopped ([`Runtime::stop_grace`]) and every
    /// container killed; what lives on tmpfs on a real node removed (the runtime's state, the
    /// pods' network namespaces, the bridge).
    fn power_off(&self) -> Result<(), String> {
        let runtime = self.runtime()?;
        self.stop_process("kubelet", Duration::ZERO)?;
        self.stop_process(runtime.process(), runtime.stop_grace())?;
        // Every container, shim and conmon of this node, then what they had mounted.
        let script = format!(
            "for round in 1 2 3; do \
               for procs in $(find /sys/fs/cgroup -path '*/{CGROUP_ROOT}/*' -name cgroup.procs); do \
                 for pid in $(cat \"$procs\"); do kill -9 \"$pid\" 2>/dev/null; done; done; \
               pkill -9 -f '[c]ontainerd-shim-runc-v2 .*{socket}'; \
               pkill -9 -f '[c]onmon .*{dir}'; sleep 0.2; done; \
             awk '{{print $5}}' /proc/self/mountinfo | grep -E '^({state}|{KUBELET_ROOT}/pods)/' \
               | sort -r | while read -r m; do umount \"$m\" 2>/dev/null || umount -l \"$m\"; done; \
             rm -rf '{state}'; ip link delete {BRIDGE} 2>/dev/null; true",
            socket = self.layout.containerd_socket().display(),
            dir = self.layout.dir.display(),
            state = runtime.state().display(),
        );
        let status = Command::new("sh")
            .arg("-c")
            .arg(&script)
            .stdin(Stdio::null())
            .status()
            .map_err(|e| fail("power off", e))?;
        if status.success() {
            Ok(())
        } else {
            Err(format!(
                "power off: tearing down the containers failed: {status}"
            ))
        }
    }
}
