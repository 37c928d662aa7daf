//! CRI-O as the node's runtime: its binaries, root and state, its configuration, the test
//! images put into its storage with `skopeo` (CRI-O pulls only from registries, and none is
//! reachable here), and starting it.
//!
//! What differs from containerd on such a node (docs/install.md says it for users):
//! - CRI-O resolves a short image name (`devplug:0.1.0`) only through the machine's
//!   `/etc/containers/registries.conf` (its search registries or aliases); the tests leave
//!   /etc alone, so the CRI-O release names devplug's image in full
//!   (`docker.io/library/devplug:<version>`), as a node without search registries needs.
//! - Its storage is containers/storage (the `vfs` driver here: no overlay mounts to leak),
//!   filled before CRI-O starts: skopeo 1.9 (Debian 12) and CRI-O 1.36 share the format, and
//!   no two writers of different versions ever hold it at once.
//! - It writes a clean-shutdown file when it stops on SIGTERM; a reboot that SIGKILLs it makes it
//!   wipe its storage on the next start (an unclean shutdown may have corrupted it). A node's
//!   service manager stops it with SIGTERM, and so does [`Node::reboot`] here.

use super::runtime::Runtime;
use super::{config, fail, image, requirements, write, Node};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// CRI-O as the node runs it.
#[derive(Debug, Clone)]
pub(super) struct Crio {
    /// The folder of its `crio` and `pinns` ([`requirements::CRIO_VAR`]).
    pub(super) bin_dir: PathBuf,
    /// The folder of its root, state and configuration ([`super::Layout::runtime_files`]
    /// names it too: one folder per runtime the node ran).
    pub(super) files: PathBuf,
}

impl Crio {
    /// Its containers/storage root (images, containers' layers) and CRI-O's own persistent
    /// files: `/var/lib/containers/storage` and `/var/lib/crio` on a real node.
    pub(super) fn root(&self) -> PathBuf {
        self.files.join("root")
    }
    /// tmpfs on a real node (`/run/containers/storage`, `/var/run/crio`): a reboot empties it,
    /// and CRI-O finds its version file gone and forgets the old boot's containers.
    pub(super) fn state(&self) -> PathBuf {
        self.files.join("state")
    }
    /// Its socket, in the state folder as `/var/run/crio/crio.sock` is on a real node. The
    /// name matters: the kubelet recognises CRI-O by the suffix `crio.sock`.
    pub(super) fn socket(&self) -> PathBuf {
        self.state().join("crio.sock")
    }
    fn config(&self) -> PathBuf {
        self.files.join("crio.conf")
    }
    fn policy(&self) -> PathBuf {
        self.files.join("policy.json")
    }
    /// containers/storage's name of its store, as skopeo's `containers-storage:` transport
    /// takes it.
    fn store(&self) -> String {
        format!(
            "containers-storage:[vfs@{}+{}]",
            self.root().join("storage").display(),
            self.state().join("storage").display()
        )
    }
}

/// The image names the CRI-O node holds: its storage is filled before CRI-O starts, so a test
/// cannot tag another name later ([`Node::tag_image`] refuses one not listed here).
pub(super) fn crio_image_names() -> [(&'static str, String); 3] {
    let version = env!("CARGO_PKG_VERSION");
    [
        ("busybox", image::BUSYBOX_IMAGE.to_owned()),
        // The DRA examples' image (deploy/examples/dra).
        ("busybox", "docker.io/library/busybox:1.36".to_owned()),
        ("devplug", format!("docker.io/library/devplug:{version}")),
    ]
}

/// A shell script that runs `runc` after editing the container's config: `restrict_oom`, its
/// `oomScoreAdj` no lower than the script's own; `drop_hugetlb`, no `hugepageLimits`.
fn runc_wrapper(runc: &Path, restrict_oom: bool, drop_hugetlb: bool) -> String {
    format!(
        r#"#!/bin/sh
# runc for CRI-O on a machine that lacks what CRI-O assumes: written by devplug's whole-node
# tests (devplug_testkit::node::crio). The container's config first: its JSON on one line.
restrict_oom={restrict_oom}
drop_hugetlb={drop_hugetlb}
prev=""
for arg in "$@"; do
  case "$prev" in --bundle|-b) bundle="$arg";; esac
  prev="$arg"
done
config="$bundle/config.json"
if [ -n "$bundle" ] && [ -f "$config" ]; then
  one=$(tr -d '\n' < "$config")
  if [ "$restrict_oom" = 1 ]; then
    own=$(cat /proc/self/oom_score_adj)
    want=$(printf '%s' "$one" | sed -n -E 's/.*"oomScoreAdj":[[:space:]]*(-?[0-9]+).*/\1/p')
    if [ -n "$want" ] && [ "$want" -lt "$own" ]; then
      one=$(printf '%s' "$one" | sed -E "s/\"oomScoreAdj\":[[:space:]]*-?[0-9]+/\"oomScoreAdj\":$own/")
    fi
  fi
  if [ "$drop_hugetlb" = 1 ]; then
    one=$(printf '%s' "$one" | sed -E \
      -e 's/,[[:space:]]*"hugepageLimits":[[:space:]]*\[[^]]*\]//' \
      -e 's/"hugepageLimits":[[:space:]]*\[[^]]*\][[:space:]]*,?//')
  fi
  printf '%s\n' "$one" > "$config.edited" && mv "$config.edited" "$config"
fi
exec '{runc}' "$@"
"#,
        restrict_oom = u8::from(restrict_oom),
        drop_hugetlb = u8::from(drop_hugetlb),
        runc = runc.display()
    )
}

