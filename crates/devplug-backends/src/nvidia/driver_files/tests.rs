//! Tests of `driver_files.rs`.

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

const RUNNING: &str = "580.159.04";

/// Writes `<root>/<dir>/<name>.so.<version>` and, with `soname`, the link
/// `<name>.so.<soname>` to it beside it, as the driver's installers do.
fn library(root: &Path, dir: &str, name: &str, version: &str, soname: Option<&str>) {
    let dir = real(root, Path::new(dir));
    std::fs::create_dir_all(&dir).unwrap();
    let file = format!("{name}.so.{version}");
    std::fs::write(dir.join(&file), name).unwrap();
    if let Some(soname) = soname {
        let link = dir.join(format!("{name}.so.{soname}"));
        let _ = std::fs::remove_file(&link);
        symlink(&file, link).unwrap();
    }
}

/// The three libraries every layout below has, in `dir`.
fn driver_libraries(root: &Path, dir: &str, version: &str) {
    library(root, dir, "libnvidia-ml", version, Some("1"));
    library(root, dir, "libcuda", version, Some("1"));
    library(root, dir, "libnvidia-ptxjitcompiler", version, Some("1"));
}

/// `<root>/etc/ld.so.cache` listing `libs` (name, path) as this machine's libraries.
fn loader_cache(root: &Path, libs: &[(&str, &str)]) {
    let flags = loader::tests::native_flags();
    let entries: Vec<(&str, &str, u32)> = libs.iter().map(|(n, p)| (*n, *p, flags)).collect();
    std::fs::create_dir_all(root.join("etc")).unwrap();
    std::fs::write(
        root.join("etc/ld.so.cache"),
        loader::tests::cache_bytes(&entries),
    )
    .unwrap();
}

/// The container path → host path of each library mount.
fn library_mounts(found: &DriverFiles) -> Vec<(String, String)> {
    found
        .mounts()
        .into_iter()
        .filter(|m| m.container_path.starts_with(CONTAINER_LIB_DIR))
        .map(|m| (m.container_path, m.host_path))
        .collect()
}

fn host(found: &DriverFiles, container: &str) -> Option<String> {
    found
        .mounts()
        .into_iter()
        .find(|m| m.container_path == container)
        .map(|m| m.host_path)
}

#[test]
fn distribution_packages_are_found_through_the_loader_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let dir = "/usr/lib/x86_64-linux-gnu";
    driver_libraries(root, dir, RUNNING);
    loader_cache(
        root,
        &[
            (
                "libnvidia-ml.so.1",
                "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
            ),
            ("libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.1"),
            ("libc.so.6", "/lib/x86_64-linux-gnu/libc.so.6"),
        ],
    );
    let nvml = root.join("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1");
    let found = DriverFiles::locate(root, Path::new("/"), &nvml, RUNNING).unwrap();
    assert!(found.has_cuda());
    assert_eq!(
        host(&found, "/usr/local/nvidia/lib64/libcuda.so.1").as_deref(),
        Some("/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04")
    );
    assert_eq!(
        host(
            &found,
            "/usr/local/nvidia/lib64/libnvidia-ptxjitcompiler.so.1"
        )
        .as_deref(),
        Some("/usr/lib/x86_64-linux-gnu/libnvidia-ptxjitcompiler.so.580.159.04")
    );
    // Versioned name, SONAME and development name for libcuda and NVML; two for the JIT.
    assert_eq!(
        library_mounts(&found).len(),
        8,
        "{:?}",
        library_mounts(&found)
    );
    assert_eq!(found.lib_dir(), Some(root.join("usr/lib/x86_64-linux-gnu")));
}

