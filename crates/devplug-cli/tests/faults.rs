//! Faults an operator hits with the real binary: signals other than SIGTERM, a
//! kubelet folder that cannot be written at shutdown, a wrong `--kubelet-dir`, and Ctrl-C in the
//! demo. Each test fails on the code before its fix.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

mod support;

use kubelet_sim::Kubelet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;
use support::{Devplug, BIN};

const WAIT: Duration = Duration::from_secs(10);
const RESOURCE: &str = "example.com/npu";

fn config(dir: &Path) -> PathBuf {
    let path = dir.join("config.yaml");
    std::fs::write(
        &path,
        format!("resources:\n  - name: {RESOURCE}\n    virtual: {{ count: 2 }}\n"),
    )
    .unwrap();
    path
}

/// Starts a kubelet and `devplug run`, and waits until the resource is registered; returns
/// the plugin's socket.
async fn serving(dir: &Path) -> (Kubelet, Devplug, PathBuf) {
    let plugins = dir.join("device-plugins");
    let kubelet = Kubelet::start(&plugins).await.unwrap();
    let devplug = Devplug::run(&config(dir), &plugins);
    let socket = kubelet
        .wait_for(WAIT, |n| n.resource(RESOURCE)?.socket().cloned())
        .await
        .expect("devplug registers");
    (kubelet, devplug, socket)
}

#[tokio::test]
async fn sighup_and_sigquit_end_run_like_sigterm() {
    for signal in ["HUP", "QUIT"] {
        let dir = tempfile::tempdir().unwrap();
        let (_kubelet, devplug, socket) = serving(dir.path()).await;
        let (status, stderr) = devplug.stop_with(signal, WAIT).await;
        assert!(status.success(), "SIG{signal}: {status:?}\n{stderr}");
        assert!(
            stderr.contains(&format!("SIG{signal} received")),
            "{stderr}"
        );
        assert!(!socket.exists(), "SIG{signal} leaves the socket behind");
        assert!(stderr.contains("sockets removed; bye"), "{stderr}");
    }
}

/// Root ignores permission bits, so the folder is made immutable (`chattr +i`) to stand for a
/// read-only kubelet folder.
#[tokio::test]
async fn shutdown_says_which_socket_it_could_not_remove() {
    let dir = tempfile::tempdir().unwrap();
    let (_kubelet, devplug, socket) = serving(dir.path()).await;
    let plugins = socket.parent().unwrap().to_owned();
    let immutable = Command::new("chattr").arg("+i").arg(&plugins).status();
    if !immutable.is_ok_and(|s| s.success()) {
        eprintln!(
            "SKIPPED shutdown_says_which_socket_it_could_not_remove: `chattr +i` is not \
             available here (needs e2fsprogs and CAP_LINUX_IMMUTABLE on a filesystem that \
             supports it)"
        );
        return;
    }
    let (status, stderr) = devplug.terminate(WAIT).await;
    let _ = Command::new("chattr").arg("-i").arg(&plugins).status();
    assert!(status.success(), "{status:?}\n{stderr}");
    assert!(socket.exists());
    assert!(
        !stderr.contains("sockets removed; bye"),
        "claims the sockets were removed:\n{stderr}"
    );
    assert!(stderr.contains("could not be removed"), "{stderr}");
    let name = socket.file_name().unwrap().to_string_lossy().into_owned();
    assert!(stderr.contains(&name), "the socket is named:\n{stderr}");
}

#[tokio::test]
async fn a_wrong_kubelet_dir_is_not_created_but_waited_for_with_one_warning() {
    let dir = tempfile::tempdir().unwrap();
    let plugins = dir.path().join("var/lib/kubelet/device-plugins");
    let devplug = Devplug::run(&config(dir.path()), &plugins);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!plugins.exists(), "devplug created the kubelet folder");
    assert!(!dir.path().join("var").exists());

    // A kubelet shows up there after all: registered, event-driven.
    let kubelet = Kubelet::start(&plugins).await.unwrap();
    kubelet
        .wait_for(WAIT, |n| (n.capacity(RESOURCE) == (2, 2)).then_some(()))
        .await
        .expect("registered once the folder exists");
    let (status, stderr) = devplug.terminate(WAIT).await;
    assert!(status.success(), "{stderr}");
    let warnings: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("no kubelet here yet"))
        .collect();
    assert_eq!(warnings.len(), 1, "one warning:\n{stderr}");
    for needle in [
        "--kubelet-dir",
        "/var/lib/k0s/kubelet/device-plugins",
        "microk8s",
    ] {
        assert!(
            warnings[0].contains(needle),
            "{needle:?} in {}",
            warnings[0]
        );
    }
    assert!(warnings[0].contains(&plugins.display().to_string()));
}

#[test]
fn ctrl_c_during_the_demo_removes_its_temp_folder() {
    let mut child = Command::new(BIN)
        .arg("demo")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let folder = lines
        .by_ref()
        .map_while(Result::ok)
        .find_map(|l| l.strip_prefix("device-plugins folder: ").map(PathBuf::from))
        .expect("the demo names its folder");
    assert!(folder.exists());
    let pid = child.id().to_string();
    assert!(Command::new("kill")
        .args(["-INT", &pid])
        .status()
        .unwrap()
        .success());
    // Drain the rest so the demo never blocks on a full pipe.
    for _ in lines.by_ref() {}
    let status = child.wait().unwrap();
    assert!(
        !folder.exists(),
        "the temp folder {} is left behind (exit {status:?})",
        folder.display()
    );
}
