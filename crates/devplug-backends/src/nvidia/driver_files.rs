//! The driver's user-space files, given to containers without NVIDIA's container toolkit.
//!
//! A CUDA program needs more than the device nodes: `libcuda.so.1` and the libraries it loads
//! (`libnvidia-ptxjitcompiler`, `libnvidia-nvvm`, ...) must be the ones of the running kernel
//! driver, so they come from the node, not from the image. NVIDIA's container toolkit mounts
//! them when it is the runtime; elsewhere this module does: it finds the files of the driver
//! version NVML reports, in the folder NVML was loaded from, under the driver root it was
//! found in, and mounts each read-only at the layout CUDA images already search
//! (`/usr/local/nvidia/lib64` is on their `LD_LIBRARY_PATH`, `/usr/local/nvidia/bin` on their
//! `PATH`). A library is mounted under its versioned name and its SONAME (`libcuda.so.1`),
//! and the two that programs open by their development name (`libcuda.so`,
//! `libnvidia-ml.so`) under that too: a bind mount of the file itself, as an `Allocate`
//! response cannot make symlinks.
//!
//! Where the files are: as the dynamic loader would find them ([`DriverFiles::locate`]): the
//! folder NVML was loaded from, the loader cache of the driver root (`etc/ld.so.cache`), the
//! folders its `etc/ld.so.conf` names, then the root's usual library folders. That covers
//! distribution packages (`/usr/lib/x86_64-linux-gnu`), NVIDIA's runfile (`/usr/lib64`,
//! `/usr/lib`), the GPU operator's driver container (all of it under `/run/nvidia/driver`) and
//! split layouts (NVML in `/usr/lib`, `libcuda` and the rest in a folder such as
//! `/usr/local/nvidia/lib64` that only `ld.so.conf.d` names). Links are followed as a process
//! chrooted into the driver root would follow them, so an absolute link means a path in that
//! root. Where the loader would load libraries of another driver version than the one NVML
//! reports (an upgrade's leftovers, or a new driver installed while the old module still
//! runs), nothing is handed out: [`MixedVersions`] says which file is which version and what
//! to do. CUDA's forward-compatibility package (a newer libcuda in a `compat` folder, on
//! purpose) is no such mix.
//!
//! The lists are the compute and utility sets of the toolkit's driver capabilities
//! (`NVIDIA_DRIVER_CAPABILITIES=compute,utility`): what CUDA and `nvidia-smi` need.

mod loader;

use devplug::{ContainerEdits, Mount};
use std::path::{Component, Path, PathBuf};

/// Where libraries go in the container.
pub const CONTAINER_LIB_DIR: &str = "/usr/local/nvidia/lib64";
/// Where the driver's programs go in the container.
pub const CONTAINER_BIN_DIR: &str = "/usr/local/nvidia/bin";

/// The driver's libraries, each with its SONAME's version (`None`: the SONAME is the versioned
/// name itself), and whether programs also open it by its development name (`lib*.so`).
const LIBRARIES: [(&str, Option<&str>, bool); 12] = [
    ("libcuda", Some("1"), true),
    ("libnvidia-ml", Some("1"), true),
    ("libnvidia-ptxjitcompiler", Some("1"), false),
    ("libnvidia-nvvm", Some("4"), false),
    ("libcudadebugger", Some("1"), false),
    ("libnvidia-opencl", Some("1"), false),
    ("libnvidia-allocator", Some("1"), false),
    ("libnvidia-cfg", Some("1"), false),
    ("libnvidia-gpucomp", None, false),
    ("libnvidia-pkcs11", None, false),
    ("libnvidia-pkcs11-openssl3", None, false),
    ("libnvidia-nscq", Some("2"), false),
];

/// The driver's programs (utility and compute: `nvidia-smi`, MPS).
const PROGRAMS: [&str; 5] = [
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
];

/// Folders under a driver root that hold its programs, in the order they are searched after
/// the `bin` folder beside the driver's libraries (the last is the split layout's, beside
/// `/usr/local/nvidia/lib64`, for when libcuda is not found).
const PROGRAM_DIRS: [&str; 4] = ["usr/bin", "usr/local/bin", "bin", "usr/local/nvidia/bin"];

/// Folders under a driver root that hold its firmware (`nvidia/<version>` below them).
const FIRMWARE_DIRS: [&str; 2] = ["lib/firmware", "usr/lib/firmware"];