#[test]
fn the_runfiles_folders_are_searched_without_a_cache_and_32_bit_libraries_are_not_taken() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    // RHEL-like: 64-bit in /usr/lib64, the 32-bit compatibility libraries in /usr/lib.
    driver_libraries(root, "/usr/lib64", RUNNING);
    library(root, "/usr/lib", "libcuda", RUNNING, Some("1"));
    let nvml = root.join("usr/lib64/libnvidia-ml.so.1");
    let found = DriverFiles::locate(root, Path::new("/"), &nvml, RUNNING).unwrap();
    assert_eq!(
        host(&found, "/usr/local/nvidia/lib64/libcuda.so.1").as_deref(),
        Some("/usr/lib64/libcuda.so.580.159.04")
    );
    // A cache that lists the 32-bit libcuda first (as another architecture's) changes
    // nothing.
    let flags = loader::tests::native_flags();
    std::fs::create_dir_all(root.join("etc")).unwrap();
    std::fs::write(
        root.join("etc/ld.so.cache"),
        loader::tests::cache_bytes(&[
            ("libcuda.so.1", "/usr/lib/libcuda.so.1", 0x0003),
            ("libcuda.so.1", "/usr/lib64/libcuda.so.1", flags),
        ]),
    )
    .unwrap();
    let found = DriverFiles::locate(root, Path::new("/"), &nvml, RUNNING).unwrap();
    assert_eq!(
        host(&found, "/usr/local/nvidia/lib64/libcuda.so.1").as_deref(),
        Some("/usr/lib64/libcuda.so.580.159.04")
    );

    // Debian's runfile layout: everything in /usr/lib.
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    driver_libraries(root, "/usr/lib", RUNNING);
    let nvml = root.join("usr/lib/libnvidia-ml.so.1");
    let found = DriverFiles::locate(root, Path::new("/"), &nvml, RUNNING).unwrap();
    assert_eq!(
        host(&found, "/usr/local/nvidia/lib64/libcuda.so").as_deref(),
        Some("/usr/lib/libcuda.so.580.159.04")
    );
}

#[test]
fn the_gpu_operators_driver_container_is_read_through_its_own_cache_at_host_paths() {
    let tmp = tempfile::tempdir().unwrap();
    // devplug sees the host's /run/nvidia/driver at /driver-root (the chart's mount).
    let root = tmp.path().join("driver-root");
    driver_libraries(&root, "/usr/lib/x86_64-linux-gnu", RUNNING);
    std::fs::create_dir_all(root.join("usr/bin")).unwrap();
    std::fs::write(root.join("usr/bin/nvidia-smi"), "smi").unwrap();
    loader_cache(
        &root,
        &[("libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.1")],
    );
    let nvml = root.join("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1");
    let found =
        DriverFiles::locate(&root, Path::new("/run/nvidia/driver"), &nvml, RUNNING).unwrap();
    assert_eq!(
        host(&found, "/usr/local/nvidia/lib64/libcuda.so.1").as_deref(),
        Some("/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04")
    );
    assert_eq!(
        host(&found, "/usr/local/nvidia/bin/nvidia-smi").as_deref(),
        Some("/run/nvidia/driver/usr/bin/nvidia-smi")
    );
    assert_eq!(
        found.program("nvidia-smi"),
        Some(root.join("usr/bin/nvidia-smi"))
    );
}

