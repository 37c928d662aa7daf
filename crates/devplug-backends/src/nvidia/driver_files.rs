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
//! The lists are the compute and utility sets of the toolkit's driver capabilities
//! (`NVIDIA_DRIVER_CAPABILITIES=compute,utility`): what CUDA and `nvidia-smi` need.

use devplug::{ContainerEdits, Mount};
use std::path::{Path, PathBuf};

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

/// Folders under a driver root that hold its programs, in the order they are searched.
const PROGRAM_DIRS: [&str; 3] = ["usr/bin", "usr/local/bin", "bin"];

/// Folders under a driver root that hold its firmware (`nvidia/<version>` below them).
const FIRMWARE_DIRS: [&str; 2] = ["lib/firmware", "usr/lib/firmware"];

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

/// The driver root a library was loaded from: the longest of `roots` that holds it, or `/`.
pub fn root_of(library: &Path, roots: &[PathBuf]) -> PathBuf {
    roots
        .iter()
        .filter(|r| library.starts_with(r))
        .max_by_key(|r| r.components().count())
        .cloned()
        .unwrap_or_else(|| PathBuf::from("/"))
}

/// A regular file named `name` in `dir`, or the file a relative symlink of that name in the
/// same folder points to (the driver's layout: `libnvidia-ml.so.1 -> libnvidia-ml.so.550.54.15`).
/// Absolute links are not followed: they point into the host's tree, not devplug's view of it.
fn regular_file(dir: &Path, name: &str) -> Option<PathBuf> {
    let path = dir.join(name);
    let meta = std::fs::symlink_metadata(&path).ok()?;
    if meta.is_file() {
        return Some(path);
    }
    if meta.file_type().is_symlink() {
        let target = std::fs::read_link(&path).ok()?;
        if target.is_relative() && target.components().count() == 1 {
            let resolved = dir.join(target);
            if std::fs::symlink_metadata(&resolved).is_ok_and(|m| m.is_file()) {
                return Some(resolved);
            }
        }
    }
    None
}

