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
    // The warning is read from the log: the binary's own default filter, whatever RUST_LOG the
    // test run has.
    let out = Command::new(BIN)
        .args(["check-config", "--discover", "--config", &config])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // The typo finds no device: the status a script gates on, naming the resource.
    assert_eq!(out.status.code(), Some(3), "{stdout}{stderr}");
    assert!(
        stderr.contains("not ready: example.com/typo (no healthy device)"),
        "{stderr}"
    );
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

/// `check-config` exits 0 for a valid file, and with `--discover` when every resource has a
/// healthy device; 1 for an invalid file; 3 when a resource finds no healthy device.
#[test]
fn check_config_exit_status_is_one_a_script_can_gate_on() {
    let dir = tempfile::tempdir().unwrap();
    let good = write(
        dir.path(),
        "good.yaml",
        "resources:\n  - name: example.com/npu\n    virtual: { count: 2 }\n",
    );
    for args in [&["--config", &good][..], &["--discover", "--config", &good]] {
        let out = devplug(&[&["check-config"][..], args].concat());
        assert_eq!(out.status.code(), Some(0), "{args:?}: {out:?}");
    }
    let bad = write(
        dir.path(),
        "bad.yaml",
        "resources:\n  - name: example.com/npu\n    virtual: { count: x }\n",
    );
    for args in [&["--config", &bad][..], &["--discover", "--config", &bad]] {
        let out = devplug(&[&["check-config"][..], args].concat());
        assert_eq!(out.status.code(), Some(1), "{args:?}: {out:?}");
    }
    // A files: folder that is missing: no device, so not ready; valid without --discover.
    let missing = dir.path().join("no-such-folder");
    let empty = write(
        dir.path(),
        "empty.yaml",
        &format!(
            "resources:\n  - name: example.com/npu\n    virtual: {{ count: 2 }}\n  \
             - name: example.com/file\n    files: {{ dir: {} }}\n",
            missing.display()
        ),
    );
    let out = devplug(&["check-config", "--config", &empty]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let out = devplug(&[
        "check-config",
        "--discover",
        "--wait",
        "1s",
        "--config",
        &empty,
    ]);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("not ready: example.com/file (no healthy device)"),
        "{stderr}"
    );
    assert!(!stderr.contains("example.com/npu"), "{stderr}");
    // Why: the folder is missing, and what `run` does about it; in --json as a warning.
    let stdout = String::from_utf8_lossy(&out.stdout);
    let said = format!("warning: files.dir {} does not exist", missing.display());
    assert!(stdout.contains(&said), "{stdout}");
    assert!(stdout.contains("missing: create"), "{stdout}");
    let out = devplug(&[
        "check-config",
        "--discover",
        "--wait",
        "1s",
        "--json",
        "--config",
        &empty,
    ]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let warnings = report["resources"][1]["warnings"].as_array().unwrap();
    assert!(
        warnings
            .iter()
            .any(|w| w.as_str().is_some_and(|w| w.contains("does not exist"))),
        "{report}"
    );
    assert!(
        report["resources"][0]["warnings"]
            .as_array()
            .unwrap()
            .is_empty(),
        "{report}"
    );
    // One device is "1 device".
    let one = write(
        dir.path(),
        "one.yaml",
        "resources:\n  - name: example.com/npu\n    virtual: { count: 1 }\n",
    );
    let out = devplug(&["check-config", "--discover", "--config", &one]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("example.com/npu: 1 device, 1 healthy"),
        "{stdout}"
    );
    // A backend that is not ready: NVML cannot be loaded.
    let nvml = write(
        dir.path(),
        "nvml.yaml",
        "resources:\n  - name: nvidia.com/gpu\n    nvidia: { library: /nonexistent/libnvidia-ml.so.1 }\n",
    );
    let out = devplug(&[
        "check-config",
        "--discover",
        "--wait",
        "5s",
        "--config",
        &nvml,
    ]);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("not ready: nvidia.com/gpu (its backend is not ready)"),
        "{stderr}"
    );
    let out = devplug(&["check-config", "--discover", "--json", "--config", &nvml]);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let why = report["resources"][0]["not_ready"].as_str().unwrap();
    assert!(why.starts_with("NVML not available: "), "{report}");
    // The help says so.
    let help = String::from_utf8_lossy(&devplug(&["check-config", "--help"]).stdout).into_owned();
    for needle in ["Exit status:", "  3  with --discover"] {
        assert!(help.contains(needle), "{help}");
    }
}