impl Node {
    /// Puts the test image and devplug's into `crio`'s storage (CRI-O not running), once.
    pub(super) fn import_crio_images(&self, crio: &Crio) -> Result<(), String> {
        write(
            &crio.policy(),
            r#"{"default":[{"type":"insecureAcceptAnything"}]}"#,
        )?;
        let skopeo = requirements::tool("skopeo").ok_or("skopeo is not in PATH")?;
        // skopeo keeps a cache of blob locations in /var/lib/containers/cache as root: made
        // here, the node's cleanup removes it.
        let cache = Path::new("/var/lib/containers");
        if !cache.exists() {
            self.remember_made_file(cache)?;
        }
        for (which, name) in crio_image_names() {
            let archive = match which {
                "busybox" => self.layout.dir.join("busybox.oci.tar"),
                _ => self.requirements.image_archive.clone(),
            };
            let output = Command::new(&skopeo)
                .args(["copy", "--quiet", "--policy"])
                .arg(crio.policy())
                .arg(format!("oci-archive:{}", archive.display()))
                .arg(format!("{}{name}", crio.store()))
                .stdin(Stdio::null())
                .output()
                .map_err(|e| fail("skopeo", e))?;
            if !output.status.success() {
                return Err(format!(
                    "skopeo copy {} into CRI-O's storage as {name}: {}",
                    archive.display(),
                    String::from_utf8_lossy(&output.stderr).trim()
                ));
            }
        }
        Ok(())
    }

    /// Starts `crio`, its config written first, and waits until its socket accepts.
    pub(super) async fn start_crio(&self, crio: &Crio) -> Result<(), String> {
        let runc = self.crio_runc(crio)?;
        let conmon = requirements::tool("conmon").ok_or("conmon is not in PATH")?;
        write(
            &crio.config(),
            config::crio_conf(&config::CrioPaths {
                root: &crio.root(),
                state: &crio.state(),
                socket: &crio.socket(),
                pinns: &crio.bin_dir.join("pinns"),
                runc: &runc,
                conmon: &conmon,
                policy: &crio.policy(),
                cni_conf: &self.layout.cni_conf_dir(),
                cni_bin: Path::new(requirements::CNI_BIN_DIR),
                pause_image: image::BUSYBOX_IMAGE,
            }),
        )?;
        // CRI-O runs `crun --version` at start (it always defines a crun handler), and crun
        // makes /run/crun: made here, the node's cleanup removes it.
        let crun_state = Path::new("/run/crun");
        if !crun_state.exists() {
            self.remember_made_file(crun_state)?;
        }
        let socket = crio.socket();
        let _ = std::fs::remove_file(&socket);
        self.spawn(
            "crio",
            &crio.bin_dir.join("crio"),
            &[
                format!("--config={}", crio.config().display()),
                // No drop-in folder: /etc/crio/crio.conf.d is the machine's, not the node's.
                format!("--config-dir={}", crio.files.join("crio.conf.d").display()),
            ],
        )?;
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if std::os::unix::net::UnixStream::connect(&socket).is_ok() {
                return Ok(());
            }
            if !self.process_running("crio") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(format!(
            "CRI-O did not answer on {} (its log: {})",
            socket.display(),
            self.layout.logs().join("crio.log").display()
        ))
    }

