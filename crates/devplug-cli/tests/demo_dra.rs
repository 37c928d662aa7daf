//! `devplug demo --dra`, the real binary: the whole DRA path against etcd, kube-apiserver and
//! kube-scheduler from `KUBEBUILDER_ASSETS` (skipped loudly without it, failed without it under
//! `DEVPLUG_REQUIRE_API_SERVER`), its temp folder and control plane gone at the end and on
//! Ctrl-C; without the binaries, a non-zero exit that says how to get them. Full build only;
//! devplug-lite's refusal is in tests/lite.rs.
#![cfg(feature = "cluster")]
#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use devplug_testkit::api_server;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_devplug");

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The folder the demo names on its second line.
fn folder_of(stdout: &str) -> PathBuf {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("folder: "))
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("the demo names its folder:\n{stdout}"))
}

/// The processes whose command line names `folder` (etcd's data dir, the API server's
/// certificates, the scheduler's kubeconfig all live there), waiting up to `wait` for them to
/// end.
fn processes_in(folder: &Path, wait: Duration) -> Vec<String> {
    let needle = folder.display().to_string();
    let deadline = Instant::now() + wait;
    loop {
        let found: Vec<String> = std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
            .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
            .map(|c| text(&c).replace('\0', " "))
            .filter(|c| c.contains(&needle))
            .collect();
        if found.is_empty() || Instant::now() >= deadline {
            return found;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// How long processes may take to end after the demo exits (none should be left at all).
const GONE: Duration = Duration::from_secs(5);

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[test]
fn the_dra_demo_walks_the_whole_path_and_cleans_up() {
    let Some(assets) =
        api_server::assets_or_skip("the_dra_demo_walks_the_whole_path_and_cleans_up")
    else {
        return;
    };
    let out = Command::new(BIN)
        .args(["demo", "--dra"])
        .env("KUBEBUILDER_ASSETS", &assets)
        .output()
        .unwrap();
    let stdout = text(&out.stdout);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(stderr, "", "nothing on stderr");
    for needle in [
        "etcd, kube-apiserver and kube-scheduler start from",
        "is ready after",
        "Node demo-node joins",
        "devplug serves DRA driver npu.example.com: 4 virtual NPUs on 2 NUMA nodes",
        "ResourceSlice demo-node-npu.example.com-",
        "pool demo-node, generation 1, 4 devices",
        "DEVICE  MODEL     NUMA  MEMORY",
        "npu-0   dummy-x1  0     17179869184 (16 GiB)",
        "npu-3   dummy-x1  1     17179869184 (16 GiB)",
        "registered the driver (v1.DRAPlugin)",
        "DeviceClass npu: device.driver == \"npu.example.com\"",
        "where device.attributes[\"npu.example.com\"].numa == 1",
        "allocated npu-2, npu-3 (driver npu.example.com, pool demo-node, request npus)",
        "the claim is reserved for pods/trainer; the pod is bound to demo-node",
        "NodePrepareResources on ",
        "answered in",
        "devices npu-2, npu-3",
        "CDI id: npu.example.com/claim=",
        "env NPU_VISIBLE_DEVICES=npu-2,npu-3",
        "device node /dev/npu2 (rw)",
        "device node /dev/npu3 (rw)",
        "NodeUnprepareResources",
        ".json: removed",
        "driver gpu.example.com publishes gpu-0 with allowMultipleAllocations",
        "consumed cores 40, memory 4Gi",
        ": pending, 20 cores left",
        "GPU_VISIBLE_DEVICES=gpu-0 GPU_VISIBLE_DEVICES_CORES=40 GPU_VISIBLE_DEVICES_MEMORY=4294967296",
        "ResourceSlices left for demo-node: 0",
        "etcd, kube-apiserver and kube-scheduler stopped in",
        "done.",
    ] {
        assert!(stdout.contains(needle), "missing {needle:?} in:\n{stdout}");
    }
    assert_eq!(
        stdout.matches(": gpu-0 share ").count(),
        2,
        "two pods share the GPU:\n{stdout}"
    );
    let folder = folder_of(&stdout);
    assert!(
        !folder.exists(),
        "the temp folder {} is left",
        folder.display()
    );
    assert_eq!(
        processes_in(&folder, GONE),
        Vec::<String>::new(),
        "left running"
    );
}

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[test]
fn ctrl_c_during_the_dra_demo_stops_the_control_plane_and_removes_its_folder() {
    let Some(assets) = api_server::assets_or_skip(
        "ctrl_c_during_the_dra_demo_stops_the_control_plane_and_removes_its_folder",
    ) else {
        return;
    };
    let mut child = Command::new(BIN)
        .args(["demo", "--dra"])
        .env("KUBEBUILDER_ASSETS", &assets)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut folder = None;
    // Interrupt once the control plane runs and the demo is using it.
    for line in lines.by_ref().map_while(Result::ok) {
        if let Some(f) = line.strip_prefix("folder: ") {
            folder = Some(PathBuf::from(f));
        }
        if line.starts_with("[2] ") {
            break;
        }
    }
    let folder = folder.expect("the demo names its folder");
    assert!(
        !processes_in(&folder, Duration::ZERO).is_empty(),
        "the control plane runs"
    );
    let pid = child.id().to_string();
    assert!(Command::new("kill")
        .args(["-INT", &pid])
        .status()
        .unwrap()
        .success());
    for _ in lines.by_ref() {}
    let out = child.wait_with_output().unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("interrupted; the control plane is stopped"),
        "{stderr}"
    );
    assert!(
        !folder.exists(),
        "the temp folder {} is left",
        folder.display()
    );
    assert_eq!(
        processes_in(&folder, GONE),
        Vec::<String>::new(),
        "left running"
    );
}

#[test]
fn without_the_binaries_the_dra_demo_says_how_to_get_them() {
    let empty = tempfile::tempdir().unwrap();
    let out: Output = Command::new(BIN)
        .args(["demo", "--dra"])
        .env("KUBEBUILDER_ASSETS", empty.path())
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(text(&out.stdout), "", "nothing started, nothing narrated");
    for needle in [
        "devplug demo --dra needs etcd, kube-apiserver and kube-scheduler",
        &format!(
            "KUBEBUILDER_ASSETS={} lacks etcd, kube-apiserver, kube-scheduler",
            empty.path().display()
        ),
        "`setup-envtest use 1.36.x -p path`",
        "kube-scheduler of the same version",
    ] {
        assert!(stderr.contains(needle), "missing {needle:?} in:\n{stderr}");
    }
}

#[test]
fn help_man_and_completions_know_dra() {
    let help = Command::new(BIN).args(["demo", "--help"]).output().unwrap();
    assert!(help.status.success());
    assert!(
        text(&help.stdout).contains("--dra"),
        "{}",
        text(&help.stdout)
    );
    let man = Command::new(BIN).arg("man").output().unwrap();
    assert!(text(&man.stdout).contains("dra"));
    let bash = Command::new(BIN)
        .args(["completions", "bash"])
        .output()
        .unwrap();
    assert!(text(&bash.stdout).contains("--dra"));
    // `--dra` is a demo of its own: not with `nvidia` or `--library`.
    let both = Command::new(BIN)
        .args(["demo", "nvidia", "--dra"])
        .output()
        .unwrap();
    assert_eq!(both.status.code(), Some(2), "{}", text(&both.stderr));
    assert!(text(&both.stderr).contains("cannot be used with"));
}
