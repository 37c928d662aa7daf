//! The two builds of the binary: the full `devplug` (cargo features `cluster` and `tools`, the
//! default) and `devplug-lite` (`--no-default-features`: no Kubernetes API client, no demo,
//! inspect, completions or man page). Each test checks what the
//! build under test must do, so both `cargo test -p devplug-cli` and
//! `cargo test -p devplug-cli --no-default-features --test lite` (in .ci/run) mean something:
//! the lean build refuses every setting that needs the API server, naming it and the fix, and
//! the full build accepts it.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_devplug");
const LITE: bool = cfg!(not(feature = "cluster"));

/// The fix every refusal names.
const FIX: &str = "run the full `devplug` binary instead (in the image: /devplug), or build with \
                   `--features cluster`";

fn devplug(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env_remove("NODE_NAME")
        .env_remove("DEVPLUG_NODE_EVENTS")
        .env_remove("KUBECONFIG")
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

const ADVERTISING: &str = "resources:
  - name: example.com/npu
    virtual: { count: 2 }
  - name: example.com/dongle
    advertise: { count: 4 }
";

#[test]
fn version_names_the_build() {
    let out = devplug(&["--version"]);
    assert!(out.status.success());
    let said = String::from_utf8_lossy(&out.stdout);
    let name = if LITE { "devplug-lite " } else { "devplug " };
    assert!(said.starts_with(name), "{said:?}");
}

#[test]
fn check_config_refuses_advertise_only_in_the_lean_build() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(&config, ADVERTISING).unwrap();
    let out = devplug(&["check-config", "--config", config.to_str().unwrap()]);
    if LITE {
        assert!(!out.status.success());
        let err = stderr(&out);
        assert!(
            err.contains(
                "resources[1].advertise: needs the Kubernetes API client, and this is \
                 devplug-lite, the device-plugin-only build"
            ),
            "{err}"
        );
        assert!(err.contains(FIX), "{err}");
    } else {
        assert!(out.status.success(), "{}", stderr(&out));
    }
}