/// As seen on a lent H100 machine: NVML loads from /usr/lib, libcuda and the rest sit in
/// /usr/local/nvidia/lib64, which only ld.so.conf.d names; nvidia-smi beside them, and a
/// wrapper of that name on the PATH.
#[test]
fn the_split_layout_is_found_through_ld_so_conf() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let split = "/usr/local/nvidia/lib64";
    driver_libraries(root, split, RUNNING);
    library(root, split, "libnvidia-nvvm", RUNNING, Some("4"));
    library(root, split, "libnvidia-gpucomp", RUNNING, None);
    std::fs::create_dir_all(root.join("usr/lib")).unwrap();
    std::fs::write(root.join("usr/lib/libnvidia-ml.so.1"), "nvml").unwrap();
    std::fs::create_dir_all(root.join("etc/ld.so.conf.d")).unwrap();
    std::fs::write(
        root.join("etc/ld.so.conf"),
        "include /etc/ld.so.conf.d/*.conf
",
    )
    .unwrap();
    std::fs::write(
        root.join("etc/ld.so.conf.d/000_cuda.conf"),
        "/usr/local/nvidia/lib64
",
    )
    .unwrap();
    std::fs::create_dir_all(root.join("usr/local/nvidia/bin")).unwrap();
    std::fs::write(root.join("usr/local/nvidia/bin/nvidia-smi"), "smi").unwrap();
    // The lent H100 machine also has a wrapper script /usr/bin/nvidia-smi on the PATH; in a
    // container it finds only itself, so the driver's own program must win.
    std::fs::create_dir_all(root.join("usr/bin")).unwrap();
    std::fs::write(
        root.join("usr/bin/nvidia-smi"),
        "#!/bin/sh\nexec next-on-path",
    )
    .unwrap();
    let nvml = root.join("usr/lib/libnvidia-ml.so.1");
    let found = DriverFiles::locate(root, Path::new("/"), &nvml, RUNNING).unwrap();
    assert!(found.has_cuda());
    for (container, host_path) in [
        ("libcuda.so.1", "libcuda.so.580.159.04"),
        (
            "libnvidia-ptxjitcompiler.so.1",
            "libnvidia-ptxjitcompiler.so.580.159.04",
        ),
        ("libnvidia-nvvm.so.4", "libnvidia-nvvm.so.580.159.04"),
        (
            "libnvidia-gpucomp.so.580.159.04",
            "libnvidia-gpucomp.so.580.159.04",
        ),
        ("libnvidia-ml.so.1", "libnvidia-ml.so.580.159.04"),
    ] {
        assert_eq!(
            host(&found, &format!("{CONTAINER_LIB_DIR}/{container}")),
            Some(format!("{split}/{host_path}")),
            "{container}"
        );
    }
    assert_eq!(
        host(&found, "/usr/local/nvidia/bin/nvidia-smi").as_deref(),
        Some("/usr/local/nvidia/bin/nvidia-smi")
    );
    assert_eq!(found.lib_dir(), Some(root.join("usr/local/nvidia/lib64")));
    // Without ld.so.conf but with the loader cache listing the folder: the same.
    std::fs::remove_file(root.join("etc/ld.so.conf")).unwrap();
    loader_cache(
        root,
        &[("libcuda.so.1", "/usr/local/nvidia/lib64/libcuda.so.1")],
    );
    let again = DriverFiles::locate(root, Path::new("/"), &nvml, RUNNING).unwrap();
    assert_eq!(again, found);
    // NVML in /usr/lib as an absolute link into the driver's folder: read in the root.
    std::fs::remove_file(root.join("usr/lib/libnvidia-ml.so.1")).unwrap();
    symlink(
        "/usr/local/nvidia/lib64/libnvidia-ml.so.1",
        root.join("usr/lib/libnvidia-ml.so.1"),
    )
    .unwrap();
    let linked = DriverFiles::locate(root, Path::new("/"), &nvml, RUNNING).unwrap();
    assert_eq!(linked, found);
}

#[test]
fn libraries_of_another_version_where_the_loader_looks_are_refused_with_the_fix() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    // The running driver's files in the split folder, an older driver's packages left in
    // the multiarch folder, which the cache lists first.
    driver_libraries(root, "/usr/local/nvidia/lib64", RUNNING);
    driver_libraries(root, "/usr/lib/x86_64-linux-gnu", "550.54.15");
    loader_cache(
        root,
        &[
            ("libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.1"),
            ("libcuda.so.1", "/usr/local/nvidia/lib64/libcuda.so.1"),
            (
                "libnvidia-ml.so.1",
                "/usr/local/nvidia/lib64/libnvidia-ml.so.1",
            ),
        ],
    );
    let nvml = root.join("usr/local/nvidia/lib64/libnvidia-ml.so.1");
    let err = DriverFiles::locate(root, Path::new("/"), &nvml, RUNNING).unwrap_err();
    assert_eq!(
        err.files,
        [
            (
                "/usr/lib/x86_64-linux-gnu/libcuda.so.1 \
                     (-> /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15)"
                    .to_owned(),
                "550.54.15".to_owned()
            ),
            (
                "/usr/lib/x86_64-linux-gnu/libnvidia-ptxjitcompiler.so.1 \
                     (-> /usr/lib/x86_64-linux-gnu/libnvidia-ptxjitcompiler.so.550.54.15)"
                    .to_owned(),
                "550.54.15".to_owned()
            ),
        ]
    );
    let text = err.to_string();
    assert!(
        text.starts_with(
            "the driver's libraries are of more than one version: NVML reports driver \
                 580.159.04, but /usr/lib/x86_64-linux-gnu/libcuda.so.1 (-> \
                 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15) is 550.54.15, "
        ),
        "{text}"
    );
    assert!(text.contains("Fix: "), "{text}");
    assert!(text.contains("run `ldconfig`"), "{text}");

    // The old driver's files removed: served from the split folder.
    for name in ["libnvidia-ml", "libcuda", "libnvidia-ptxjitcompiler"] {
        let dir = root.join("usr/lib/x86_64-linux-gnu");
        std::fs::remove_file(dir.join(format!("{name}.so.1"))).unwrap();
        std::fs::remove_file(dir.join(format!("{name}.so.550.54.15"))).unwrap();
    }
    let found = DriverFiles::locate(root, Path::new("/"), &nvml, RUNNING).unwrap();
    assert_eq!(
        host(&found, "/usr/local/nvidia/lib64/libcuda.so.1").as_deref(),
        Some("/usr/local/nvidia/lib64/libcuda.so.580.159.04")
    );
    // A leftover versioned file no SONAME leads to is not a mix (nothing loads it).
    library(root, "/usr/lib64", "libcuda", "535.1.1", None);
    assert!(DriverFiles::locate(root, Path::new("/"), &nvml, RUNNING).is_ok());
    // NVML itself of another version (a new driver installed, the old module running).
    let err = DriverFiles::locate(root, Path::new("/"), &nvml, "570.86.15").unwrap_err();
    assert_eq!(
        err.files[0],
        (
            "/usr/local/nvidia/lib64/libnvidia-ml.so.1 \
                 (-> /usr/local/nvidia/lib64/libnvidia-ml.so.580.159.04)"
                .to_owned(),
            "580.159.04".to_owned()
        )
    );
}

