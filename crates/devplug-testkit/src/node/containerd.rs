//! The node's container runtime: which containerd runs now (its binaries, root and state),
//! starting it, the test images in it, `ctr`, and what replaces or restarts it (a switch to
//! another containerd, a reboot).

use super::{
    config, fail, image, requirements, write, Node, BRIDGE, CGROUP_ROOT, KUBELET_ROOT, NODE_NAME,
};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The containerd the node runs now.
#[derive(Debug, Clone)]
pub(super) struct Containerd {
    /// The folder of its `containerd`, `containerd-shim-runc-v2` and `ctr`.
    pub(super) bin_dir: PathBuf,
    /// The folder of its root and state ([`super::Layout::containerd_files`]).
    pub(super) files: PathBuf,
}

impl Containerd {
    fn root(&self) -> PathBuf {
        self.files.join("root")
    }
    /// tmpfs on a real node: a reboot empties it.
    fn state(&self) -> PathBuf {
        self.files.join("state")
    }
    fn config(&self) -> PathBuf {
        self.files.join("containerd.toml")
    }
}

impl Node {
    /// The containerd the node runs now.
    pub(super) fn containerd(&self) -> Result<Containerd, String> {
        self.containerd
            .lock()
            .map(|c| c.clone())
            .map_err(|_| "the containerd record's lock is poisoned".to_owned())
    }

    /// The test image and devplug's into the running containerd.
    pub(super) fn import_images(&self) -> Result<(), String> {
        self.import_image(&self.layout.dir.join("busybox.oci.tar"), &[])?;
        let archive = self.requirements.image_archive.clone();
        let version = env!("CARGO_PKG_VERSION");
        // The chart's and the kustomize base's name (docker.io/library/ once normalized), and
        // the registry overlay's.
        self.import_image(
            &archive,
            &[
                format!("docker.io/library/devplug:{version}"),
                format!("registry.example.com/devplug:{version}"),
            ],
        )
    }

    /// Starts the containerd of [`Node::containerd`], its config written first.
    pub(super) async fn start_containerd(&self) -> Result<(), String> {
        let containerd = self.containerd()?;
        write(
            &containerd.config(),
            config::containerd_toml(
                &self.layout,
                &containerd.root(),
                &containerd.state(),
                image::BUSYBOX_IMAGE,
                requirements::CNI_BIN_DIR,
            ),
        )?;
        let socket = self.layout.containerd_socket();
        let _ = std::fs::remove_file(&socket);
        self.spawn(
            "containerd",
            &containerd.bin_dir.join("containerd"),
            &[format!("--config={}", containerd.config().display())],
        )?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if socket.exists() && self.ctr(&["version"]).is_ok() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(format!(
            "containerd did not answer on {} in 30 s",
            socket.display()
        ))
    }

    /// A node reboot, as far as one machine can have one: the kubelet and containerd die with
    /// every container, and what lives on tmpfs on a real node is gone (containerd's state, the
    /// pods' network namespaces and the bridge); the kubelet's root, containerd's root, etcd
    /// and the API server stay. Then containerd and the kubelet start again, in that order, as
    /// their service units do. `between` runs while the node is down (e.g. to start a host
    /// service before the kubelet).
    pub async fn reboot(&self, between: impl FnOnce() -> Result<(), String>) -> Result<(), String> {
        self.power_off()?;
        between()?;
        self.start_containerd().await?;
        self.start_kubelet()
    }