impl DriverFiles {
    /// Finds the files of driver `version`: libraries in `lib_dir` (the folder NVML was loaded
    /// from), programs and firmware elsewhere under `root`. `host_root` is the same root as the
    /// host names it. Files that are missing are left out (drivers differ in what they ship).
    pub fn find(root: &Path, host_root: &Path, lib_dir: &Path, version: &str) -> DriverFiles {
        let mut files = Vec::new();
        let rel = |p: &Path| p.strip_prefix(root).map(Path::to_path_buf).ok();
        for (name, soname, dev) in LIBRARIES {
            let versioned = format!("{name}.so.{version}");
            let Some(found) = regular_file(lib_dir, &versioned).and_then(|p| rel(&p)) else {
                continue;
            };
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
        for program in PROGRAMS {
            let found = PROGRAM_DIRS
                .iter()
                .find_map(|d| regular_file(&root.join(d), program))
                .and_then(|p| rel(&p));
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
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::os::unix::fs::symlink;

    const VERSION: &str = "550.54.15";

    /// A driver root laid out as NVIDIA's installer leaves it.
    fn driver_root(root: &Path) -> PathBuf {
        let lib = root.join("usr/lib/x86_64-linux-gnu");
        std::fs::create_dir_all(&lib).unwrap();
        for name in [
            "libcuda",
            "libnvidia-ml",
            "libnvidia-nvvm",
            "libnvidia-gpucomp",
        ] {
            std::fs::write(lib.join(format!("{name}.so.{VERSION}")), name).unwrap();
        }
        // Another version's leftover is not this driver's.
        std::fs::write(lib.join("libnvidia-ptxjitcompiler.so.535.1"), "old").unwrap();
        symlink(
            format!("libnvidia-ml.so.{VERSION}"),
            lib.join("libnvidia-ml.so.1"),
        )
        .unwrap();
        std::fs::create_dir_all(root.join("usr/bin")).unwrap();
        std::fs::write(root.join("usr/bin/nvidia-smi"), "smi").unwrap();
        std::fs::create_dir_all(root.join(format!("lib/firmware/nvidia/{VERSION}"))).unwrap();
        lib
    }

    #[test]
    fn finds_this_versions_files_and_mounts_them_at_the_cuda_image_layout() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("driver-root");
        let lib = driver_root(&root);
        let found = DriverFiles::find(&root, Path::new("/run/nvidia/driver"), &lib, VERSION);
        let mounts: Vec<(String, String)> = found
            .mounts()
            .into_iter()
            .map(|m| {
                assert!(m.read_only);
                (m.container_path, m.host_path)
            })
            .collect();
        let host_lib = "/run/nvidia/driver/usr/lib/x86_64-linux-gnu";
        let want = |c: &str, h: &str| (c.to_owned(), h.to_owned());
        assert_eq!(
            mounts,
            [
                want(
                    "/usr/local/nvidia/lib64/libcuda.so.550.54.15",
                    &format!("{host_lib}/libcuda.so.550.54.15")
                ),
                want(
                    "/usr/local/nvidia/lib64/libcuda.so.1",
                    &format!("{host_lib}/libcuda.so.550.54.15")
                ),
                want(
                    "/usr/local/nvidia/lib64/libcuda.so",
                    &format!("{host_lib}/libcuda.so.550.54.15")
                ),
                want(
                    "/usr/local/nvidia/lib64/libnvidia-ml.so.550.54.15",
                    &format!("{host_lib}/libnvidia-ml.so.550.54.15")
                ),
                want(
                    "/usr/local/nvidia/lib64/libnvidia-ml.so.1",
                    &format!("{host_lib}/libnvidia-ml.so.550.54.15")
                ),
                want(
                    "/usr/local/nvidia/lib64/libnvidia-ml.so",
                    &format!("{host_lib}/libnvidia-ml.so.550.54.15")
                ),
                want(
                    "/usr/local/nvidia/lib64/libnvidia-nvvm.so.550.54.15",
                    &format!("{host_lib}/libnvidia-nvvm.so.550.54.15")
                ),
                want(
                    "/usr/local/nvidia/lib64/libnvidia-nvvm.so.4",
                    &format!("{host_lib}/libnvidia-nvvm.so.550.54.15")
                ),
                want(
                    "/usr/local/nvidia/lib64/libnvidia-gpucomp.so.550.54.15",
                    &format!("{host_lib}/libnvidia-gpucomp.so.550.54.15")
                ),
                want(
                    "/usr/local/nvidia/bin/nvidia-smi",
                    "/run/nvidia/driver/usr/bin/nvidia-smi"
                ),
                want(
                    "/lib/firmware/nvidia/550.54.15",
                    "/run/nvidia/driver/lib/firmware/nvidia/550.54.15"
                ),
            ]
        );
        assert!(found.has_cuda());
    }

    #[test]
    fn another_version_or_an_absolute_link_gives_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().to_path_buf();
        let lib = driver_root(&root);
        let other = DriverFiles::find(&root, &root, &lib, "560.1");
        assert!(other.files.iter().all(|f| !f.rel.starts_with("usr/lib")));
        assert!(!other.has_cuda());
        // An absolute link points into the host's tree, which devplug may not see as such.
        std::fs::remove_file(lib.join(format!("libcuda.so.{VERSION}"))).unwrap();
        symlink(
            "/elsewhere/libcuda.so",
            lib.join(format!("libcuda.so.{VERSION}")),
        )
        .unwrap();
        assert!(!DriverFiles::find(&root, &root, &lib, VERSION).has_cuda());
    }

    #[test]
    fn the_root_is_the_longest_driver_root_holding_the_library() {
        let roots = [
            PathBuf::from("/"),
            PathBuf::from("/run/nvidia/driver"),
            PathBuf::from("/driver-root"),
        ];
        let at = |p: &str| root_of(Path::new(p), &roots);
        assert_eq!(
            at("/run/nvidia/driver/usr/lib64/libnvidia-ml.so.1"),
            Path::new("/run/nvidia/driver")
        );
        assert_eq!(at("/usr/lib/libnvidia-ml.so.1"), Path::new("/"));
        assert_eq!(root_of(Path::new("/opt/x.so"), &[]), Path::new("/"));
    }
}
