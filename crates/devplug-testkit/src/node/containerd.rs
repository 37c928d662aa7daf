//! containerd as the node's runtime: its binaries, root and state, starting it, the test
//! images in it, `ctr`.

use super::runtime::Runtime;
use super::{config, fail, image, requirements, write, Node};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The containerd the node runs now.
#[derive(Debug, Clone)]
pub(super) struct Containerd {
    /// The folder of its `containerd`, `containerd-shim-runc-v2` and `ctr`.
    pub(super) bin_dir: PathBuf,
    /// The folder of its root and state ([`super::Layout::runtime_files`]).
    pub(super) files: PathBuf,
}

impl Containerd {
    pub(super) fn root(&self) -> PathBuf {
        self.files.join("root")
    }
    /// tmpfs on a real node: a reboot empties it.
    pub(super) fn state(&self) -> PathBuf {
        self.files.join("state")
    }
    fn config(&self) -> PathBuf {
        self.files.join("containerd.toml")
    }
}

impl Node {
    /// The containerd the node runs now, or an error naming the runtime it runs instead.
    fn containerd(&self) -> Result<Containerd, String> {
        match self.runtime()? {
            Runtime::Containerd(containerd) => Ok(containerd),
            other => Err(format!(
                "the node runs {}, not containerd: `ctr` has nothing to talk to",
                other.name()
            )),
        }
    }

    /// The test image and devplug's into the running containerd.
    pub(super) fn import_containerd_images(&self) -> Result<(), String> {
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

    /// Starts `containerd`, its config written first.
    pub(super) async fn start_containerd(&self, containerd: &Containerd) -> Result<(), String> {
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

    /// The running containerd's version, as the CRI reports it.
    pub(super) fn ctr_version(&self) -> Result<String, String> {
        let out = self.ctr(&["version"])?;
        let server = out.split("Server:").nth(1).unwrap_or_default();
        server
            .lines()
            .find_map(|l| l.trim().strip_prefix("Version:"))
            .map(|v| v.trim().to_owned())
            .ok_or_else(|| format!("no server version in `ctr version`: {out}"))
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