/// CUDA's forward-compatibility package is a newer libcuda on purpose: where ld.so.conf
/// names its folder, that is no mix, and containers still get the running driver's files.
#[test]
fn cudas_forward_compatibility_libraries_are_not_a_mix() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    driver_libraries(root, "/usr/lib/x86_64-linux-gnu", RUNNING);
    library(
        root,
        "/usr/local/cuda-13.1/compat",
        "libcuda",
        "590.44.01",
        Some("1"),
    );
    std::fs::create_dir_all(root.join("etc")).unwrap();
    std::fs::write(root.join("etc/ld.so.conf"), "/usr/local/cuda-13.1/compat\n").unwrap();
    let nvml = root.join("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1");
    let found = DriverFiles::locate(root, Path::new("/"), &nvml, RUNNING).unwrap();
    assert_eq!(
        host(&found, "/usr/local/nvidia/lib64/libcuda.so.1").as_deref(),
        Some("/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04")
    );
}

#[test]
fn links_are_followed_inside_the_root_only() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    library(root, "/usr/lib64", "libcuda", RUNNING, Some("1"));
    let lib = root.join("usr/lib64");
    symlink("../../usr/lib64/libcuda.so.1", lib.join("up.so")).unwrap();
    symlink(
        "../../../../../../usr/lib64/libcuda.so.1",
        lib.join("above.so"),
    )
    .unwrap();
    symlink("loop.so", lib.join("loop.so")).unwrap();
    let at = |p: &str| resolve(root, Path::new(p));
    let file = Some(PathBuf::from("/usr/lib64/libcuda.so.580.159.04"));
    assert_eq!(at("/usr/lib64/libcuda.so.1"), file);
    assert_eq!(at("/usr/lib64/up.so"), file);
    // `..` above the root stays at the root, as in a chroot.
    assert_eq!(at("/usr/lib64/above.so"), file);
    assert_eq!(at("/usr/lib64/loop.so"), None);
    assert_eq!(at("/usr/lib64"), None);
    assert_eq!(at("/usr/lib64/missing.so"), None);
    assert_eq!(
        file_version(Path::new("/x/libcuda.so.580.159.04"), "libcuda").as_deref(),
        Some("580.159.04")
    );
    assert_eq!(file_version(Path::new("/x/libcuda.so.1"), "libcuda"), None);
    assert_eq!(
        file_version(Path::new("/x/libcuda.so.1.1.x"), "libcuda"),
        None
    );
    assert_eq!(
        file_version(Path::new("/x/libcuda.so.580.159.04"), "libnvidia-ml"),
        None
    );
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