/// This build's architecture's Debian multiarch tuple (`/usr/lib/<tuple>`), as a literal for
/// `concat!`.
#[cfg(target_arch = "aarch64")]
macro_rules! multiarch {
    () => {
        "aarch64-linux-gnu"
    };
}
#[cfg(not(target_arch = "aarch64"))]
macro_rules! multiarch {
    () => {
        "x86_64-linux-gnu"
    };
}

/// The library folders of a driver root, searched after the loader cache and `ld.so.conf`:
/// Debian's multiarch folders, then the RPM and runfile ones.
const LIBRARY_DIRS: [&str; 6] = [
    concat!("/usr/lib/", multiarch!()),
    concat!("/lib/", multiarch!()),
    "/usr/lib64",
    "/lib64",
    "/usr/lib",
    "/lib",
];

/// The folders under a driver root where `libnvidia-ml.so.1` is looked for (in this order)
/// and watched for a driver installed later: this build's architecture's multiarch folder
/// (Debian and Ubuntu packages), then the RPM and runfile ones.
pub(crate) const NVML_DIRS: [&str; 3] = [concat!("usr/lib/", multiarch!()), "usr/lib64", "usr/lib"];

/// How many symlinks a path may go through (the kernel's limit is 40; the driver uses one).
const MAX_LINKS: usize = 16;

/// One file to mount: where devplug sees it, relative to the driver root, and where it goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverFile {
    /// The path under the driver root (no leading `/`).
    pub rel: PathBuf,
    /// The path in the container.
    pub container_path: PathBuf,
}

/// The driver files found for one driver version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverFiles {
    /// The driver version NVML reported (`550.54.15`).
    pub version: String,
    /// The driver root on the host (the paths given to the runtime start here).
    pub host_root: PathBuf,
    /// The same root as devplug sees it (where devplug itself runs the driver's programs).
    pub root: PathBuf,
    /// The files, in mount order.
    pub files: Vec<DriverFile>,
}

/// The loader would load driver libraries of another version than the one NVML reports.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the driver's libraries are of more than one version: NVML reports driver {version}, but \
     {} (in the driver root {root}). A CUDA program would load a library of another driver \
     than the one running, so containers get no driver files. Fix: if that version is the \
     driver installed, reboot (or reload the nvidia kernel modules) so that it runs; otherwise \
     remove the other driver's files (its packages, or what its runfile installed), run \
     `ldconfig`, and restart devplug",
    list(.files)
)]
pub struct MixedVersions {
    /// The version NVML reports (the running kernel module's).
    pub version: String,
    /// The driver root searched, as devplug sees it.
    pub root: PathBuf,
    /// Each file of another version: its path in the root's view (with the file its links
    /// lead to) and its version.
    pub files: Vec<(String, String)>,
}

