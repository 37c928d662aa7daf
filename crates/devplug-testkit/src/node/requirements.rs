//! What a whole node needs on this machine, found or listed as missing with where to get it.

use std::path::{Path, PathBuf};

/// The binaries the node runs, all from one folder ([`ASSETS_VAR`], else `KUBEBUILDER_ASSETS`).
pub const NODE_BINARIES: [&str; 8] = [
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubelet",
    "containerd",
    "containerd-shim-runc-v2",
    "ctr",
];

/// The folder of [`NODE_BINARIES`]; `KUBEBUILDER_ASSETS` is used when this is not set.
pub const ASSETS_VAR: &str = "DEVPLUG_NODE_ASSETS";
/// The devplug image as an OCI archive (default `target/image/devplug-<version>.oci.tar`).
pub const IMAGE_VAR: &str = "DEVPLUG_IMAGE_ARCHIVE";
/// The folder of the Helm chart rendered by `.ci/render-helm`.
pub const HELM_VAR: &str = "DEVPLUG_HELM_RENDERED";
/// Set (to anything but `0`) where the whole-node tests must run: a missing piece fails them.
pub const REQUIRE_VAR: &str = "DEVPLUG_REQUIRE_CLUSTER";

/// A folder holding a containerd that cannot apply CDI specs (older than 1.7) with its
/// `containerd-shim-runc-v2` and `ctr`, for the scenario where the DRA driver must say so.
/// Debian 12's containerd 1.6.20 is one: `apt-get download containerd && dpkg-deb -x
/// containerd_*.deb DIR`, then `DIR/usr/bin`.
pub const CONTAINERD_WITHOUT_CDI_VAR: &str = "DEVPLUG_CONTAINERD_WITHOUT_CDI";

/// The folder of [`CONTAINERD_WITHOUT_CDI_VAR`], or what is missing.
pub fn containerd_without_cdi() -> Result<PathBuf, String> {
    let dir = std::env::var_os(CONTAINERD_WITHOUT_CDI_VAR)
        .map(PathBuf::from)
        .ok_or_else(|| {
            format!(
                "{CONTAINERD_WITHOUT_CDI_VAR}: a folder with a containerd older than 1.7, its \
                 containerd-shim-runc-v2 and ctr (Debian 12: `apt-get download containerd && \
                 dpkg-deb -x containerd_*.deb DIR`, then DIR/usr/bin)"
            )
        })?;
    for name in ["containerd", "containerd-shim-runc-v2", "ctr"] {
        if !dir.join(name).is_file() {
            return Err(format!(
                "{CONTAINERD_WITHOUT_CDI_VAR}: no {} (the folder needs containerd, \
                 containerd-shim-runc-v2 and ctr)",
                dir.join(name).display()
            ));
        }
    }
    Ok(dir)
}

/// A folder holding CRI-O's `crio` and `pinns` (1.36: the kubelet's minor release), for the
/// scenario that runs devplug on CRI-O; without it, the folder of [`NODE_BINARIES`] where it
/// holds them. CRI-O also needs `conmon`, `runc` and `skopeo` (to put
/// the test images into its storage: no registry is reachable) in PATH, and `crio` the shared
/// libraries `libseccomp.so.2` and `libsqlite3.so.0`.
pub const CRIO_VAR: &str = "DEVPLUG_CRIO";

/// CRI-O for the node: the folder of [`CRIO_VAR`], or what is missing, with where to get it.
pub fn crio() -> Result<PathBuf, String> {
    // Else the node's binaries' folder, where it holds them.
    let beside = std::env::var_os(ASSETS_VAR)
        .or_else(|| std::env::var_os("KUBEBUILDER_ASSETS"))
        .map(PathBuf::from)
        .filter(|dir| dir.join("crio").is_file());
    let dir = std::env::var_os(CRIO_VAR)
        .map(PathBuf::from)
        .or(beside)
        .ok_or_else(|| {
            format!(
                "{CRIO_VAR}: a folder with CRI-O's crio and pinns (CRI-O's release archive, \
                 cri-o.amd64.v1.36.*.tar.gz, has both in bin/), or both beside the node's \
                 other binaries"
            )
        })?;
    let mut missing = Vec::new();
    for name in ["crio", "pinns"] {
        if !dir.join(name).is_file() {
            missing.push(format!("{CRIO_VAR}: no {}", dir.join(name).display()));
        }
    }
    for (tool, package) in [("conmon", "conmon"), ("skopeo", "skopeo"), ("runc", "runc")] {
        if find_in_path(tool).is_none() {
            missing.push(format!(
                "{tool} in PATH (Debian: apt-get install {package})"
            ));
        }
    }
    if missing.is_empty() {
        // It links libseccomp and SQLite: a missing library shows here, not as a node that
        // never comes up.
        let ran = std::process::Command::new(dir.join("crio"))
            .arg("--version")
            .stdin(std::process::Stdio::null())
            .output();
        match ran {
            Ok(out) if out.status.success() => {}
            Ok(out) => missing.push(format!(
                "{} --version failed: {} (Debian: apt-get install libseccomp2 libsqlite3-0)",
                dir.join("crio").display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )),
            Err(e) => missing.push(format!("{}: {e}", dir.join("crio").display())),
        }
    }
    if missing.is_empty() {
        Ok(dir)
    } else {
        Err(missing.join("; "))
    }
}

/// The path of `name` in PATH (or /usr/sbin, /sbin), if it is there.
pub fn tool(name: &str) -> Option<PathBuf> {
    find_in_path(name)
}

/// The CNI plugins the node's network uses, from the folder [`CNI_BIN_DIR`].
const CNI_PLUGINS: [&str; 3] = ["bridge", "host-local", "loopback"];
/// Where Debian's `containernetworking-plugins` puts the CNI plugins.
pub const CNI_BIN_DIR: &str = "/usr/lib/cni";