    /// Replaces the node's container runtime as an operator would (drain aside): the kubelet
    /// and containerd stop with every container, the containerd whose `containerd`,
    /// `containerd-shim-runc-v2` and `ctr` are in `bin_dir` starts with a root and state of its
    /// own (`files_name` under the node's folder; `None`: back to the node's own containerd),
    /// gets the test images, and the kubelet starts again and reports the new runtime in its
    /// Node's `status.nodeInfo.containerRuntimeVersion`, which this waits for.
    pub async fn switch_containerd(&self, other: Option<(&Path, &str)>) -> Result<String, String> {
        let next = match other {
            Some((bin_dir, files_name)) => Containerd {
                bin_dir: bin_dir.to_path_buf(),
                files: self.layout.containerd_files(files_name),
            },
            None => Containerd {
                bin_dir: self.requirements.assets.clone(),
                files: self.layout.containerd_files("containerd"),
            },
        };
        self.power_off()?;
        let fresh = !next.root().exists();
        *self
            .containerd
            .lock()
            .map_err(|_| "the containerd record's lock is poisoned".to_owned())? = next;
        self.start_containerd().await?;
        if fresh {
            self.import_images()?;
        }
        // `ctr` says `1.6.20~ds1` where the CRI says `1.6.20`: the release numbers must agree.
        let release = |v: &str| -> String {
            v.trim_start_matches("containerd://")
                .trim_start_matches('v')
                .chars()
                .take_while(|c| c.is_ascii_digit() || *c == '.')
                .collect()
        };
        let wanted = release(&self.ctr_version()?);
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
            if reported.starts_with("containerd://") && release(&reported) == wanted {
                return Ok(reported);
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "the Node reports runtime {reported:?} 30 s after the kubelet started on \
                     containerd {wanted}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The running containerd's version, as the CRI reports it.
    fn ctr_version(&self) -> Result<String, String> {
        let out = self.ctr(&["version"])?;
        let server = out.split("Server:").nth(1).unwrap_or_default();
        server
            .lines()
            .find_map(|l| l.trim().strip_prefix("Version:"))
            .map(|v| v.trim().to_owned())
            .ok_or_else(|| format!("no server version in `ctr version`: {out}"))
    }

    /// The kubelet and containerd killed with every container; what lives on tmpfs on a real
    /// node removed (containerd's state, the pods' network namespaces, the bridge).
    fn power_off(&self) -> Result<(), String> {
        self.stop_process("kubelet", Duration::ZERO)?;
        self.stop_process("containerd", Duration::ZERO)?;
        // Every container and shim of this node, then what they had mounted.
        let script = format!(
            "for round in 1 2 3; do \
               for procs in $(find /sys/fs/cgroup -path '*/{CGROUP_ROOT}/*' -name cgroup.procs); do \
                 for pid in $(cat \"$procs\"); do kill -9 \"$pid\" 2>/dev/null; done; done; \
               pkill -9 -f '[c]ontainerd-shim-runc-v2 .*{socket}'; sleep 0.2; done; \
             awk '{{print $5}}' /proc/self/mountinfo | grep -E '^({state}|{KUBELET_ROOT}/pods)/' \
               | sort -r | while read -r m; do umount \"$m\" 2>/dev/null || umount -l \"$m\"; done; \
             rm -rf '{state}'; ip link delete {BRIDGE} 2>/dev/null; true",
            socket = self.layout.containerd_socket().display(),
            state = self.containerd()?.state().display(),
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

    /// Runs `ctr` against this node's containerd in the `k8s.io` namespace.
    pub fn ctr(&self, args: &[&str]) -> Result<String, String> {
        let output = Command::new(self.containerd()?.bin_dir.join("ctr"))
            .arg("--address")
            .arg(self.layout.containerd_socket())
            .args(["--namespace", "k8s.io"])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| fail("ctr", e))?;
        if output.status.success() {
            Ok(String::from_utf8_lossy(&output.stdout).into_owned())
        } else {
            Err(format!(
                "ctr {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&output.stderr).trim()
            ))
        }
    }

    /// Imports the OCI archive at `archive` and tags what it held with each of `names`.
    pub fn import_image(&self, archive: &Path, names: &[String]) -> Result<(), String> {
        let before = self.ctr(&["images", "ls", "-q"])?;
        let path = archive.display().to_string();
        self.ctr(&["images", "import", "--all-platforms", &path])?;
        let after = self.ctr(&["images", "ls", "-q"])?;
        let new: Vec<&str> = after
            .lines()
            .filter(|name| !name.starts_with("sha256:") && !before.lines().any(|b| b == *name))
            .collect();
        if names.is_empty() {
            return Ok(());
        }
        let Some(source) = new.first() else {
            // Imported before under the same name: tag that one.
            return Err(format!("{path}: importing it added no image name"));
        };
        for name in names {
            self.ctr(&["images", "tag", "--force", source, name])?;
        }
        Ok(())
    }
}