/// `check-config --discover` creates nothing on the node: a `files:` folder set to
/// `missing: create` stays missing.
#[test]
fn check_config_discover_creates_no_folder() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("made/by/run");
    let config = write(
        dir.path(),
        "config.yaml",
        &format!(
            "resources:\n  - name: example.com/file\n    files: {{ dir: {}, missing: create }}\n",
            missing.display()
        ),
    );
    let out = devplug(&[
        "check-config",
        "--discover",
        "--wait",
        "1s",
        "--config",
        &config,
    ]);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    assert!(
        !missing.exists(),
        "check-config created {}",
        missing.display()
    );
    assert!(!dir.path().join("made").exists());
}

/// `check-config --json` prints one JSON object: the verdict, and per resource its name,
/// backend, devices with their health, readiness and warnings; an invalid file says so too.
#[test]
fn check_config_json_reports_resources_devices_and_the_verdict() {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("devices");
    std::fs::create_dir(&folder).unwrap();
    std::fs::write(folder.join("good"), "").unwrap();
    std::fs::write(folder.join("bad"), "fan stopped\n").unwrap();
    let config = write(
        dir.path(),
        "config.yaml",
        &format!(
            "resources:\n  - name: example.com/npu\n    virtual: {{ count: 2 }}\n  \
             - name: example.com/file\n    files: {{ dir: {} }}\n  \
             - name: example.com/typo\n    hostdev: {{ groups: [ {{ paths: [\"/dev/devplug-no-such-node*\"] }} ] }}\n",
            folder.display()
        ),
    );
    let out = devplug(&["check-config", "--discover", "--json", "--config", &config]);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.trim().lines().count(), 1, "one object: {stdout}");
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["valid"], true);
    assert_eq!(report["verdict"], "not-ready");
    assert_eq!(report["exit_code"], 3);
    assert_eq!(report["config"], config.as_str());
    let resources = report["resources"].as_array().unwrap();
    let names: Vec<&str> = resources
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["example.com/npu", "example.com/file", "example.com/typo"]
    );
    let backends: Vec<&str> = resources
        .iter()
        .map(|r| r["backend"].as_str().unwrap())
        .collect();
    assert_eq!(backends, ["virtual", "files", "hostdev"]);
    let npu = &resources[0];
    assert_eq!(npu["discovered"], true);
    assert_eq!(npu["ready"], true);
    assert_eq!(npu["healthy"], 2);
    assert_eq!(npu["not_ready"], serde_json::Value::Null);
    assert_eq!(
        npu["devices"],
        serde_json::json!([
            {"id": "virtual-0", "healthy": true, "health": "Healthy"},
            {"id": "virtual-1", "healthy": true, "health": "Healthy"},
        ])
    );
    let files = &resources[1];
    assert_eq!(files["ready"], true);
    assert_eq!(files["healthy"], 1);
    let bad = files["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["id"] == "bad")
        .unwrap();
    assert_eq!(bad["healthy"], false);
    assert!(
        bad["health"].as_str().unwrap().contains("fan stopped"),
        "{bad}"
    );
    let typo = &resources[2];
    assert_eq!(typo["ready"], false);
    assert_eq!(typo["devices"], serde_json::json!([]));
    let warnings = typo["warnings"].as_array().unwrap();
    assert!(
        warnings
            .iter()
            .any(|w| w.as_str().unwrap().contains("matches no device")),
        "{typo}"
    );
    assert_eq!(npu["warnings"], serde_json::json!([]));

    // Without --discover: valid, nothing started.
    let out = devplug(&["check-config", "--json", "--config", &config]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["verdict"], "ok");
    assert_eq!(report["resources"][0]["discovered"], false);
    assert_eq!(report["resources"][0]["backend"], "virtual");

    // An invalid file: exit 1, the object says why, and stderr too.
    let bad = write(
        dir.path(),
        "bad.yaml",
        "resources:\n  - name: example.com/npu\n",
    );
    let out = devplug(&["check-config", "--json", "--config", &bad]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["valid"], false);
    assert_eq!(report["verdict"], "invalid");
    assert!(
        report["error"].as_str().unwrap().contains("no backend"),
        "{report}"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("no backend"));
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
