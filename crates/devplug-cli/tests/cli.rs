//! The `devplug` binary itself: the demo, `run` against the kubelet simulator with SIGTERM, and
//! config errors.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use kubelet_sim::Kubelet;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_devplug");
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
    let mut child = Command::new(BIN)
        .args([
            "run",
            "--config",
            &config,
            "--kubelet-dir",
            plugins.to_str().unwrap(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();

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

    let sent = Instant::now();
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(sent.elapsed() < WAIT, "devplug did not exit after SIGTERM");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
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