    /// The OCI runtime CRI-O runs: runc, or on a machine that lacks what CRI-O assumes, a
    /// wrapper that first edits the container's config as containerd's settings do for the
    /// node's containerd (CRI-O has no such settings):
    /// - where this process cannot lower its `oom_score_adj` (a VM without CAP_SYS_RESOURCE),
    ///   `oomScoreAdj` no lower than its own (containerd: `restrict_oom_score_adj`); runc fails
    ///   a system-node-critical pod's container otherwise (-997);
    /// - where the hugetlb controller is not mounted as a cgroup v1 hierarchy (a hybrid
    ///   machine whose hugetlb is on the unified one), no `hugepageLimits` (containerd:
    ///   `tolerate_missing_hugetlb_controller`, on by default); runc cannot set them there.
    fn crio_runc(&self, crio: &Crio) -> Result<PathBuf, String> {
        let runc = requirements::tool("runc").ok_or("runc is not in PATH")?;
        let can_lower = Command::new("sh")
            .arg("-c")
            .arg("echo $(($(cat /proc/self/oom_score_adj) - 1)) > /proc/self/oom_score_adj")
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        let cgroup_v2 = Path::new("/sys/fs/cgroup/cgroup.controllers").is_file();
        let hugetlb = cgroup_v2 || Path::new("/sys/fs/cgroup/hugetlb").is_dir();
        if can_lower && hugetlb {
            return Ok(runc);
        }
        let wrapper = crio.files.join("runc-for-this-machine");
        write(&wrapper, runc_wrapper(&runc, !can_lower, !hugetlb))?;
        std::fs::set_permissions(
            &wrapper,
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .map_err(|e| fail(&wrapper.display().to_string(), e))?;
        Ok(wrapper)
    }

    /// The CRI-O of the node's requirements ([`requirements::crio`]), its files in the node's
    /// folder `crio`.
    pub(super) fn crio_runtime(&self) -> Result<Runtime, String> {
        Ok(Runtime::Crio(Crio {
            bin_dir: requirements::crio()?,
            files: self.layout.runtime_files("crio"),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the wrapper around `cat` on a bundle whose config is `config`: what runc would read.
    fn edited(config: &str, restrict_oom: bool, drop_hugetlb: bool) -> serde_json::Value {
        let dir = std::env::temp_dir().join(format!(
            "devplug-testkit-crio-{}-{restrict_oom}-{drop_hugetlb}-{}",
            std::process::id(),
            config.len()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), config).unwrap();
        let script = dir.join("runc");
        std::fs::write(
            &script,
            runc_wrapper(Path::new("/bin/true"), restrict_oom, drop_hugetlb),
        )
        .unwrap();
        let status = Command::new("sh")
            .arg(&script)
            .args(["create", "--bundle"])
            .arg(&dir)
            .arg("id")
            .status()
            .unwrap();
        assert!(status.success());
        let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
    }

    #[test]
    fn the_runc_wrapper_raises_oom_score_adj_and_drops_hugepage_limits_as_asked() {
        let own: i64 = std::fs::read_to_string("/proc/self/oom_score_adj")
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let hugepages =
            serde_json::json!([{"pageSize": "2MB", "limit": 0}, {"pageSize": "1GB", "limit": 0}]);
        let config = |first: bool| {
            let mut resources = serde_json::Map::new();
            if first {
                resources.insert("hugepageLimits".into(), hugepages.clone());
            }
            resources.insert("memory".into(), serde_json::json!({"limit": 1}));
            if !first {
                resources.insert("hugepageLimits".into(), hugepages.clone());
            }
            serde_json::json!({
                "process": {"args": ["sleep"], "oomScoreAdj": -997},
                "linux": {"resources": resources},
            })
        };
        for first in [true, false] {
            for text in [
                config(first).to_string(),
                serde_json::to_string_pretty(&config(first)).unwrap(),
            ] {
                let got = edited(&text, true, true);
                assert_eq!(got["process"]["oomScoreAdj"], own.max(-997), "{text}");
                assert!(got["linux"]["resources"].get("hugepageLimits").is_none());
                assert_eq!(got["linux"]["resources"]["memory"]["limit"], 1);
                let kept = edited(&text, false, false);
                assert_eq!(kept, config(first));
            }
        }
        // A score above the wrapper's own stays.
        let high = serde_json::json!({"process": {"oomScoreAdj": 1000}});
        assert_eq!(edited(&high.to_string(), true, false), high);
    }
}