fn list(files: &[(String, String)]) -> String {
    files
        .iter()
        .map(|(path, version)| format!("{path} is {version}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The driver root a library was loaded from: the longest of `roots` that holds it, or `/`.
pub fn root_of(library: &Path, roots: &[PathBuf]) -> PathBuf {
    roots
        .iter()
        .filter(|r| library.starts_with(r))
        .max_by_key(|r| r.components().count())
        .cloned()
        .unwrap_or_else(|| PathBuf::from("/"))
}

/// `path` made absolute without `.` and `..`, as the kernel reads it inside a chroot (`/..` is
/// `/`).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for part in path.components() {
        match part {
            Component::Normal(name) => out.push(name),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

/// `path` (absolute, in the root's view) on this machine.
fn real(root: &Path, path: &Path) -> PathBuf {
    root.join(path.strip_prefix("/").unwrap_or(path))
}

/// The regular file `path` (absolute, in the root's view) is or leads to through symlinks, in
/// the root's view: links are followed as in a process chrooted into `root` (an absolute
/// target is a path in the root).
fn resolve(root: &Path, path: &Path) -> Option<PathBuf> {
    let mut current = normalize(path);
    for _ in 0..MAX_LINKS {
        let on_disk = real(root, &current);
        let meta = std::fs::symlink_metadata(&on_disk).ok()?;
        if meta.is_file() {
            return Some(current);
        }
        if !meta.file_type().is_symlink() {
            return None;
        }
        let target = std::fs::read_link(&on_disk).ok()?;
        let next = match current.parent() {
            Some(dir) if target.is_relative() => dir.join(target),
            _ => target,
        };
        current = normalize(&next);
    }
    None
}

/// The version in a library's file name (`libcuda.so.550.54.15` → `550.54.15`): what follows
/// `<name>.so.`, when it has at least three parts (a SONAME's `1` is not a version).
fn file_version(file: &Path, name: &str) -> Option<String> {
    let file_name = file.file_name()?.to_str()?;
    let rest = file_name.strip_prefix(name)?.strip_prefix(".so.")?;
    let parts: Vec<&str> = rest.split('.').collect();
    (parts.len() >= 3
        && parts
            .iter()
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit())))
    .then(|| rest.to_owned())
}

/// True for a file of CUDA's forward-compatibility package (`/usr/local/cuda-*/compat/`): a
/// newer libcuda meant to run on an older kernel driver, on purpose, so not a leftover. It is
/// not handed to containers either (they get the running driver's files and bring their own
/// compat package if they need one).
fn is_forward_compat(file: &Path) -> bool {
    file.components().any(|c| c.as_os_str() == "compat")
}

/// Pushes `dir` to `dirs` unless it is there already.
fn push_dir(dirs: &mut Vec<PathBuf>, dir: PathBuf) {
    if !dirs.contains(&dir) {
        dirs.push(dir);
    }
}

impl DriverFiles {
    /// Finds the files of driver `version`: libraries in `lib_dir` (a folder under `root`),
    /// programs and firmware elsewhere under `root`. `host_root` is the same root as the host
    /// names it. Files that are missing are left out (drivers differ in what they ship).
    pub fn find(root: &Path, host_root: &Path, lib_dir: &Path, version: &str) -> DriverFiles {
        let dirs: Vec<PathBuf> = lib_dir
            .strip_prefix(root)
            .map(|rel| vec![Path::new("/").join(rel)])
            .unwrap_or_default();
        Self::find_in(root, host_root, &dirs, version)
    }

    /// Finds the files of driver `version` where the dynamic loader would look, given the NVML
    /// library devplug loaded (`nvml`, under `root`): its folder, `root`'s loader cache, the
    /// folders its `etc/ld.so.conf` names, then its usual library folders. Refuses when the
    /// loader would load a driver library of another version.
    pub fn locate(
        root: &Path,
        host_root: &Path,
        nvml: &Path,
        version: &str,
    ) -> Result<DriverFiles, MixedVersions> {
        let cache = loader::read_cache(root);
        let conf = loader::conf_dirs(root);
        let nvml = nvml
            .strip_prefix(root)
            .map(|rel| Path::new("/").join(rel))
            .ok();
        // Where each library's SONAME leads the loader: the cache first, then the folders it
        // searches without one (ld.so.conf's, which `ldconfig` would have cached, and the
        // usual ones).
        let searched: Vec<PathBuf> = {
            let mut dirs = conf.clone();
            for d in LIBRARY_DIRS {
                push_dir(&mut dirs, PathBuf::from(d));
            }
            dirs
        };
        let mut others: Vec<(String, String)> = Vec::new();
        let seen_version = |path: &Path, name: &str, others: &mut Vec<(String, String)>| {
            let Some(file) = resolve(root, path) else {
                return;
            };
            if is_forward_compat(&file) {
                return;
            }
            let Some(v) = file_version(&file, name).filter(|v| v != version) else {
                return;
            };
            let shown = if file == path {
                path.display().to_string()
            } else {
                format!("{} (-> {})", path.display(), file.display())
            };
            if !others.iter().any(|(p, _)| *p == shown) {
                others.push((shown, v));
            }
        };
        if let Some(nvml) = &nvml {
            seen_version(nvml, "libnvidia-ml", &mut others);
        }
        for (name, soname, _) in LIBRARIES {
            let Some(soname) = soname.map(|v| format!("{name}.so.{v}")) else {
                continue;
            };
            let picked = cache
                .iter()
                .filter(|e| e.name == soname)
                .map(|e| e.path.clone())
                .chain(searched.iter().map(|d| d.join(&soname)))
                .find(|p| resolve(root, p).is_some());
            if let Some(picked) = picked {
                seen_version(&picked, name, &mut others);
            }
        }
        if !others.is_empty() {
            return Err(MixedVersions {
                version: version.to_owned(),
                root: root.to_owned(),
                files: others,
            });
        }
        // Where the versioned files are looked for: NVML's folder, the cache's folders of the
        // driver's libraries, then the searched folders.
        let mut dirs = Vec::new();
        if let Some(dir) = nvml.as_deref().and_then(Path::parent) {
            push_dir(&mut dirs, dir.to_path_buf());
        }
        for entry in &cache {
            let ours = LIBRARIES
                .iter()
                .any(|(name, _, _)| entry.name.starts_with(&format!("{name}.so")));
            if let (true, Some(dir)) = (ours, entry.path.parent()) {
                push_dir(&mut dirs, normalize(dir));
            }
        }
        for dir in searched {
            push_dir(&mut dirs, dir);
        }
        Ok(Self::find_in(root, host_root, &dirs, version))
    }

    /// The files of `version`: each library from the first of `lib_dirs` (absolute, in the
    /// root's view) holding it, programs and firmware from their usual folders.
    fn find_in(root: &Path, host_root: &Path, lib_dirs: &[PathBuf], version: &str) -> DriverFiles {
        let mut files = Vec::new();
        let rel = |p: PathBuf| p.strip_prefix("/").map(Path::to_path_buf).ok();
        // The `bin` folder beside the folder libcuda came from (`/usr/local/nvidia/lib64` →
        // `/usr/local/nvidia/bin`): where the driver's own programs are when it is installed
        // in a folder of its own.
        let mut beside_libraries: Option<PathBuf> = None;
        for (name, soname, dev) in LIBRARIES {
            let versioned = format!("{name}.so.{version}");
            let Some((dir, found)) = lib_dirs.iter().find_map(|d| {
                let found = resolve(root, &d.join(&versioned))?;
                Some((d, rel(found)?))
            }) else {
                continue;
            };
            if beside_libraries.is_none() {
                beside_libraries = dir.parent().map(|p| p.join("bin"));
            }
            let mut names = vec![versioned];
            names.extend(soname.map(|v| format!("{name}.so.{v}")));
            if dev {
                names.push(format!("{name}.so"));
            }
            for n in names {
                files.push(DriverFile {
                    rel: found.clone(),
                    container_path: Path::new(CONTAINER_LIB_DIR).join(n),
                });
            }
        }
        let program_dirs: Vec<PathBuf> = beside_libraries
            .into_iter()
            .chain(PROGRAM_DIRS.iter().map(|d| Path::new("/").join(d)))
            .collect();
        for program in PROGRAMS {
            // The driver's own folder first: a host can have a wrapper of the same name on its
            // PATH (one that runs "the next nvidia-smi on the PATH"), which in a container finds
            // nothing but itself.
            let found = program_dirs
                .iter()
                .find_map(|d| resolve(root, &d.join(program)))
                .and_then(rel);
            if let Some(found) = found {
                files.push(DriverFile {
                    rel: found,
                    container_path: Path::new(CONTAINER_BIN_DIR).join(program),
                });
            }
        }
        for dir in FIRMWARE_DIRS {
            let firmware = Path::new(dir).join("nvidia").join(version);
            if root.join(&firmware).is_dir() {
                files.push(DriverFile {
                    container_path: Path::new("/").join(&firmware),
                    rel: firmware,
                });
                break;
            }
        }
        DriverFiles {
            version: version.to_owned(),
            host_root: host_root.to_owned(),
            root: root.to_owned(),
            files,
        }
    }

    /// The driver's program `name` (`nvidia-cuda-mps-control`) as devplug sees it, if found.
    pub fn program(&self, name: &str) -> Option<PathBuf> {
        self.files
            .iter()
            .find(|f| f.container_path == Path::new(CONTAINER_BIN_DIR).join(name))
            .map(|f| self.root.join(&f.rel))
    }

    /// The folder of the driver's libraries as devplug sees it (for the programs it runs).
    pub fn lib_dir(&self) -> Option<PathBuf> {
        self.files
            .iter()
            .find(|f| f.container_path.starts_with(CONTAINER_LIB_DIR))
            .and_then(|f| self.root.join(&f.rel).parent().map(Path::to_path_buf))
    }

    /// True if the driver's CUDA library was found (without it, nothing here makes CUDA work).
    pub fn has_cuda(&self) -> bool {
        self.files
            .iter()
            .any(|f| f.container_path.ends_with("libcuda.so.1"))
    }

    /// The read-only mounts, with host paths.
    pub fn mounts(&self) -> Vec<Mount> {
        self.files
            .iter()
            .map(|f| Mount {
                host_path: self.host_root.join(&f.rel).display().to_string(),
                container_path: f.container_path.display().to_string(),
                read_only: true,
            })
            .collect()
    }

    /// The mounts as container edits.
    pub fn edits(&self) -> ContainerEdits {
        ContainerEdits {
            mounts: self.mounts(),
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests;