#[test]
fn run_refuses_advertise_in_the_lean_build_before_serving() {
    if !LITE {
        // The full build serves it through the API server: tests/cluster.rs.
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(&config, ADVERTISING).unwrap();
    let plugins = dir.path().join("device-plugins");
    std::fs::create_dir(&plugins).unwrap();
    let out = devplug(&[
        "run",
        "--config",
        config.to_str().unwrap(),
        "--kubelet-dir",
        plugins.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("resources[1].advertise: needs"), "{err}");
    assert!(err.contains(FIX), "{err}");
    // Nothing was served.
    assert_eq!(std::fs::read_dir(&plugins).unwrap().count(), 0);
}

#[test]
fn run_node_events_is_refused_by_the_lean_build() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(
        &config,
        "resources:\n  - name: example.com/npu\n    virtual: { count: 2 }\n",
    )
    .unwrap();
    let plugins = dir.path().join("device-plugins");
    std::fs::create_dir(&plugins).unwrap();
    let out = devplug(&[
        "run",
        "--config",
        config.to_str().unwrap(),
        "--kubelet-dir",
        plugins.to_str().unwrap(),
        "--node-events",
    ]);
    // Either build stops at once: the lean one has no client, the full one no NODE_NAME.
    assert!(!out.status.success());
    let err = stderr(&out);
    if LITE {
        assert!(
            err.contains("--node-events (DEVPLUG_NODE_EVENTS): needs"),
            "{err}"
        );
        assert!(err.contains(FIX), "{err}");
    } else {
        assert!(
            err.contains("--node-events needs this node's name"),
            "{err}"
        );
    }
}

#[test]
fn capacity_is_only_in_the_full_build() {
    let out = devplug(&["capacity", "list", "--node", "n1"]);
    if LITE {
        assert!(!out.status.success());
        let err = stderr(&out);
        assert!(
            err.contains("capacity: needs the Kubernetes API client"),
            "{err}"
        );
        assert!(err.contains(FIX), "{err}");
        // Not advertised in the help of a build that lacks it.
        let help = String::from_utf8_lossy(&devplug(&["--help"]).stdout).into_owned();
        assert!(!help.contains("capacity"), "{help}");
    } else {
        let help = devplug(&["capacity", "--help"]);
        assert!(help.status.success());
        assert!(String::from_utf8_lossy(&help.stdout).contains("list"));
    }
}

#[test]
fn the_tools_are_only_in_the_full_build() {
    let without_tools = cfg!(not(feature = "tools"));
    for command in ["demo", "inspect", "completions", "man"] {
        if without_tools {
            let out = devplug(&[command]);
            assert!(!out.status.success());
            let err = stderr(&out);
            assert!(
                err.contains(&format!("{command}: not in "))
                    && err.contains("(in the image: /devplug)"),
                "{err}"
            );
        }
    }
    if without_tools {
        let err = stderr(&devplug(&["nosuch"]));
        assert!(err.contains("unknown command \"nosuch\""), "{err}");
    } else {
        let out = devplug(&["completions", "bash"]);
        assert!(out.status.success(), "{}", stderr(&out));
    }
}

/// `run`'s log until it says it is running (then SIGTERM), for a config with `refused_pods`.
fn run_log(refused_pods: Option<&str>) -> String {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yaml");
    let line = refused_pods
        .map(|p| format!("refused_pods: {p}\n"))
        .unwrap_or_default();
    std::fs::write(
        &config,
        format!("{line}resources:\n  - name: example.com/npu\n    virtual: {{ count: 2 }}\n"),
    )
    .unwrap();
    let plugins = dir.path().join("device-plugins");
    std::fs::create_dir(&plugins).unwrap();
    let mut child = Command::new(BIN)
        .args(["run", "--config", config.to_str().unwrap(), "--kubelet-dir"])
        .arg(&plugins)
        .env_remove("NODE_NAME")
        .env_remove("KUBECONFIG")
        .env("RUST_LOG", "info")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut log = String::new();
    for line in BufReader::new(child.stderr.take().unwrap()).lines() {
        let line = line.unwrap();
        log.push_str(&line);
        log.push('\n');
        if line.contains("devplug running") {
            break;
        }
    }
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    child.wait().unwrap();
    log
}

#[test]
fn run_says_what_it_cannot_do_about_refused_pods() {
    let log = run_log(None);
    if LITE {
        assert!(
            log.contains("devplug-lite cannot delete or report pods the kubelet refused"),
            "{log}"
        );
    } else {
        // The full build can, but not without this node's name; that is no news worth a line
        // at every start of a devplug run outside a cluster (debug level only).
        assert!(
            !log.contains("refused_pods: without this node's name"),
            "{log}"
        );
    }
    // `off` says nothing of it.
    let log = run_log(Some("off"));
    assert!(!log.contains("refused"), "{log}");
}

/// `node_labels` does not stop either build: devplug-lite says in its log that it cannot write
/// labels, the full build without `NODE_NAME` that it needs the node's name; both serve.
#[test]
fn node_labels_are_said_to_be_unwritable_where_they_cannot_be_written() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(
        &config,
        "node_labels: { mode: direct }\nrefused_pods: off\nresources:\n  - name: example.com/npu\n    virtual: { count: 2 }\n",
    )
    .unwrap();
    let plugins = dir.path().join("device-plugins");
    std::fs::create_dir(&plugins).unwrap();
    let mut child = Command::new(BIN)
        .args(["run", "--config", config.to_str().unwrap()])
        .args(["--kubelet-dir", plugins.to_str().unwrap()])
        .env_remove("NODE_NAME")
        .env_remove("KUBECONFIG")
        .env("RUST_LOG", "warn")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let want = if LITE {
        "devplug-lite cannot write node labels"
    } else {
        "node_labels: without this node's name"
    };
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut seen = Vec::new();
    let found = loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.contains(want) => break true,
            Ok(line) => seen.push(line),
            Err(_) => break false,
        }
    };
    let running = child.try_wait().unwrap().is_none();
    child.kill().unwrap();
    let _ = child.wait();
    assert!(found, "no {want:?} in the log:\n{}", seen.join("\n"));
    assert!(running, "run stopped:\n{}", seen.join("\n"));
}
