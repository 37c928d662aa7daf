//! The `devplug` binary itself: the demo, `run` against the kubelet simulator with SIGTERM, and
//! config errors.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

mod support;

use kubelet_sim::Kubelet;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;
use support::{Devplug, BIN};

const WAIT: Duration = Duration::from_secs(10);

fn devplug(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().unwrap()
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

#[test]
fn nvidia_demo_runs_on_the_fake_nvml_and_exits_0() {
    let exe = std::env::current_exe().unwrap();
    let lib = exe.parent().unwrap().join("libfake_nvml.so");
    let out = devplug(&["demo", "nvidia", "--library", lib.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for needle in [
        "node capacity nvidia.com/gpu: 8, allocatable 8",
        "NVIDIA_VISIBLE_DEVICES=GPU-",
        "CDI device nvidia.com/gpu=GPU-",
        "allocatable 7; GPU-",
        "Unhealthy (xid 79: GPU has fallen off the bus (recovery action GPU_RESET))",
        "allocatable 8",
        "done.",
    ] {
        assert!(stdout.contains(needle), "missing {needle:?} in:\n{stdout}");
    }
    // The 4 GPUs are one of the DGX-1's two fully NVLinked quads (indexes 0-3 or 4-7).
    let quad: Vec<char> = stdout
        .lines()
        .filter_map(|l| {
            l.trim()
                .strip_prefix("GPU-1d0c0000-0000-4000-8000-00000000000")
        })
        .filter_map(|rest| rest.chars().next())
        .collect();
    assert_eq!(quad.len(), 4, "{stdout}");
    assert!(
        quad.iter().all(|c| ('0'..='3').contains(c))
            || quad.iter().all(|c| ('4'..='7').contains(c)),
        "{stdout}"
    );
}

#[test]
fn demo_runs_the_whole_story_and_exits_0() {
    let out = devplug(&["demo"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for needle in [
        "registered as devplug-dummy.com_npu-",
        "capacity 8, allocatable 8",
        "container env: DUMMY_VISIBLE_DEVICES=npu-0,npu-1",
        "capacity 8, allocatable 7",
        "right after the restart: capacity 0, allocatable 0",
        "registered again in",
        "the kubelet found our socket in plugins_registry",
        "after a kubelet restart it streams again in",
        "capacity 8, allocatable 0",
        "done.",
    ] {
        assert!(stdout.contains(needle), "missing {needle:?} in:\n{stdout}");
    }
}

#[tokio::test]
async fn run_serves_the_config_and_sigterm_removes_the_socket() {
    let dir = tempfile::tempdir().unwrap();
    let plugins = dir.path().join("device-plugins");
    let kubelet = Kubelet::start(&plugins).await.unwrap();
    let config = write(
        dir.path(),
        "config.yaml",
        "resources:\n  - name: example.com/npu\n    virtual:\n      count: 64\n      env: DUMMY_VISIBLE_DEVICES\n  - name: example.com/other\n    virtual: { count: 3 }\n",
    );
    let devplug = Devplug::run(Path::new(&config), &plugins);

    let socket = kubelet
        .wait_for(WAIT, |n| {
            let r = n.resource("example.com/npu")?;
            (r.capacity() == 64 && n.capacity("example.com/other") == (3, 3))
                .then(|| r.socket().cloned())?
        })
        .await
        .expect("devplug run registers both resources");
    assert!(socket.exists());
    let a = kubelet
        .allocate("pod", "main", "example.com/npu", 2)
        .await
        .unwrap();
    assert_eq!(a.env("DUMMY_VISIBLE_DEVICES"), Some("virtual-0,virtual-1"));

    let (status, stderr) = devplug.terminate(WAIT).await;
    assert!(status.success(), "exit status {status:?}\n{stderr}");
    assert!(stderr.contains("SIGTERM received"), "{stderr}");
    assert!(!socket.exists(), "the socket is removed on SIGTERM");
    let left: Vec<_> = std::fs::read_dir(&plugins)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(left, vec![std::ffi::OsString::from("kubelet.sock")]);
    // The kubelet sees the plugin gone: devices unhealthy until the grace period ends.
    kubelet
        .wait_for(WAIT, |n| {
            (n.capacity("example.com/npu") == (64, 0)).then_some(())
        })
        .await
        .unwrap();
}

#[test]
fn a_bad_config_names_the_field_and_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "resources:\n  - name: example.com/npu\n    virtual:\n      cout: 64\n",
            "unknown field `cout`",
        ),
        (
            "resources:\n  - name: example.com/npu\n    virtual: { count: 0 }\n",
            "resources[0] (example.com/npu): virtual.count: must be between 1 and 50000",
        ),
        (
            "resources:\n  - name: npu\n    virtual: { count: 2 }\n",
            "resources[0] (npu): name: invalid resource name \"npu\"",
        ),
    ];
    for (text, needle) in cases {
        let config = write(dir.path(), "bad.yaml", text);
        let out = devplug(&[
            "run",
            "--config",
            &config,
            "--kubelet-dir",
            dir.path().to_str().unwrap(),
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains(needle),
            "{stderr:?} should contain {needle:?}"
        );
        assert!(
            stderr.contains("bad.yaml"),
            "the message names the file: {stderr}"
        );
    }
    let out = devplug(&["run", "--config", "/nonexistent/devplug.yaml"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("cannot read config file /nonexistent/devplug.yaml"));
}

#[test]
fn help_is_there_for_every_command() {
    for args in [&["--help"][..], &["run", "--help"], &["demo", "--help"]] {
        let out = devplug(args);
        assert!(out.status.success());
        assert!(String::from_utf8_lossy(&out.stdout).contains("Usage"));
    }
}

/// `check-config --discover` reports what each resource finds and what a container gets; a
/// backend's warnings name their resource (here a hostdev pattern that matches nothing).
#[test]
fn check_config_discover_reports_devices_and_warnings_name_their_resource() {
    let dir = tempfile::tempdir().unwrap();
    let config = write(
        dir.path(),
        "config.yaml",
        "resources:\n  - name: example.com/npu\n    virtual: { count: 3, env: NPUS }\n  \
         - name: example.com/typo\n    hostdev: { groups: [ { paths: [\"/dev/devplug-no-such-node*\"] } ] }\n",
    );
    let out = devplug(&["check-config", "--discover", "--config", &config]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(
        stdout.contains("example.com/npu: 3 devices, 3 healthy"),
        "{stdout}"
    );
    assert!(stdout.contains("    env NPUS="), "{stdout}");
    assert!(
        stdout.contains("example.com/typo: 0 devices, 0 healthy"),
        "{stdout}"
    );
    let warning = stderr
        .lines()
        .find(|l| l.contains("matches no device"))
        .unwrap_or_else(|| panic!("no warning: {stderr}"));
    assert!(warning.contains("resource=example.com/typo"), "{warning}");
}

/// `capacity` with no cluster to talk to says so in one short line naming what it looked for.
#[test]
fn capacity_without_a_cluster_says_what_it_looked_for() {
    let home = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args(["capacity", "list", "--node", "n"])
        .env("HOME", home.path())
        .env_remove("KUBECONFIG")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    let want = format!(
        "KUBECONFIG is not set, {} does not exist, and this is not a pod",
        home.path().join(".kube/config").display()
    );
    assert!(err.contains(&want), "{err}");
    assert!(!err.contains("'\""), "no doubled quotes: {err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}