/// Everything a whole node needs, found.
#[derive(Debug, Clone)]
pub struct Requirements {
    /// The folder of [`NODE_BINARIES`].
    pub assets: PathBuf,
    /// A statically linked busybox: the test pods' image is made of it.
    pub busybox: PathBuf,
    /// kubectl, to apply manifests and kustomizations as an operator does.
    pub kubectl: PathBuf,
    /// devplug's image, an OCI archive.
    pub image_archive: PathBuf,
    /// The rendered Helm chart, one multi-document file per set of values.
    pub helm_rendered: PathBuf,
    /// The repository's root (deploy/ lives there).
    pub repo: PathBuf,
}

/// Whether a missing requirement must fail the tests instead of skipping them.
pub fn required() -> bool {
    std::env::var(REQUIRE_VAR).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// The repository root: two folders above this crate.
pub fn repo_root() -> PathBuf {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    crate_dir
        .ancestors()
        .nth(2)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| crate_dir.to_path_buf())
}

fn find_in_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

fn is_root() -> bool {
    // The effective uid from /proc, without unsafe code: the `Uid:` line is real, effective, ...
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("Uid:"))
                .and_then(|uids| uids.split_whitespace().nth(1).map(|e| e == "0"))
        })
        .unwrap_or(false)
}

/// Finds everything, or says what is missing, each with where to get it.
pub fn find() -> Result<Requirements, Vec<String>> {
    let mut missing = Vec::new();
    if !is_root() {
        missing.push(
            "root: the node mounts, makes cgroups and network namespaces, and owns \
             /var/lib/kubelet (run the tests as root, e.g. in a throw-away VM)"
                .to_owned(),
        );
    }
    let assets = std::env::var_os(ASSETS_VAR)
        .or_else(|| std::env::var_os("KUBEBUILDER_ASSETS"))
        .map(PathBuf::from);
    match &assets {
        None => missing.push(format!(
            "{ASSETS_VAR} (or KUBEBUILDER_ASSETS): a folder holding {}: etcd and \
             kube-apiserver from `setup-envtest use 1.36.x -p path`, kube-controller-manager, \
             kube-scheduler and kubelet from the Kubernetes release's server binaries \
             (kubernetes-server-linux-amd64.tar.gz), containerd 2.x with \
             containerd-shim-runc-v2 and ctr from containerd's release archive",
            NODE_BINARIES.join(", ")
        )),
        Some(dir) => {
            for name in NODE_BINARIES {
                if !dir.join(name).is_file() {
                    missing.push(format!(
                        "{} (the node's binaries come from one folder)",
                        dir.join(name).display()
                    ));
                }
            }
        }
    }
    if find_in_path("runc").is_none() {
        missing.push("runc (Debian: apt-get install runc)".to_owned());
    }
    for plugin in CNI_PLUGINS {
        if !Path::new(CNI_BIN_DIR).join(plugin).is_file() {
            missing.push(format!(
                "the CNI plugin {CNI_BIN_DIR}/{plugin} (Debian: apt-get install \
                 containernetworking-plugins)"
            ));
        }
    }
    if find_in_path("ip").is_none() {
        missing.push("ip (Debian: apt-get install iproute2)".to_owned());
    }
    let busybox = ["/bin/busybox", "/usr/bin/busybox"]
        .map(PathBuf::from)
        .into_iter()
        .find(|p| p.is_file());
    if busybox.is_none() {
        missing.push(
            "a static busybox at /bin/busybox for the test pods' image (Debian: apt-get \
             install busybox-static)"
                .to_owned(),
        );
    }
    let kubectl = find_in_path("kubectl");
    if kubectl.is_none() {
        missing.push("kubectl in PATH (any recent release)".to_owned());
    }
    let repo = repo_root();
    let image_archive = std::env::var_os(IMAGE_VAR)
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            repo.join("target/image")
                .join(format!("devplug-{}.oci.tar", env!("CARGO_PKG_VERSION")))
        });
    if !image_archive.is_file() {
        missing.push(format!(
            "devplug's image at {} (build it with `.ci/build-image`, or name an OCI archive \
             in {IMAGE_VAR})",
            image_archive.display()
        ));
    }
    let helm_rendered = std::env::var_os(HELM_VAR).map(PathBuf::from);
    if helm_rendered.as_ref().is_none_or(|d| !d.is_dir()) {
        missing.push(format!(
            "{HELM_VAR}: the Helm chart rendered by `.ci/render-helm target/helm-rendered` \
             (then `export {HELM_VAR}=$PWD/target/helm-rendered`)"
        ));
    }
    if let Some(reason) = foreign_kubelet_root() {
        missing.push(reason);
    }
    match (assets, busybox, kubectl, helm_rendered) {
        (Some(assets), Some(busybox), Some(kubectl), Some(helm_rendered)) if missing.is_empty() => {
            Ok(Requirements {
                assets,
                busybox,
                kubectl,
                image_archive,
                helm_rendered,
                repo,
            })
        }
        _ => Err(missing),
    }
}

/// A reason not to run when `/var/lib/kubelet` exists and is not ours: this machine may be a
/// real node, and its kubelet's files are not the tests' to touch.
fn foreign_kubelet_root() -> Option<String> {
    let root = Path::new(super::KUBELET_ROOT);
    let ours = root.join(super::MARKER);
    let empty = std::fs::read_dir(root).is_ok_and(|mut entries| entries.next().is_none());
    (root.exists() && !ours.exists() && !empty).then(|| {
        format!(
            "{} exists and was not made by these tests: this machine looks like a real node; \
             the whole-node tests only run where no kubelet does",
            root.display()
        )
    })
}
